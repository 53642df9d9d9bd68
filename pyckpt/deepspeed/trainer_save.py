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
the copy, not the write. The next save, loading the best model at the end (``load_best_model_at_end``:
the best may be the last checkpoint, still being written), the end of ``train()`` and the interpreter's
exit join that wait. Staging folders of a killed run are removed by the next save
(:mod:`.framework_folders`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Dict, Optional

from .framework_folders import PatchOnImport, PendingFolder, barrier, clean_staging, join_pending
from .save import engine_hook
from .save.shared_copies import SharedCopies, recording

STAGING_SUFFIX = ".pyckpt-trainer"
_PATCHED: Dict[type, tuple] = {}


def _wrap(original: Callable, module) -> Callable:
    def _save_checkpoint(self, model, trial):
        mode = engine_hook.mode()
        if mode is None or not getattr(self, "is_deepspeed_enabled", False):
            return original(self, model, trial)
        join_pending(self)  # the previous checkpoint in place before this one starts
        run_dir = self._get_output_dir(trial=trial)
        folder = f"{module.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, folder)
        staging_run = os.path.join(run_dir, "." + folder + STAGING_SUFFIX)
        staged = os.path.join(staging_run, folder)
        lead = self.args.should_save
        if lead:
            os.makedirs(run_dir, exist_ok=True)
            clean_staging(run_dir, STAGING_SUFFIX, keep=staging_run)
            shutil.rmtree(staging_run, ignore_errors=True)
            os.makedirs(staging_run)
        barrier()
        rotate = module.rotate_checkpoints
        module.rotate_checkpoints = lambda **kwargs: None  # after the rename, below
        shared = SharedCopies() if mode == "async" and lead else None
        deferred = DeferredModelWrite(self, shared) if shared is not None else None
        shadowed = _shadow(self, _get_output_dir=lambda trial=None: staging_run, _save=deferred)
        try:
            with recording(shared) if shared is not None else contextlib.nullcontext():
                original(self, model, trial)
        finally:
            _restore(self, shadowed)
            module.rotate_checkpoints = rotate
        write = deferred.after_snapshot() if deferred is not None else None
        try:
            _fix_best(self, staged, final, run_dir, module, lead)
            barrier()  # every rank's files (its RNG state) are in the staged folder
            engine = getattr(self, "model_wrapped", None)
            handle = getattr(engine, "_pyckpt_async_save", None) if mode == "async" else None
            if lead:
                args = self.args

                def rotate():
                    module.rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                                              best_model_checkpoint=self.state.best_model_checkpoint,
                                              use_mtime=True)
                PendingFolder(self, staged, staging_run, final, handle, rotate, write).start()
                write = None
        finally:
            if write is not None:
                deferred.abandon()
        if mode == "atomic":
            barrier()  # no rank goes on before the checkpoint is in place
    _save_checkpoint.__pyckpt_hooked__ = True
    return _save_checkpoint


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
    (:mod:`.save.shared_copies`), so the call copies the weights once. Any other tensor is copied, keeping
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


def _patch(module) -> None:
    cls = module.Trainer
    if cls in _PATCHED:
        return
    original = cls.__dict__["_save_checkpoint"]
    cls._save_checkpoint = _wrap(original, module)
    train = cls.__dict__["train"]

    def train_then_join(self, *args, **kwargs):
        try:
            return train(self, *args, **kwargs)
        finally:
            join_pending(self)
    train_then_join.__wrapped__ = train
    load_best = cls.__dict__.get("_load_best_model")
    _PATCHED[cls] = (original, module, train, load_best)
    cls.train = train_then_join
    if load_best is not None:
        def join_then_load_best(self, *args, **kwargs):
            join_pending(self)  # the best checkpoint may be the last one, still being written (by process 0)
            if engine_hook.mode() is not None and getattr(self, "is_deepspeed_enabled", False):
                barrier()  # every process loads it once it is in place
            return load_best(self, *args, **kwargs)
        join_then_load_best.__wrapped__ = load_best
        cls._load_best_model = join_then_load_best


_FINDER = PatchOnImport("transformers.trainer", _patch)


def install() -> None:
    _FINDER.install()


def uninstall() -> None:
    _FINDER.uninstall()
    for cls, (original, module, train, load_best) in list(_PATCHED.items()):
        cls._save_checkpoint = original
        cls.train = train
        if load_best is not None:
            cls._load_best_model = load_best
        del _PATCHED[cls]
