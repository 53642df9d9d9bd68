"""``pyckpt.deepspeed.save_checkpoint``: the call a user makes, its arguments turned into one
:class:`~.request.SaveRequest` and handed to the save of its destination: the collective save into
``save_dir`` (:mod:`.collective_save`), or the memory tier's (:mod:`.memory_save`), which runs the same
save into its node folders.
"""

from __future__ import annotations

from typing import Optional

from ..tiers.policy import one_tier
from .collective_save import save_collectively
from .memory_save import save_to_memory
from .request import SaveRequest


def save_checkpoint(engine, save_dir, tag=None, *, tokenizer=None, model_config=None,
                    client_state: Optional[dict] = None, on_error: str = "raise", universal: bool = False,
                    export: Optional[str] = None, exclude_frozen_parameters: bool = False,
                    arrival_timeout: float = 300.0, fsync: bool = False, async_save: bool = False,
                    keep_last: Optional[int] = None, agree_timeout: float = 1800.0,
                    snapshot_limit: Optional[int] = None, save_tier=None, persist: bool = False,
                    save_latest: bool = True, training_state: bool = True, memory=None):
    """Save ``engine``'s training checkpoint as ``save_dir/<tag>``; call it on **every** rank.

    What DeepSpeed writes is DeepSpeed's own ``save_checkpoint`` output (the same files, bit for
    bit); around it, rank 0 adds ``tokenizer`` (via ``save_pretrained``), ``model_config`` (a
    transformers config or a dict, as ``config.json``) and ``training_state.json`` (step, samples,
    learning rates, scheduler, topology, versions) to the same folder. ``tag`` defaults to
    ``global_step<N>`` as in DeepSpeed; a tag is one folder name, not hidden, with no whitespace at
    either end and no control characters (``latest`` must name it so that DeepSpeed finds it again).

    The checkpoint is complete or invisible: it is written under a hidden staging name, every
    rank's success is agreed, and only then does rank 0 rename it into place and replace
    ``latest`` (atomically). If any rank fails, nothing is published, ``latest`` and earlier
    checkpoints are untouched, the staging files are removed, and no rank is left waiting:
    ``on_error="raise"`` raises :class:`SaveError` on every rank with every failing rank's
    message; ``"warn"`` logs it once (rank 0, logger ``pyckpt``) and returns False on every rank,
    so training can go on. The free space is checked first, from the state's sizes.

    A call on only some ranks (e.g. under ``if rank == 0:``) raises :class:`~.arrival.CollectiveCallError`
    naming the missing ranks after ``arrival_timeout`` seconds instead of hanging.

    ``universal=True`` then converts the new checkpoint on all ranks together to
    ``save_dir/<tag>_universal`` (``latest_universal`` names it), so the run can be resumed at
    any topology at once; ``export="hf"`` writes the Hugging Face export to ``save_dir/<tag>_hf``.
    Returns True when everything asked for is in place.

    ``async_save=True`` returns as soon as every rank holds a copy of the state DeepSpeed's save
    would write (in host buffers reused by the next save: one snapshot of the rank's state stays
    allocated) and writes the files in the background, byte for byte the files DeepSpeed would
    have written; the checkpoint is published when every rank's files are complete, as above.
    It returns an :class:`~.background.AsyncSave` handle (``done()``, ``wait()``); the next save,
    ``wait()``, ``pyckpt.deepspeed.wait_for_saves()`` or the interpreter's exit joins it, and a
    failure is raised (or warned) there, on every rank. Conversions run at that join. Only
    DeepSpeed's default checkpoint engine can be captured; otherwise the save runs synchronously
    with a warning. ``snapshot_limit`` (bytes per rank) bounds the snapshot: a file that would take
    it past the limit is written during the call instead (so the call blocks for its write); the
    ``engine.destroy()`` join also frees the snapshot.

    ``save_tier=MemoryTier(...)`` (:class:`pyckpt.deepspeed.MemoryTier`; ``memory=`` is its former name,
    still taken) saves into the job's node-local memory folder (tmpfs) instead, by the same rules, keeping
    the tier's ``keep`` newest there: one copy from the state into the files, made in the call with or
    without ``async_save`` (which then returns a finished handle), over the files of a checkpoint that left
    the tier (:mod:`.slot_save`); one that does not fit the tier's budget goes to ``save_dir`` with a
    warning. Every ``persist_every``-th memory checkpoint, or one saved with ``persist=True``, is also
    copied to ``save_dir`` in the background (``keep_last`` then applies there). Under
    ``pyckpt.deepspeed.enable(resume_tier=...)`` a resume reads the newest of the two (:mod:`.memory_save`).

    ``keep_last=K`` removes this job's older checkpoints of ``save_dir`` beyond the K newest (by the
    step each records) once this one is published: only folders whose model-state file is
    DeepSpeed's, for the same parameters; never the one ``latest`` or ``latest_universal`` names, nor
    one another run holds locked (:mod:`.retention`).

    An existing ``save_dir/<tag>`` (and ``<tag>_universal`` / ``<tag>_hf`` when asked for) is replaced
    only when it is what pyckpt writes there (a DeepSpeed checkpoint of the same model, a Universal
    Checkpoint, a Hugging Face export); anything else stops the save on every rank before anything is
    written. Every argument that shapes the save must be the same on every rank: ranks that differ
    (``async_save`` on some only, say) are refused together in the preflight, naming the argument.

    ``save_latest=False`` leaves ``latest`` as it was (DeepSpeed's option of the same name);
    ``training_state=False`` leaves pyckpt's ``training_state.json`` out, so the folder holds DeepSpeed's
    files alone (what ``enable(save=...)`` writes for a caller of DeepSpeed's own method).
    """
    memory = one_tier(save_tier, memory, "save_tier")
    request = SaveRequest(save_dir, tag, tokenizer=tokenizer, model_config=model_config, client_state=client_state,
                          on_error=on_error, universal=universal, export=export,
                          exclude_frozen_parameters=exclude_frozen_parameters, arrival_timeout=arrival_timeout,
                          fsync=fsync, async_save=async_save, keep_last=keep_last, agree_timeout=agree_timeout,
                          snapshot_limit=snapshot_limit, save_latest=save_latest,
                          training_state=training_state).checked()
    if memory is not None:
        return save_to_memory(engine, request, memory, persist)
    return save_collectively(engine, request)
