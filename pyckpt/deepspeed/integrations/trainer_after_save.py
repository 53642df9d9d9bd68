"""What the Hugging Face Trainer does right after writing a checkpoint, run once that checkpoint is in place.

Stock (transformers 5.22), ``Trainer._save_checkpoint`` ends with the per-save hub push
(``_push_from_checkpoint``, with ``push_to_hub`` and ``hub_strategy`` "every_save" or "checkpoint": it
copies the model files of ``checkpoint-N/`` into the output folder and uploads them, and the whole folder
for "checkpoint") and ``_maybe_log_save_evaluate`` then calls the ``on_save`` callbacks; both find
``checkpoint-N/`` complete. Under ``enable(save=...)`` the folder is written under a hidden name and
published later: at once with "atomic", by a background thread with "async". So pyckpt holds the push
and, under "async", the ``on_save`` call, and runs them, in stock's order, once the folder is in place:

* on the training thread, never the background one (callbacks, loggers and the hub client expect the
  thread they always ran on);
* at the end of ``_maybe_log_save_evaluate`` (where stock calls ``on_save``) of the first step at which
  every process knows the folder is in place, one small collective per step while a save is in flight
  deciding it (a CPU all-reduce of one integer, on a gloo group: 0.18 ms between two processes of the
  2-core test machine, no GPU synchronisation), so every process runs them at the same step and flags a callback sets in ``control``
  act at the same step everywhere; at the latest before the next save begins and before
  ``_finalize_training`` (which loads the best checkpoint and, with ``save_total_limit=1``, deletes the
  others: the last checkpoint is then in place, as stock's is);
* with the ``TrainerState`` as it was at the save (a copy taken then: ``state.global_step`` names the
  checkpoint), while the live state goes on. What a callback changes in that copy is not kept, and what it
  sets in ``control`` acts at the step where it runs, not the step of the save (stock: the same step);
  the first save says so once where a callback other than the Trainer's own handles ``on_save``.

Waiting for the publication at the save instead would run ``on_save`` at stock's step, but stall every
save for the whole background write (all of what ``save="async"`` saves), for every job that logs to a
tracker whose callback implements ``on_save``.

A checkpoint that was not published (DeepSpeed's files failed) gets neither push nor ``on_save``, as a
failed stock save gets none; a failure any process met raises on every process.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable, List, Optional

log = logging.getLogger("pyckpt")

QUEUE = "_pyckpt_after_saves"
_CPU_GROUP: dict = {}
_WARNED: list = []


class AfterSave:
    """One checkpoint's publication (``folder``, on the main process) and what stock ran right after it."""

    def __init__(self, final: str, folder, push: Optional[Callable[[str], None]], state, defer_on_save: bool):
        self.final, self.folder, self.push, self.state = final, folder, push, state
        self.awaiting = defer_on_save  # the next on_save of this step is this save's
        self.on_save = False


def queue(trainer) -> List[AfterSave]:
    return trainer.__dict__.setdefault(QUEUE, [])


def record(trainer, final: str, folder, push, defer_on_save: bool) -> None:
    """After the Trainer's save of ``final`` (every process, in the same order): what to run once it is in
    place. ``folder`` is the main process's publication (None elsewhere), ``push`` the Trainer's hub push
    when stock would have called it."""
    state = _snapshot(trainer.state) if defer_on_save else None
    if defer_on_save:
        _warn_once(trainer)
    queue(trainer).append(AfterSave(final, folder, push, state, defer_on_save))


def _snapshot(state):
    """``state`` as it is now, for a call made later: its fields, and its lists and dicts (``log_history``,
    ``stateful_callbacks``) as new containers, one level deep. The Trainer appends to them and replaces their
    entries but does not change an entry in place, so their entries are shared, not copied: a deep copy took
    60 ms per save with 10,000 log entries, this 0.14 ms."""
    snap = copy.copy(state)
    for name, value in vars(state).items():
        if isinstance(value, list):
            setattr(snap, name, list(value))
        elif isinstance(value, dict):
            setattr(snap, name, {k: list(v) if isinstance(v, list) else copy.copy(v) for k, v in value.items()})
    return snap


