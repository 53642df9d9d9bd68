"""The Hugging Face Trainer's ``checkpoint-N/`` complete or absent under ``enable(save=...)``.

The Trainer (transformers 5.22, ``Trainer._save_checkpoint``) writes one checkpoint as several steps
into ``<output_dir>/checkpoint-N/``: DeepSpeed's save, then the scheduler, the RNG state of every rank
and ``trainer_state.json``, then it rotates older checkpoints. A kill between those steps leaves a
``checkpoint-N/`` that ``get_last_checkpoint`` (``resume_from_checkpoint=True``) takes although half of
it is missing. Here the Trainer's own steps run unchanged, but into a hidden staging folder
(``.checkpoint-N.pyckpt-trainer/checkpoint-N``, which neither ``get_last_checkpoint`` nor the rotation
sees); when every rank's files are there, process 0 renames it to ``checkpoint-N`` in one step and
only then rotates. With ``save="async"`` DeepSpeed's files are still being written when the Trainer's
step returns: the rename waits for their publication (a thread on process 0), so training goes on, and
the rotation never sees a checkpoint still being written. The model files the Trainer writes from its own
``save_model`` (``model.safetensors``, config, tokenizer, ``training_args.bin``) are written by that thread
too, from a copy of the state dict taken in the call (:class:`DeferredModelWrite`), so the step's stall is
the copy, not the write. The next save, the end of training (``_finalize_training``, before it loads the best
model, which may be the last checkpoint, and before ``save_total_limit=1`` deletes all but the best) and
the interpreter's exit join that wait. The hub push and the ``on_save`` callbacks stock runs right after a
save run once the folder is in place (:mod:`.trainer_after_save`). Staging folders of a killed run are
removed by the next save; a ``checkpoint-N`` that is not the Trainer's keeps what the Trainer would not
overwrite, and a file of that name stops the save as it stops the Trainer's (:mod:`.staged_folders`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional

from ..save.in_flight import save_in_flight
from ..save.shared_copies import SharedCopies, recording
from ..settings import save_mode
from . import trainer_after_save as after_save
from .patching import Row, install_save_patch, save_patch
from .staged_folders import PendingFolder, agree, barrier, check_target, join_pending, make_staging

STAGING_SUFFIX = ".pyckpt-trainer"


def _wrap(original: Callable, module) -> Callable:
    def _save_checkpoint(self, model, trial):
        mode = save_mode()
        if mode is None or not getattr(self, "is_deepspeed_enabled", False):
            return original(self, model, trial)
        after_save.run(self, wait=True)  # the previous checkpoint in place, its push and on_save run
        run_dir = self._get_output_dir(trial=trial)
        folder = f"{module.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, folder)
        staging_run = os.path.join(run_dir, "." + folder + STAGING_SUFFIX)
        staged = os.path.join(staging_run, folder)
        lead = self.args.should_save
        problem = None
        if lead:
            try:
                check_target(final)
                os.makedirs(run_dir, exist_ok=True)
                make_staging(run_dir, staging_run, STAGING_SUFFIX)
            except Exception as exc:  # raised on every process, below
                problem = exc
        agree(problem)
        rotate = module.rotate_checkpoints
        module.rotate_checkpoints = lambda **kwargs: None  # after the rename, below
        shared = SharedCopies() if mode == "async" and lead else None
        deferred = DeferredModelWrite(self, shared) if shared is not None else None
        pushes: list = []
        push = self._push_from_checkpoint  # run once the folder is in place, from its final name
        shadowed = _shadow(self, _get_output_dir=lambda trial=None: staging_run, _save=deferred,
                           _push_from_checkpoint=pushes.append)
        try:
            with recording(shared) if shared is not None else contextlib.nullcontext():
                original(self, model, trial)
        finally:
            _restore(self, shadowed)
            module.rotate_checkpoints = rotate
        write = deferred.after_snapshot() if deferred is not None else None
        publication = None
        try:
            _fix_best(self, staged, final, run_dir, module, lead)
            barrier()  # every rank's files (its RNG state) are in the staged folder
            engine = getattr(self, "model_wrapped", None)
            handle = save_in_flight(engine) if mode == "async" else None
            if lead:
                limit, best = self.args.save_total_limit, self.state.best_model_checkpoint

                def rotate():
                    module.rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                                              best_model_checkpoint=best, use_mtime=True)
                publication = PendingFolder(self, staged, staging_run, final, handle, rotate, write)
                publication.start()  # with nothing in the background (atomic): in place now, or failed
                write = None
        finally:
            if write is not None:
                deferred.abandon()
        after_save.record(self, final, publication, push if pushes else None, defer_on_save=mode == "async")
        if mode == "atomic":
            after_save.run(self, wait=True)  # no process goes on before it is in place (or all raise); the push
    _save_checkpoint.__pyckpt_hooked__ = True
    return _save_checkpoint


def _wrap_log_save_evaluate(original: Callable, module) -> Callable:
    """``_maybe_log_save_evaluate``, which saves and then calls ``on_save``: under ``save="async"`` that call
    is held until the checkpoint is in place, and at the end of each step what is in place runs
    (:mod:`.trainer_after_save`)."""
    def _maybe_log_save_evaluate(self, *args, **kwargs):
        if save_mode() != "async" or not getattr(self, "is_deepspeed_enabled", False):
            return original(self, *args, **kwargs)
        handler = self.callback_handler
        shadowed = _shadow(handler, on_save=after_save.on_save_stand_in(self, handler.on_save))
        try:
            result = original(self, *args, **kwargs)
        finally:
            _restore(handler, shadowed)
            after_save.settle(self)
        after_save.run(self, wait=False)
        return result
    _maybe_log_save_evaluate.__wrapped__ = original
    return _maybe_log_save_evaluate


def _wrap_finalize(original: Callable, module) -> Callable:
    """``_finalize_training``: the last checkpoint in place on every process, its push and ``on_save`` run,
    before it loads the best checkpoint (which may be the last) and, with ``save_total_limit=1``, deletes
    every checkpoint but the best (stock deletes the last one there too)."""
    def _finalize_training(self, *args, **kwargs):
        if save_mode() is not None and getattr(self, "is_deepspeed_enabled", False):
            after_save.run(self, wait=True)
        return original(self, *args, **kwargs)
    _finalize_training.__wrapped__ = original
    return _finalize_training


def _wrap_train(original: Callable, module) -> Callable:
    def train(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            after_save.drop(self)  # left only where training stopped on an error
            join_pending(self)
    train.__wrapped__ = original
    return train


_MISSING = object()


def _shadow(obj, **values) -> dict:
    """Instance attributes set for one call (None: left alone); what they hid, for :func:`_restore` (a user's
    own instance attribute, e.g. a patched ``trainer._save``, comes back)."""
    hidden = {}
    for name, value in values.items():
        if value is not None:
            hidden[name] = obj.__dict__.get(name, _MISSING)
            setattr(obj, name, value)
    return hidden


def _restore(obj, hidden: dict) -> None:
    for name, value in hidden.items():
        if value is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, value)


class DeferredModelWrite:
    """Stands in for ``trainer._save`` (the model files of a checkpoint) during one asynchronous save on the
    main process: the call copies the state dict and returns; :meth:`write` later calls the Trainer's own
    ``_save`` with the copy, so the files are the ones it would have written then.

    A clone accelerate's ``get_state_dict`` made in this call (with ZeRO-1/2) is a private host tensor already
    and is kept as it is: it is filled in the background from DeepSpeed's snapshot of the same weights
    (:mod:`..save.shared_copies`), so the call copies the weights once. Any other tensor is copied, keeping
    the tensors' sharing as it was: one new storage per storage of the original, every tensor a view of it
    at the same offset, size and stride. ``save_pretrained`` finds tied weights by shared storage
    (transformers' ``remove_tied_weights_from_state_dict``), so a tensor-by-tensor clone could write a tied
    weight a second time. The storages are kept for the next save, which copies into them (the previous
    write is joined before a save starts), so a steady run allocates nothing more.
    """

    def __init__(self, trainer, shared: SharedCopies):
        self.original = trainer._save  # the Trainer's (or a subclass's) bound method
        self.default_dir = trainer.args.output_dir
        self.shared = shared
        self.storages = trainer.__dict__.setdefault("_pyckpt_model_storages", {})
        self.pending: Optional[tuple] = None
        self._fill: Optional[Callable[[], None]] = None

    def __call__(self, output_dir: Optional[str] = None, state_dict=None):
        if not state_dict or self.pending is not None:
            # no state dict to copy (the Trainer then saves the model's own, or, with ZeRO-3 not gathering
            # 16-bit weights, an empty one that it removes right after): written now, as it would be
            self.shared.fill_now()
            return self.original(output_dir, state_dict=state_dict)
        # the folder exists from here on, as the Trainer's own write makes it first: the Trainer then checks
        # for it (the best checkpoint's folder, when it is this one)
        os.makedirs(output_dir if output_dir is not None else self.default_dir, exist_ok=True)
        self.pending = (output_dir, self.copy(state_dict))

    def after_snapshot(self) -> Optional[Callable[[], None]]:
        """Once DeepSpeed's save returned: what is left for the background (filling the clones from the
        snapshot, then the Trainer's write), or None when nothing is."""
        self._fill = self.shared.resolve()
        if self.pending is None:
            self.abandon()
            return None
        return self.write

    def abandon(self) -> None:
        """The clones filled (the snapshot's memory released to the next save) without writing."""
        fill, self._fill = self._fill, None
        if fill is not None:
            fill()

    def copy(self, state_dict: dict) -> dict:
        import torch

        spare = {size: list(kept) for size, kept in self.storages.items()}
        self.storages.clear()
        copies: dict = {}  # the original storage's (device, address) -> its copy
        out = {}
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor) or value.device.type == "meta" or self.shared.is_stand_in(value):
                out[name] = value
                continue
            storage = value.untyped_storage()
            key = (str(value.device), storage.data_ptr())
            copy = copies.get(key)
            if copy is None:
                size = storage.nbytes()
                reuse = spare.get(size)
                copy = reuse.pop() if reuse else torch.UntypedStorage(size)
                copy.copy_(storage)
                copies[key] = copy
                self.storages.setdefault(size, []).append(copy)
            out[name] = torch.empty(0, dtype=value.dtype).set_(copy, value.storage_offset(), value.size(),
                                                               value.stride())
        return out

    def write(self) -> None:
        output_dir, state_dict = self.pending
        self.pending = None
        self.abandon()  # the clones filled first
        self.original(output_dir, state_dict=state_dict)


