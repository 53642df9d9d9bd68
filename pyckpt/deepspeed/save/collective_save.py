"""``save_checkpoint``: DeepSpeed's save, called on every rank, complete or invisible.

The order of one call (every rank):

1. **Arrival** (:mod:`.arrival`): every rank must be here; a call on some ranks fails fast, naming
   the missing ones, instead of hanging in DeepSpeed's first barrier. Calls naming different
   folders or tags meet here too: the preflight names that disagreement.
2. **Preflight** (:mod:`.preflight`), one all-gather: rank 0 makes the save folder, removes what
   killed saves left, and takes the tag's staging folder (a hidden sibling, under the output lock of
   :mod:`pyckpt.execution.publisher`); every rank estimates its bytes (:mod:`.space`). All ranks then
   agree on the tag, the staging name and whether the filesystem has room, before anything is written.
3. **DeepSpeed's save** into the staging tag (:mod:`.sync_save`), with ``save_latest=False`` and every
   file write guarded (:mod:`.guarded_io`) so that a failing rank still reaches DeepSpeed's
   collectives. Rank 0 also writes the tokenizer, the model config and ``training_state.json``
   (:mod:`.companions`).
4. **Agreement**, one all-gather of every rank's outcome.
5. **Publication** (:mod:`.publication`) by rank 0 when all succeeded: the staging folder is renamed
   to the tag (an atomic exchange if the tag exists), then ``latest`` is replaced atomically. On any
   failure the staging folder is removed and ``latest`` and earlier checkpoints stay as they were.
   Rank 0 broadcasts the outcome, so every rank returns (or raises) the same (:mod:`.outcome`).
6. Optionally the ranks convert the published checkpoint together (:mod:`.conversions`): to a
   Universal Checkpoint (``universal=True``) and/or a Hugging Face folder (``export="hf"``).

With ``async_save=True`` step 3 writes nothing (:mod:`.async_save`): every file DeepSpeed's save
hands its checkpoint engine is snapshotted into host buffers (:mod:`.snapshot`) and the call
returns; steps 4-5 run on a background thread per rank (:mod:`.background`), agreeing through the
store instead of a collective. Conversions then run at the join. ``keep_last`` prunes older
checkpoints after a publication (:mod:`.retention`). What the call asks for travels through these
steps as one :class:`~.request.SaveRequest`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Optional

from ...execution.distributed import TorchRanks
from .arrival import Arrival
from .async_save import save_async
from .background import AsyncSave
from .conversions import convert_published
from .in_flight import join_all
from .outcome import report_failure
from .preflight import preflight
from .request import SaveRequest
from .snapshot import capture_problem
from .sync_save import save_now

log = logging.getLogger("pyckpt")

WHAT = "pyckpt.deepspeed.save_checkpoint"


def save_checkpoint(engine, save_dir, tag=None, *, tokenizer=None, model_config=None,
                    client_state: Optional[dict] = None, on_error: str = "raise", universal: bool = False,
                    export: Optional[str] = None, exclude_frozen_parameters: bool = False,
                    arrival_timeout: float = 300.0, fsync: bool = False, async_save: bool = False,
                    keep_last: Optional[int] = None, agree_timeout: float = 1800.0,
                    snapshot_limit: Optional[int] = None, memory=None, persist: bool = False,
                    save_latest: bool = True, training_state: bool = True):
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

    ``memory=MemoryTier(...)`` (:class:`pyckpt.deepspeed.MemoryTier`) saves into the job's node-local
    memory folder (tmpfs) instead, by the same rules, keeping the tier's ``keep`` newest there: one copy
    from the state into the files, made in the call with or without ``async_save`` (which then returns a
    finished handle), over the files of a checkpoint that left the tier (:mod:`.slot_save`); one that
    does not fit the tier's budget goes to ``save_dir`` with a warning. Every ``persist_every``-th memory
    checkpoint, or one saved with ``persist=True``, is also copied to ``save_dir`` in the background
    (``keep_last`` then applies there). Under ``pyckpt.deepspeed.enable(memory=...)`` a resume reads the
    newest of the two (:mod:`.memory_save`).

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
    request = SaveRequest(save_dir, tag, tokenizer=tokenizer, model_config=model_config, client_state=client_state,
                          on_error=on_error, universal=universal, export=export,
                          exclude_frozen_parameters=exclude_frozen_parameters, arrival_timeout=arrival_timeout,
                          fsync=fsync, async_save=async_save, keep_last=keep_last, agree_timeout=agree_timeout,
                          snapshot_limit=snapshot_limit, save_latest=save_latest,
                          training_state=training_state).checked()
    if memory is not None:
        from .memory_save import save_to_memory

        return save_to_memory(save_collectively, engine, request, memory, persist)
    return save_collectively(engine, request)


def save_collectively(engine, request: SaveRequest):
    """The save :func:`save_checkpoint` describes, its arguments checked. ``request.share`` (a
    :class:`~.node_share.NodeShare`) makes ``save_dir`` node-local: each node's leader stages,
    publishes and prunes its own node's folder (every rank names its own node's), after the same
    agreement of every rank; None: one folder all ranks share, rank 0 its publisher."""
    # at most one save in flight per engine: the previous one is joined (and its failure reported) first,
    # and a memory checkpoint's persistence too (it meets the other nodes' leaders in the store)
    join_all(engine)
    ckpt_engine = engine.checkpoint_engine
    if getattr(ckpt_engine, "is_decoupled", lambda: False)():
        raise ValueError(f"{WHAT}: the checkpoint engine {type(ckpt_engine).__name__} writes after the call returns "
                         "(decoupled); pyckpt can only publish a checkpoint whose files are written when the save "
                         "returns. Use DeepSpeed's default checkpoint engine")
    if getattr(engine, "use_node_local_storage", lambda: False)():
        raise ValueError(f"{WHAT}: checkpoint.use_node_local_storage is not supported: the checkpoint must be on one "
                         "filesystem all ranks share, so that rank 0 can publish it whole")
    request = request.resolved(engine)
    save_dir, tag, on_error = request.save_dir, request.tag, request.on_error
    group = _process_group()
    rank = group.rank
    t_call = time.perf_counter()
    if request.async_save and request.share is not None:
        # A memory save is one copy from the state into the tier's files in either mode
        # (:mod:`.slot_save`): nothing is left for a background thread, so it runs in the call.
        ok = save_collectively(engine, dataclasses.replace(request, async_save=False, snapshot_limit=None))
        handle = AsyncSave(f"checkpoint {tag}", on_error, rank).finished(ok, None)
        handle.stall_s = time.perf_counter() - t_call
        return handle
    if request.async_save:
        problem = capture_problem(ckpt_engine, engine)
        if problem:
            if rank == 0:
                log.warning("pyckpt: saving %s synchronously: %s", tag, problem)
            # the synchronous save takes no snapshot, so it has no limit either
            ok = save_collectively(engine, dataclasses.replace(request, async_save=False, snapshot_limit=None))
            return AsyncSave(f"checkpoint {tag}", on_error, rank).finished(ok, None)

    # One name for every save, whatever its folder and tag: ranks that disagree on those must still
    # meet here, so that the preflight names the disagreement instead of calling the others absent.
    arrival = Arrival("save", rank, group.size)
    arrival.wait(request.arrival_timeout, WHAT)

    with contextlib.ExitStack() as stack:
        staged = preflight(engine, request, group, arrival, stack)
        if staged.problem:
            failed = report_failure(staged.problem, on_error, rank, published=False)
            return AsyncSave(f"checkpoint {tag}", on_error, rank).finished(False, staged.problem) \
                if request.async_save else failed
        if request.async_save:
            return save_async(engine, request, staged, t_call)
        ok, message, t0 = save_now(engine, request, staged)
    if not ok:
        return report_failure(message, on_error, rank, published=False)
    if rank == 0:
        log.info("pyckpt: saved %s in %.2f s", os.path.join(save_dir, tag), time.perf_counter() - t0)
    return convert_published(save_dir, tag, request.universal, request.export, on_error, rank)


def _process_group() -> TorchRanks:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{WHAT} needs torch.distributed to be initialised (deepspeed.initialize does it)")
    return TorchRanks()