def on_save_stand_in(trainer, real: Callable) -> Callable:
    """Stands in for ``callback_handler.on_save`` during one ``_maybe_log_save_evaluate``: the call that
    follows an asynchronous save is held for :func:`run` (``control.should_save`` cleared now, as the
    handler clears it, so the next step does not save again); any other goes through."""
    def on_save(args, state, control, **kwargs):
        held = next((s for s in reversed(trainer.__dict__.get(QUEUE, ())) if s.awaiting), None)
        if held is None:
            return real(args, state, control, **kwargs)
        held.awaiting = False
        held.on_save = True
        control.should_save = False
        return control
    return on_save


def settle(trainer) -> None:
    """The end of a ``_maybe_log_save_evaluate``: a save whose ``on_save`` was not called in it (a save made
    outside the training loop) takes no later call for its own."""
    for s in trainer.__dict__.get(QUEUE, ()):
        s.awaiting = False


def run(trainer, wait: bool) -> None:
    """Every recorded save's push and ``on_save``, in order, once its folder is in place: with ``wait``,
    after waiting for it; else only where every process's are in place (one collective). Every process
    calls it at the same points."""
    held = trainer.__dict__.get(QUEUE)
    if not held:
        return
    if not wait and not _everyone(all(s.folder is None or s.folder.done() for s in held)):
        return
    saves = list(held)
    held.clear()
    problem, published = None, []
    for s in saves:
        try:
            published.append(s.folder.join() if s.folder is not None else None)
        except Exception as exc:  # the first failure, raised on every process below
            published.append(False)
            problem = problem or exc
    problem, published = _agreed(problem, published)
    if problem is not None:
        raise problem
    for s, ok in zip(saves, published):
        if not ok:
            if s.push is not None or s.on_save:
                log.warning("pyckpt: %s was not published: its hub push and on_save callbacks are skipped, as "
                            "for a save that failed", s.final)
            continue
        _run_one(trainer, s)


def drop(trainer) -> None:
    """Training stopped on an error: what is held is not run (the processes may not meet again), the
    folders' writes are waited for."""
    saves = trainer.__dict__.pop(QUEUE, None) or []
    for s in saves:
        try:
            if s.folder is not None:
                s.folder.join()
        except Exception as exc:
            log.error("pyckpt: %s was not published: %s", s.final, exc)
        if s.push is not None or s.on_save:
            log.warning("pyckpt: training stopped before %s's hub push and on_save callbacks ran", s.final)


def _run_one(trainer, s: AfterSave) -> None:
    live = trainer.state
    if s.state is not None:
        trainer.state = s.state  # the push's commit message and the callbacks read the save's step
    try:
        if s.push is not None:
            s.push(s.final)
        if s.on_save:
            # the handler's on_save clears should_save for the save it follows, which was done when the call was
            # held; set now, it is this step's own save (the next one, about to write its trainer_state.json)
            this_step = trainer.control.should_save
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
            trainer.control.should_save = trainer.control.should_save or this_step
    finally:
        trainer.state = live


def _warn_once(trainer) -> None:
    if _WARNED or getattr(trainer.args, "process_index", 0) != 0:
        return
    from transformers.trainer_callback import TrainerCallback

    handler = getattr(trainer, "callback_handler", None)
    names = [type(cb).__name__ for cb in getattr(handler, "callbacks", ())
             if getattr(type(cb), "on_save", None) is not TrainerCallback.on_save]
    if names:
        _WARNED.append(True)
        log.warning("pyckpt: under enable(save='async') on_save of %s runs once checkpoint-N is in place, at the "
                    "end of a later step, with the TrainerState as it was at the save; flags it sets in control act "
                    "at that step (docs/saving.md)", ", ".join(names))


def _ranks():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _cpu_group():
    """A gloo group over every process (the default one where it is gloo): the step's check must not wait
    for the GPU's queued work, as a collective on an NCCL group would."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    if _CPU_GROUP.get("world") is not world:
        _CPU_GROUP.update(world=world, group=dist.new_group(backend="gloo"))
    return _CPU_GROUP["group"]


def _everyone(flag: bool) -> bool:
    dist = _ranks()
    if dist is None:
        return flag
    import torch

    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=_cpu_group())
    return bool(value.item())


def _agreed(problem, published: list):
    """The first problem of any process, and for each save whether it was published: by every process that
    published (the main process, or one per node), all of them."""
    dist = _ranks()
    if dist is None:
        return problem, published
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, (problem, published), group=_cpu_group())
    problem = next((p for p, _ in found if p is not None), None)
    verdicts = []
    for i in range(len(published)):
        votes = [flags[i] for _, flags in found if flags[i] is not None]
        verdicts.append(bool(votes) and all(votes))
    return problem, verdicts