def _fix_best(trainer, staged: str, final: str, run_dir: str, module, lead: bool) -> None:
    """The best checkpoint as the Trainer would have named it in ``run_dir`` (it looked in the staging folder)."""
    state = trainer.state
    best = state.best_global_step
    before = state.best_model_checkpoint
    if state.best_model_checkpoint == staged:
        state.best_model_checkpoint = final
    elif best and state.best_model_checkpoint is None:
        older = os.path.join(run_dir, f"{module.PREFIX_CHECKPOINT_DIR}-{best}")
        if os.path.exists(older):
            state.best_model_checkpoint = older
    if lead and state.best_model_checkpoint != before:
        state.save_to_json(os.path.join(staged, module.TRAINER_STATE_NAME))


PROVEN = ("5.22.2", )
# Trainer's methods replaced, and the module names of transformers.trainer they use: all found or none replaced
ROW = Row("transformers", "transformers.trainer", "Trainer",
          {"_save_checkpoint": _wrap, "_maybe_log_save_evaluate": _wrap_log_save_evaluate,
           "_finalize_training": _wrap_finalize, "train": _wrap_train},
          PROVEN, needs=("PREFIX_CHECKPOINT_DIR", "TRAINER_STATE_NAME", "rotate_checkpoints"))
PATCH = save_patch("the Trainer's staged checkpoint-N", ROW)


def install() -> None:
    install_save_patch(PATCH)


def uninstall() -> None:
    PATCH.uninstall()
