"""The memory tier under the Hugging Face Trainer: a memory checkpoint every N steps, and a resume from
the newest of memory and the Trainer's own ``checkpoint-N`` folders.

The Trainer saves DeepSpeed's files itself, only at its ``save_steps``, and on a resume it reads its own
state (``trainer_state.json``: the step, the epoch, the data position, the log) from the folder passed
as ``resume_from_checkpoint``. So two pieces close the gap:

* :class:`MemoryCheckpoints`, a ``TrainerCallback``: every ``every``-th step, on every rank, the
  DeepSpeed engine the Trainer runs is saved to the memory tier (:func:`~..save.save_checkpoint` with
  ``memory=``), the Trainer's state riding along in the checkpoint's ``client_state``
  (``hf_trainer_state``: the JSON the Trainer's own save writes; ``hf_lr_scheduler``: the scheduler's
  state where the Trainer, not DeepSpeed, steps it, as the Trainer's ``scheduler.pt``).
* :func:`resume_point`, called on every rank before ``trainer.train(resume_from_checkpoint=...)``: the
  newest of the Trainer's last durable ``checkpoint-N`` and the newest recoverable memory checkpoint
  (:func:`..load.memory_recovery.recover`, compared with the DeepSpeed checkpoint inside
  ``checkpoint-N``). Where memory wins, each node's leader builds a folder the Trainer reads as one of
  its own, ``<node folder>/restore/checkpoint-<step>/``: ``latest``, the tag folder (hard links to the
  recovered files, no second copy) and ``trainer_state.json`` (and ``scheduler.pt``) written from the
  checkpoint's ``client_state``, read by pyckpt's allowlist reader (nothing in it runs).

The engine's load of that folder reads it as it is, also under ``enable(memory=tier)``: a recovery
skips a folder in the node's ``restore/`` (it was put together just now). The ranks' random generators
are not part of a memory checkpoint (the Trainer keeps one file per rank; DeepSpeed's model-state file
holds rank 0's ``client_state`` only): a model that draws random numbers while training (dropout)
draws other ones after a resume from memory than the uninterrupted run would. The tier's persistence
(``persist_every``, the end of a job) copies a memory checkpoint to ``output_dir/<tag>``, DeepSpeed's
layout, which :func:`resume_point` does not take for a Trainer checkpoint.

``transformers`` is imported only when :class:`MemoryCheckpoints` is first used, so ``pyckpt.deepspeed``
imports without it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from typing import Optional

from ...errors import CheckpointFormatError, RankLoadError, check_number, printable
from ..tiers.folder_walk import tag_files
from ..tiers.policy import MemoryTier

log = logging.getLogger("pyckpt")

TRAINER_STATE_KEY = "hf_trainer_state"
SCHEDULER_KEY = "hf_lr_scheduler"
# the Trainer's file names (transformers.trainer.TRAINER_STATE_NAME, SCHEDULER_NAME)
TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.pt"


class _MemoryCheckpoints:
    """Saves the Trainer's DeepSpeed engine to the memory tier every ``every`` steps, on every rank.

    ``trainer.add_callback(MemoryCheckpoints(trainer, tier, every=N))``; the save is
    ``pyckpt.deepspeed.save_checkpoint(engine, trainer.args.output_dir, tag="global_step<step>",
    memory=tier, async_save=async_save)`` with the Trainer's state in its ``client_state``, so that
    :func:`resume_point` can hand the Trainer a folder of its own shape. ``handle`` is the last save's
    outcome (an :class:`~..save.AsyncSave` under ``async_save``); the end of training joins it. After the
    first step, where no save is due then, the tier is readied for the first save (``prepare_memory_tier``).
    The Trainer must run DeepSpeed (``TrainingArguments(deepspeed=...)``)."""

    def __init__(self, trainer, tier: MemoryTier, every: int, async_save: bool = True):
        if not isinstance(tier, MemoryTier):
            raise TypeError(f"tier must be a pyckpt.deepspeed.MemoryTier, not {type(tier).__name__}")
        check_number("every", every, integer=True, low=1)
        if not getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError("MemoryCheckpoints saves the Trainer's DeepSpeed engine, and this Trainer does not run "
                             "DeepSpeed (pass TrainingArguments(deepspeed=<config>))")
        self.trainer = trainer
        self.tier = tier
        self.every = every
        self.async_save = bool(async_save)
        self.handle = None
        self.prepared = None  # what prepare_memory_tier did after the first step of this train()
        self._ready_tried = False

    def _engine(self):
        from deepspeed.runtime.engine import DeepSpeedEngine

        engine = self.trainer.model_wrapped
        if not isinstance(engine, DeepSpeedEngine):
            raise TypeError(f"MemoryCheckpoints: the Trainer's model_wrapped is a {type(engine).__name__}, not the "
                            "DeepSpeed engine; only a Trainer running DeepSpeed can save to the memory tier")
        return engine

    def on_step_end(self, args, state, control, **kwargs):
        due = not state.global_step % self.every
        if not self._ready_tried and not due:
            # after the job's first step (the optimizer's state exists) and before its first memory save: the
            # tier is readied for that save (:func:`~..save.prepare_memory_tier`); a save due at this very step
            # would only pay the same in the preparation
            from ..save import prepare_memory_tier

            self._ready_tried = True
            self.prepared = prepare_memory_tier(self._engine(), self.trainer.args.output_dir, save_tier=self.tier)
        if not due:
            return
        self._ready_tried = True
        from ..save import save_checkpoint

        engine = self._engine()
        client_state = {TRAINER_STATE_KEY: _trainer_state_json(self.trainer, state, control)}
        scheduler = _own_scheduler(self.trainer)
        if scheduler is not None:
            client_state[SCHEDULER_KEY] = scheduler.state_dict()
        self.handle = save_checkpoint(engine, self.trainer.args.output_dir, tag=f"global_step{state.global_step}",
                                      save_tier=self.tier, async_save=self.async_save, client_state=client_state)

    def on_train_end(self, args, state, control, **kwargs):
        from ..save import AsyncSave

        if isinstance(self.handle, AsyncSave):
            self.handle.wait()  # train() returns with its last memory checkpoint published (or its failure said)


def _trainer_state_json(trainer, state, control) -> str:
    """``trainer_state.json`` as the Trainer's own save would write it at this step: its state, with the
    states of the callbacks that keep one (and the control's) recorded, the live state left unchanged."""
    import dataclasses

    from transformers.trainer_callback import ExportableState

    record = dataclasses.asdict(state)
    kept: dict = {}
    for callback in list(trainer.callback_handler.callbacks) + [control]:
        if isinstance(callback, ExportableState):
            name = type(callback).__name__
            if name in kept:  # several of one class: a list, as TrainerState keeps them
                kept[name] = (kept[name] if isinstance(kept[name], list) else [kept[name]]) + [callback.state()]
            else:
                kept[name] = callback.state()
    record["stateful_callbacks"] = kept
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def _own_scheduler(trainer):
    """The Trainer's learning-rate scheduler where the Trainer steps it and keeps it in ``scheduler.pt``
    (DeepSpeed neither steps nor saves it: the Trainer's own optimizer and scheduler); None where
    DeepSpeed's checkpoint holds it."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    if scheduler is None:
        return None
    from accelerate.utils import DeepSpeedSchedulerWrapper

    return None if isinstance(scheduler, DeepSpeedSchedulerWrapper) else scheduler


_CLASS = None


def _callback_class():
    global _CLASS
    if _CLASS is None:
        try:
            from transformers import TrainerCallback
        except ImportError as exc:
            raise ImportError("pyckpt.deepspeed.MemoryCheckpoints is a Hugging Face TrainerCallback: it needs "
                              f"transformers ({exc})") from exc
        _CLASS = type("MemoryCheckpoints", (_MemoryCheckpoints, TrainerCallback),
                      {"__module__": __name__, "__qualname__": "MemoryCheckpoints",
                       "__doc__": _MemoryCheckpoints.__doc__})
    return _CLASS


def __getattr__(name: str):
    if name == "MemoryCheckpoints":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resume_point(output_dir, tier: MemoryTier) -> Optional[str]:
    """What to pass as ``trainer.train(resume_from_checkpoint=...)``: the newest of the Trainer's last
    ``checkpoint-N`` in ``output_dir`` and the newest memory checkpoint every node's share of which a
    live node holds, or None where there is neither. Collective: call it on every rank, after the
    ``TrainingArguments`` (which set up torch.distributed) and before ``train``.

    Where memory wins, the recovered files are put together on each node and each node's leader builds
    ``<node folder>/restore/checkpoint-<step>/`` (``latest``, the tag folder as hard links,
    ``trainer_state.json`` from the checkpoint's ``client_state``); every rank gets its own node's
    path, once every leader has succeeded. A memory checkpoint saved without :class:`MemoryCheckpoints`
    (no Trainer state in it) stops every rank with RankLoadError. Where ``output_dir`` holds no
    ``checkpoint-N``, memory is compared with ``output_dir/latest`` (where the tier persists)."""
    from ..load.hooks import job_ranks
    from ..load.memory_recovery import Alone, raise_failures, recover
    from ..tiers.job_identity import bound
    from ..tiers.links import nodes

    if not isinstance(tier, MemoryTier):
        raise TypeError(f"tier must be a pyckpt.deepspeed.MemoryTier, not {type(tier).__name__}")
    output_dir = os.fspath(output_dir)
    ranks = job_ranks()
    if ranks is None and _launched_size() > 1:
        raise RuntimeError("pyckpt.deepspeed.resume_point is collective, and torch.distributed is not initialised "
                           "in this process of a launch of several: call it after creating the TrainingArguments")
    last = _last_checkpoint(output_dir)
    # the callback saves with output_dir as the save dir: its checkpoints are the ones of that job
    found = recover(tier, last or output_dir, ranks, save_dir=output_dir)
    if found is None:
        return last
    restore, tag = found
    group = ranks or Alone()
    tier, _ = bound(tier, output_dir)
    links = nodes(group, tier.folder, tier.keep, tier.job_name)
    outcome = None
    if links.leader:
        try:
            outcome = {"error": None, "name": _trainer_folder(restore, tag)}
        except Exception as exc:
            from ...execution.distributed import describe_failure

            outcome = {"error": describe_failure(exc), "name": None}
    outcomes = group.all_gather(outcome)
    raise_failures([o["error"] if o else None for o in outcomes], "putting the Trainer's checkpoint folder together")
    name = outcomes[links.leaders[0]]["name"]
    other = {leader: f"its node made {outcomes[leader]['name']} of {tag}, node 0 {name}" for leader in links.leaders
             if outcomes[leader]["name"] != name}
    if other:
        raise RankLoadError("putting the Trainer's checkpoint folder together", other, group.size)
    path = os.path.join(restore, name)
    if group.rank == 0:
        log.info("pyckpt: the Trainer resumes from %s", printable(path))
    return path


def _launched_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() else 1


def _last_checkpoint(output_dir: str) -> Optional[str]:
    """The Trainer's newest ``checkpoint-N`` folder in ``output_dir`` (by N), as the Trainer finds it."""
    if not os.path.isdir(output_dir):
        return None
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir)


def _trainer_folder(restore: str, tag: str) -> str:
    """This node's leader: ``restore/checkpoint-<step>`` built beside the assembled ``restore/<tag>``,
    published whole. Returns its name."""
    from ...execution.publisher import Publisher
    from ..load.memory_recovery import link_or_copy

    source = os.path.join(restore, tag)
    text, scheduler = _trainer_records(source)
    name = f"checkpoint-{_global_step(text, source)}"
    with Publisher(os.path.join(restore, name), overwrite=True, pointer=None) as out:
        os.chmod(out.staging, 0o700)  # as private as the memory tier's other folders
        _link_tree(source, os.path.join(out.staging, tag), link_or_copy)
        with open(os.path.join(out.staging, "latest"), "w", encoding="utf-8") as f:
            f.write(tag)
        with open(os.path.join(out.staging, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(text)
        if scheduler is not None:
            import torch

            torch.save(scheduler, os.path.join(out.staging, SCHEDULER_NAME))
        out.publish()
    return name


def _trainer_records(folder: str):
    """(the Trainer state's JSON, the Trainer's scheduler state or None) from the ``client_state`` in
    the model-state file of model-parallel rank 0, read by pyckpt's allowlist reader."""
    from ...formats.torch_zip import SourceFile
    from ...zero.model_states import read_model_states
    from ..tiers.checkpoint_record import FIRST_MODEL_STATES

    for name in FIRST_MODEL_STATES:
        path = os.path.join(folder, name)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise CheckpointFormatError(f"{printable(path)} is not a regular file")
        except FileNotFoundError:
            continue
        raw = read_model_states(SourceFile(path)).raw()
        text = raw.get(TRAINER_STATE_KEY)
        if not isinstance(text, str):
            raise CheckpointFormatError(
                f"{printable(path)} holds no Trainer state ({TRAINER_STATE_KEY!r} in its client_state): the memory "
                "checkpoint was not saved by pyckpt.deepspeed.MemoryCheckpoints, and the Trainer cannot resume from it "
                "(remove the job's memory tier with `pyckpt clean --memory JOB` to resume from the durable checkpoint)")
        scheduler = raw.get(SCHEDULER_KEY)
        if scheduler is not None and not _plain(scheduler):
            raise CheckpointFormatError(f"{printable(path)}: the Trainer's scheduler state ({SCHEDULER_KEY!r}) holds "
                                        "more than numbers, strings, lists and dicts")
        return text, scheduler
    raise CheckpointFormatError(f"{printable(folder)} holds none of {', '.join(FIRST_MODEL_STATES)}")


def _plain(value, depth: int = 0) -> bool:
    """Whether ``value`` is what a scheduler's state_dict is made of (what torch.load(weights_only=True),
    the Trainer's reader of ``scheduler.pt``, takes back), no tensor references."""
    if depth > 32:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _global_step(text: str, where: str) -> int:
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise CheckpointFormatError(f"{printable(where)}: the Trainer state is not JSON ({exc})") from None
    step = record.get("global_step") if isinstance(record, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointFormatError(f"{printable(where)}: the Trainer state records no global_step")
    return step


def _link_tree(source: str, target: str, link) -> None:
    """Every file under ``source`` linked at the same place under ``target`` (folders made), found by the
    tier's one walk (:func:`..tiers.folder_walk.tag_files`): a link, or anything but a regular file or a
    folder, is refused in one line naming it, never followed (the assembled folder holds none)."""
    os.mkdir(target)
    for found in tag_files(source):
        dest = os.path.join(target, *found.name.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        link(found.path, dest)
