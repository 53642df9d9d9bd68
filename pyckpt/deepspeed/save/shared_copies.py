"""One host copy of the model's weights for both halves of a Hugging Face Trainer checkpoint.

The Trainer saves a checkpoint's model files first (``save_model``: with ZeRO-1/2 accelerate's
``get_state_dict`` clones every weight to the host with DeepSpeed's ``clone_tensors_for_torch_save`` for
``model.safetensors``), then calls DeepSpeed's save, whose model-states file holds the same weights (the
module's storages, which DeepSpeed's ZeRO-1/2 keeps as one flat buffer), and which an asynchronous save
copies into its snapshot. Copying the weights twice doubles that part of the step's stall.

While a :class:`SharedCopies` records (:func:`recording`, around one Trainer checkpoint call), the clones
are made unfilled (``empty_like``: the clone's exact layout, memory reserved but not touched) and the
tensor each stands for is remembered; the snapshot (:func:`.snapshot.snapshot_file`) reports where it
copied each host storage. After DeepSpeed's save, :meth:`SharedCopies.resolve` fills every clone whose
tensor lies in a snapshotted storage *from the snapshot*, later, in the background (the arena is lent
until then: the next save waits for it), and the others from their tensor at once. Nothing trains between
the clone and the snapshot, so both hold the bytes of the call. The clones stay private tensors of their
own storages, as DeepSpeed's clones are, so the files written from them are the same.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, List, Optional, Tuple

CLONE_MODULE = "deepspeed.checkpoint.utils"
CLONE_NAME = "clone_tensors_for_torch_save"

_ACTIVE: list = []  # the SharedCopies of the checkpoint call in progress, if any


def _storage_key(storage) -> tuple:
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


class SharedCopies:
    """The unfilled clones of one checkpoint call and the snapshot's copies of host storages."""

    def __init__(self):
        self.stand_ins: dict = {}  # the clone's storage address -> (clone, original tensor)
        self.snapshotted: dict = {}  # an original storage's key -> (arena, chunk index, byte offset)
        self.from_snapshot = 0  # clones resolve() left to be filled from the snapshot

    def clone(self, item, device):
        import torch

        stand_in = torch.empty_like(item.detach(), device=device)
        self.stand_ins[stand_in.untyped_storage().data_ptr()] = (stand_in, item.detach())
        return stand_in

    def is_stand_in(self, tensor) -> bool:
        """Whether ``tensor`` is one of the unfilled clones (a private host tensor, filled by resolve())."""
        return tensor.numel() > 0 and tensor.untyped_storage().data_ptr() in self.stand_ins

    def snapshotted_storage(self, storage, arena, index: int, offset: int) -> None:
        """The snapshot copied host ``storage`` into ``arena``'s chunk ``index`` at ``offset``."""
        self.snapshotted[_storage_key(storage)] = (arena, index, offset)

    def _source(self, original):
        """``original``'s elements in the snapshot, as a tensor of its layout, or None."""
        where = self.snapshotted.get(_storage_key(original.untyped_storage()))
        if where is None:
            return None
        arena, index, offset = where
        item = original.element_size()
        if offset % item:
            return None
        chunk = arena.chunks[index]
        return arena, chunk[:chunk.numel() - chunk.numel() % item].view(original.dtype).as_strided(
            original.size(), original.stride(), offset // item + original.storage_offset())

    def fill_now(self) -> None:
        """Every clone not filled yet, from its tensor (before anything but the snapshot may read it)."""
        for stand_in, original in self.stand_ins.values():
            stand_in.copy_(original)
        self.stand_ins.clear()

    def resolve(self) -> Optional[Callable[[], None]]:
        """After DeepSpeed's save: clones whose tensor the snapshot copied are left to the returned callable
        (to run in the background, before anything reads them; the arena waits for it), the rest filled
        now. None when there is nothing left to fill."""
        later: List[Tuple[object, object]] = []
        lent = {}
        for key, (stand_in, original) in list(self.stand_ins.items()):
            found = self._source(original) if original.device.type == "cpu" else None
            if found is None:
                continue
            arena, source = found
            later.append((stand_in, source))
            if id(arena) not in lent:
                lent[id(arena)] = arena.lend()
            del self.stand_ins[key]
        self.fill_now()
        self.from_snapshot = len(later)
        if not later:
            return None

        def fill() -> None:
            try:
                for stand_in, source in later:
                    stand_in.copy_(source)
            finally:
                later.clear()
                for loan in lent.values():
                    loan.set()
        return fill


def active() -> Optional[SharedCopies]:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(copies: SharedCopies):
    """Within the block, DeepSpeed's ``clone_tensors_for_torch_save`` as accelerate calls it makes unfilled
    clones recorded in ``copies``, and the snapshot reports its host copies to it. The caller resolves (or
    fills) them before anything else reads them."""
    import torch

    module = sys.modules.get(CLONE_MODULE)
    original = getattr(module, CLONE_NAME, None) if module is not None else None
    if callable(original):
        def recording_clone(item, device=torch.device("cpu")):
            if torch.is_tensor(item):
                return copies.clone(item, torch.device(device) if isinstance(device, str) else device)
            return original(item, device)  # containers come back here, through the module's name
        setattr(module, CLONE_NAME, recording_clone)
    _ACTIVE.append(copies)
    try:
        yield copies
    finally:
        _ACTIVE.remove(copies)
        if callable(original):
            setattr(module, CLONE_NAME, original)
