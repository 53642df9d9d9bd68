"""A memory save's files, written in place into tmpfs by one copy from the training state.

A memory checkpoint is DeepSpeed's own files in the node's memory folder, so that every reader
(recovery, the direct reshard, persistence, replication, convert) reads it as it reads a durable
one. What makes it cheap is how they are written: during DeepSpeed's save every file it hands its
checkpoint engine is pickled as torch.save pickles it, and its storages are not copied anywhere
but referenced where they live (the training is held in the call, so they cannot change). When
DeepSpeed's save returns, the native writer copies each storage once, straight from the tensor into
its place in the file (torch.save's exact layout), computing the CRC-32 of the bytes as it copies
them, with the GIL released, on every core. The files are written over the free slot's files where
it has them (:mod:`..tiers.free_slot`): the same tmpfs pages every save. The whole-file CRC-32s the
node manifest records come from those same CRCs, combined with the framing's; nothing is read back.

So a memory save costs one copy of the rank's state, synchronous or asynchronous alike, and holds
no host memory of its own between saves (no snapshot arena): the tier's slots are the memory.

A device storage is copied to the host first (one device-to-host copy into pinned memory kept for
the next save, then the write); a deferred clone whose original is not one dense run is filled first
(DeepSpeed's own clone, then the write).
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Tuple

from ...formats.torch_save_file import MemoryRange, TorchSaveFile, plan_files
from ...native import op_table, write_archives
from ..tiers import free_slot
from .destroy_hook import join_at_destroy
from .snapshot import CheckpointEngineStandIn, DeferredClones, SnapshotArena, deferring_clones, pickled_file


def _storage_bytes(storage):
    """``storage``'s bytes as a flat uint8 tensor on its device (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _dense_bytes(original, stand_in):
    """The bytes of ``original`` laid out as ``stand_in`` (its clone's layout) as a flat uint8 tensor on
    ``original``'s device, without a copy where they already are so (a dense tensor with the same
    strides from its storage's start), else None."""
    import torch

    if original.dtype != stand_in.dtype or original.shape != stand_in.shape or original.stride() != stand_in.stride():
        return None
    if not original.is_contiguous() or stand_in.storage_offset() != 0:
        return None
    if original.numel() * original.element_size() != stand_in.untyped_storage().nbytes():
        return None
    return original.reshape(-1).view(torch.uint8)


class SlotCheckpointEngine(CheckpointEngineStandIn):
    """Stands in for DeepSpeed's checkpoint engine during a memory save: folders are made as DeepSpeed
    asks; each file is pickled, its storages referenced in place (``sources`` keeps them alive), and
    left in ``files`` for :func:`write_slot_files`. A device storage is first copied into ``host`` (a
    :class:`~.snapshot.SnapshotArena`, pinned where CUDA is available, reused save after save): the
    writer reads host memory."""

    def __init__(self, inner, files: List[TorchSaveFile], sources: list, clones: DeferredClones, host=None):
        super().__init__(inner)
        self._files = files
        self._sources = sources
        self._clones = clones
        self._host = host

    def _source(self, flat):
        """What the writer reads for the flat uint8 tensor ``flat``: itself, or its host copy."""
        if flat.device.type == "cpu":
            return flat.numpy()
        _, _, view = self._host.take(flat.numel())
        view.copy_(flat)  # into pinned memory: the device's copy engine at full speed
        return view.numpy()

    def save(self, state_dict, path):
        file, storages = pickled_file(state_dict, path)
        for key, storage in storages:
            nbytes = storage.nbytes()
            if nbytes:
                deferred = self._clones.source_of(storage)
                flat = None
                if deferred is not None:
                    stand_in, original = deferred
                    flat = _dense_bytes(original, stand_in)
                    if flat is None:
                        stand_in.copy_(original)  # DeepSpeed's clone, made now: its bytes are the source
                self._sources.append(self._source(flat if flat is not None else _storage_bytes(storage)))
                file.add(f"data/{key}", MemoryRange(len(self._sources) - 1, 0, nbytes))
            else:
                file.add(f"data/{key}", b"")
        self._files.append(file)
        self._clones.clear()


@contextlib.contextmanager
def capturing(engine):
    """Within the block, DeepSpeed's saves through ``engine`` are captured by a
    :class:`SlotCheckpointEngine` (DeepSpeed's clones deferred): yields (files, sources), filled as
    DeepSpeed's save runs."""
    files: List[TorchSaveFile] = []
    sources: list = []
    clones = DeferredClones()
    host = getattr(engine, "_pyckpt_slot_host", None)
    if host is None:
        host = engine._pyckpt_slot_host = SnapshotArena()  # allocated only if a device storage comes
        join_at_destroy(engine)  # which lets it go
    host.begin()
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = SlotCheckpointEngine(inner, files, sources, clones, host)
    try:
        with deferring_clones(clones):
            yield files, sources
    finally:
        engine.checkpoint_engine = inner


def write_slot_files(files: List[TorchSaveFile], sources: list, staging: str,
                     node_folder: Optional[str]) -> List[Tuple[str, int, int]]:
    """Writes ``files`` (paths below ``staging``) from ``sources``, over the free slot's files of
    ``node_folder`` where it has them. Returns (name relative to ``staging``, size, CRC-32) of each."""
    if not files:
        return []
    if node_folder is not None:
        for f in files:
            free_slot.take(node_folder, staging, f.path)
    outputs, rows = plan_files(files)
    result = write_archives(sources, outputs, op_table(rows), root=staging, reuse_outputs=True, file_crcs=True)
    described = []
    for f, crc in zip(files, result["file_crcs"]):
        described.append((os.path.relpath(f.path, staging), os.stat(f.path, follow_symlinks=False).st_size, crc))
    return described
