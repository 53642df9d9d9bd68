"""The state a DeepSpeed save would write, copied into host buffers pyckpt owns, as files to write.

DeepSpeed's ``save_checkpoint`` hands every file it writes to its checkpoint engine as
``save(state_dict, path)`` (model states, optimizer partitions, AutoEP expert files, for every ZeRO
stage, BF16_Optimizer, AutoTP and AutoEP layout). :class:`CaptureCheckpointEngine` stands in for the
engine during one save and turns each call into a :class:`~pyckpt.formats.torch_save_file.TorchSaveFile`:
the records torch.save would write, produced by torch's own serializer (so ``data.pkl`` is the one
DeepSpeed's torch.save would pickle), with every storage copied into a reused host buffer at the
moment of the call. Training may then change every tensor; the native writer later writes the
files from the copies, byte for byte as torch.save would have (csrc/torch_save_format.hpp).

What cannot be captured this way is refused before anything is written (:func:`capture_problem`):
another checkpoint engine, DeepSpeed's legacy (non-ZIP) serialization, torch's CRC or storage
alignment options changed from their defaults, a torch without the serializer entry point.
"""

from __future__ import annotations

import pickle
from typing import List, Optional

from ...formats.torch_save_file import MemoryRange, TorchSaveFile

# Storages are copied into chunks of this size (one bigger chunk for a bigger storage). The chunks
# stay allocated for the next save, which then copies into the same memory: a steady run holds one
# snapshot of the rank's state, and a save allocates nothing once the first one has.
CHUNK_BYTES = 256 << 20
ALIGN = 64  # torch.save's storage alignment: the copies keep the alignment the writer reads at


def _nvme_offload(engine) -> Optional[str]:
    for what, getter in (("optimizer", "zero_offload_optimizer"), ("parameters", "zero_offload_param")):
        config = getattr(engine, getter, lambda: None)() if engine is not None else None
        device = getattr(config, "device", None)
        if device is not None and str(getattr(device, "value", device)) == "nvme":
            return what
    return None


def capture_problem(ckpt_engine, engine=None) -> Optional[str]:
    """Why a save through ``ckpt_engine`` (of ``engine``) cannot be snapshotted and written byte-equal,
    or None."""
    import torch

    swapped = _nvme_offload(engine)
    if swapped:
        # DeepSpeed swaps such state in and out of NVMe around its own use; a copy taken while the
        # save runs is not one pyckpt can vouch for as the state at the call
        return f"the {swapped} are offloaded to NVMe (zero_optimization.offload_{'optimizer' if swapped == 'optimizer' else 'param'}.device)"

    name = type(ckpt_engine).__name__
    if name != "TorchCheckpointEngine":
        return (f"the checkpoint engine is {name}; an asynchronous save captures DeepSpeed's default "
                "TorchCheckpointEngine only (other engines write in their own way)")
    if not getattr(ckpt_engine, "zipfile_serialization", True):
        return ("checkpoint.checkpoint_serialization is false (torch's legacy file format); an asynchronous save "
                "writes the ZIP format DeepSpeed writes by default")
    ser = torch.serialization
    if not callable(getattr(ser, "_save", None)):
        return f"torch {torch.__version__} has no torch.serialization._save, through which the state is pickled"
    if getattr(ser, "get_crc32_options", lambda: True)() is not True:
        return "torch.serialization.set_crc32_options(False) is in effect; the files would differ from torch.save's"
    align = getattr(ser, "_get_storage_alignment", lambda: ALIGN)()
    if align != ALIGN:
        return f"torch's storage alignment is {align}, not {ALIGN}; the files would differ from torch.save's"
    if getattr(getattr(ser, "_serialization_tls", None), "skip_data", False):
        return "torch.serialization.skip_data() is active"
    return None


class SnapshotArena:
    """Host memory for one save's copies, reused by the next save (pinned where CUDA is available,
    so device-to-host copies run at full speed)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self.chunks: list = []
        self.extents: list = []
        self._chunk = 0
        self._pos = 0
        self.used = 0

    @property
    def held(self) -> int:
        """Bytes the arena holds (what stays allocated between saves)."""
        return sum(c.numel() for c in self.chunks)

    def begin(self) -> None:
        self._chunk, self._pos, self.used = 0, 0, 0
        self.extents = [0] * len(self.chunks)  # bytes of each chunk this save filled (its copies, aligned)

    def take(self, nbytes: int):
        """(chunk index, offset, uint8 tensor view) for ``nbytes`` new bytes of this save."""
        import torch

        while self._chunk < len(self.chunks):
            chunk = self.chunks[self._chunk]
            if self._pos + nbytes <= chunk.numel():
                break
            if self._pos == 0 and nbytes > chunk.numel():
                # a storage bigger than this chunk (the state changed shape): a bigger one in its place
                self.chunks[self._chunk] = self._alloc(torch, nbytes)
                break
            self._chunk, self._pos = self._chunk + 1, 0
        else:
            self.chunks.append(self._alloc(torch, nbytes))
        offset = self._pos
        self._pos = -(-(offset + nbytes) // ALIGN) * ALIGN
        self.used += nbytes
        self.extents[self._chunk:] = [0] * (len(self.chunks) - self._chunk)
        self.extents[self._chunk] = offset + nbytes
        return self._chunk, offset, self.chunks[self._chunk][offset:offset + nbytes]

    def _alloc(self, torch, nbytes: int):
        size = max(self.chunk_bytes, -(-nbytes // (1 << 20)) * (1 << 20))
        pin = torch.cuda.is_available()
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin)

    def sources(self) -> list:
        """The chunks as buffers for the native writer (index = MemoryRange.source)."""
        return [c.numpy() for c in self.chunks]


class _Recorder:
    """What torch's serializer writes into a file, kept as records (the zip writer's interface)."""

    def __init__(self, file: TorchSaveFile, arena: SnapshotArena):
        self.file = file
        self.arena = arena

    def write_record(self, name, data, nbytes):
        import torch

        if isinstance(data, str):
            data = data.encode("utf-8")
        if isinstance(data, (bytes, bytearray)):
            self.file.add(name, bytes(data[:nbytes]))
            return
        storage = data
        if storage.device.type != "cpu":  # torch moves storages to the host before writing them
            storage = storage.cpu()
        index, offset, view = self.arena.take(nbytes)
        if nbytes:
            view.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        self.file.add(name, MemoryRange(index, offset, nbytes))

    def write_record_metadata(self, name, nbytes):  # torch's skip_data path; refused beforehand
        raise RuntimeError("torch.serialization.skip_data() is active; nothing can be snapshotted")


def snapshot_file(state_dict, path: str, arena: SnapshotArena) -> TorchSaveFile:
    """The file ``torch.save(state_dict, path)`` would write, its storages copied into ``arena``."""
    import torch

    file = TorchSaveFile(path)
    torch.serialization._save(state_dict, _Recorder(file, arena), pickle, 2, False)
    return file


class CaptureCheckpointEngine:
    """Stands in for DeepSpeed's checkpoint engine during one save: folders are made as DeepSpeed
    asks, files are snapshotted into ``files`` instead of written."""

    def __init__(self, inner, arena: SnapshotArena, files: List[TorchSaveFile]):
        self._inner = inner
        self._arena = arena
        self._files = files

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def makedirs(self, path, exist_ok=False):
        return self._inner.makedirs(path, exist_ok=exist_ok)

    def create(self, info):
        return self._inner.create(info)

    def save(self, state_dict, path):
        self._files.append(snapshot_file(state_dict, path, self._arena))

    def commit(self, info):
        # the files exist only once the background write ends; publication waits for that
        return True
