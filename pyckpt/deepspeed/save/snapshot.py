"""The state a DeepSpeed save would write, copied into host buffers pyckpt owns, as files to write.

DeepSpeed's ``save_checkpoint`` hands every file it writes to its checkpoint engine as
``save(state_dict, path)`` (model states, optimizer partitions, AutoEP expert files, for every ZeRO
stage, BF16_Optimizer, AutoTP and AutoEP layout). :class:`CaptureCheckpointEngine` stands in for the
engine during one save and turns each call into a :class:`~pyckpt.formats.torch_save_file.TorchSaveFile`:
the records torch.save would write (``data.pkl`` pickled as torch.save pickles it), with every
storage copied into a reused host buffer at the moment of the call: a host storage at once, a GPU
storage on a side stream into pinned memory, the training's stream made to wait for it. Training may then change every tensor; the native writer later writes the
files from the copies, byte for byte as torch.save would have (csrc/torch_save_format.hpp).

What cannot be captured this way is refused before anything is written (:func:`capture_problem`):
another checkpoint engine, DeepSpeed's legacy (non-ZIP) serialization, torch's CRC or storage
alignment options changed from their defaults, NVMe-offloaded state.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from typing import List, Optional

from ...formats.torch_save_file import MemoryRange, TorchSaveFile
from .shared_copies import active as active_copies

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
    for helper in ("location_tag", "normalize_storage_type"):
        if not callable(getattr(ser, helper, None)):
            return f"torch {torch.__version__} has no torch.serialization.{helper}, which torch.save's pickle uses"
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
        self.chunk_bytes = max(ALIGN, chunk_bytes)
        self.chunks: list = []
        self.extents: list = []
        self._loans: list = []  # events of readers of the previous save's copies (shared_copies)
        self._chunk = 0
        self._pos = 0
        self.used = 0

    @property
    def held(self) -> int:
        """Bytes the arena holds (what stays allocated between saves)."""
        return sum(c.numel() for c in self.chunks)

    def begin(self) -> None:
        for loan in self._loans:  # the copies are about to be overwritten: their readers first
            loan.wait()
        self._loans = []
        self._chunk, self._pos, self.used = 0, 0, 0
        self.extents = [0] * len(self.chunks)  # bytes of each chunk this save filled (its copies, aligned)

    def _place(self, sizes: list, chunk: int, pos: int, nbytes: int) -> tuple:
        """Where ``nbytes`` more bytes go, given chunk sizes and the current position: (sizes after,
        chunk, offset, position after). Chunks are reused in order; a storage bigger than the chunk
        it would start gets a bigger one in that chunk's place; past the last, a new one."""
        while chunk < len(sizes):
            if pos + nbytes <= sizes[chunk]:
                break
            if pos == 0 and nbytes > sizes[chunk]:
                sizes = sizes[:chunk] + [self._chunk_size(nbytes)] + sizes[chunk + 1:]
                break
            chunk, pos = chunk + 1, 0
        else:
            sizes = sizes + [self._chunk_size(nbytes)]
        return sizes, chunk, pos, -(-(pos + nbytes) // ALIGN) * ALIGN

    def held_after(self, sizes_of_storages) -> int:
        """Bytes the arena would hold once ``sizes_of_storages`` more were taken (nothing is taken)."""
        sizes, chunk, pos = [c.numel() for c in self.chunks], self._chunk, self._pos
        for nbytes in sizes_of_storages:
            sizes, chunk, _, pos = self._place(sizes, chunk, pos, nbytes)
        return sum(sizes)

    def take(self, nbytes: int):
        """(chunk index, offset, uint8 tensor view) for ``nbytes`` new bytes of this save."""
        import torch

        before = [c.numel() for c in self.chunks]
        sizes, self._chunk, offset, self._pos = self._place(before, self._chunk, self._pos, nbytes)
        if len(sizes) > len(before):
            self.chunks.append(self._alloc(torch, sizes[-1]))
        elif sizes[self._chunk] != before[self._chunk]:
            self.chunks[self._chunk] = self._alloc(torch, sizes[self._chunk])
        self.used += nbytes
        self.extents[self._chunk:] = [0] * (len(self.chunks) - self._chunk)
        self.extents[self._chunk] = offset + nbytes
        return self._chunk, offset, self.chunks[self._chunk][offset:offset + nbytes]

    def _chunk_size(self, nbytes: int) -> int:
        # a storage bigger than a chunk gets a chunk of its own, rounded to MiB so that a state that
        # changes shape a little next time still fits it
        return self.chunk_bytes if nbytes <= self.chunk_bytes else -(-nbytes // (1 << 20)) * (1 << 20)

    def _alloc(self, torch, size: int):
        return torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def lend(self):
        """An event the next :meth:`begin` waits for: someone else reads this save's copies until it is set."""
        import threading

        loan = threading.Event()
        self._loans.append(loan)
        return loan

    def sources(self) -> list:
        """The chunks as buffers for the native writer (index = MemoryRange.source)."""
        return [c.numpy() for c in self.chunks]


class _StoragePickler(pickle.Pickler):
    """torch.save's pickling (protocol 2, storages as persistent ids), collecting the storages.

    The persistent id of a storage is the tuple torch.save's own serializer gives it ("storage", its
    storage class, a key numbering storages in the order they are met, its location, its element
    count), built from the same torch helpers and the same kinds of objects, so the pickle's bytes,
    memo references included, are the ones torch.save writes (tests/deepspeed/save/test_async_units.py compares
    them). Taking the pickling into pyckpt lets the snapshot copy a GPU storage on a side stream into
    pinned memory instead of torch's synchronous ``storage.cpu()``."""

    def __init__(self, buffer):
        super().__init__(buffer, protocol=2)
        self.keys: dict = {}
        self.storages: list = []  # (key, untyped storage) in key order
        self._dtypes: dict = {}

    def persistent_id(self, obj):
        import torch

        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        elif torch.is_storage(obj):
            storage, dtype = obj, torch.uint8
            storage_type = torch.serialization.normalize_storage_type(type(obj))
            numel = storage.nbytes()
        else:
            return None
        if str(storage.device) != "meta" and storage.data_ptr() != 0:
            if self._dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
                raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = self.keys.get(storage._cdata)
        if key is None:
            key = self.keys[storage._cdata] = str(len(self.keys))
            self.storages.append((key, storage))
        return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)


class DeviceCopies:
    """Device-to-host copies of one save, in flight on a side stream: the training's stream waits on
    their event before its next kernel (an optimizer step cannot overwrite a tensor being copied),
    and the writer waits on it before reading the host copies. The device storages are kept alive
    until then, so their memory is not reused while read."""

    def __init__(self):
        self.events: list = []
        self.sources: list = []

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events, self.sources = [], []


class DeferredClones:
    """DeepSpeed's clones of the tensors it saves, made lazily.

    Before most of its saves DeepSpeed copies every tensor (``clone_tensors_for_torch_save``: a
    detached clone, or a copy to the host for a device tensor), so that a view of a flat buffer is
    saved as its own small storage. In a snapshot that copy would be made twice, DeepSpeed's clone
    and then the copy into the snapshot buffer; on a GPU DeepSpeed's is moreover a synchronous
    device-to-host copy. While these clones are deferred, the clone of a tensor is an *unfilled*
    tensor of the clone's exact layout (``empty_like``: the same sizes, strides and dtype, a fresh
    storage of the clone's size, on the clone's device), which pickles exactly as the clone would;
    the snapshot then copies the original tensor's elements straight into the snapshot buffer in
    that layout. Unfilled host memory is only reserved, not touched, so a deferred clone costs no
    copy and no resident memory. ``materialize`` fills them for a file that is written at once."""

    def __init__(self):
        self.sources: dict = {}  # id of the stand-in's storage -> (stand-in, original tensor)

    def clone(self, item, device=None):
        import torch

        if torch.is_tensor(item):
            device = torch.device("cpu") if device is None else torch.device(device)
            stand_in = torch.empty_like(item.detach(), device=device)
            self.sources[stand_in.untyped_storage()._cdata] = (stand_in, item.detach())
            return stand_in
        if isinstance(item, list):
            return [self.clone(v, device) for v in item]
        if isinstance(item, tuple):
            return tuple([self.clone(v, device) for v in item])
        if isinstance(item, dict):
            return type(item)({k: self.clone(v, device) for k, v in item.items()})
        return item

    def source_of(self, storage):
        """(stand-in, original) whose clone ``storage`` stands for, or None."""
        return self.sources.get(storage._cdata)

    def materialize(self) -> None:
        for stand_in, original in self.sources.values():
            stand_in.copy_(original)
        self.sources.clear()

    def clear(self) -> None:
        self.sources.clear()


# Where DeepSpeed 0.19.8 calls its clone before a checkpoint-engine save (engine.py for model,
# optimizer and expert states; pipe/module.py for pipeline layers): the names the calls resolve.
CLONE_SITES = ("deepspeed.runtime.engine", "deepspeed.runtime.pipe.module")
CLONE_NAME = "clone_tensors_for_torch_save"


@contextlib.contextmanager
def deferring_clones(clones: DeferredClones):
    """Within the block, DeepSpeed's clones before a save are ``clones.clone`` (see DeferredClones)."""
    patched = []
    for name in CLONE_SITES:
        module = sys.modules.get(name)
        if module is not None and callable(getattr(module, CLONE_NAME, None)):
            patched.append((module, getattr(module, CLONE_NAME)))
            setattr(module, CLONE_NAME, clones.clone)
    try:
        yield
    finally:
        for module, original in patched:
            setattr(module, CLONE_NAME, original)
        clones.clear()


def pickled_file(state_dict, path: str):
    """(the file ``torch.save(state_dict, path)`` writes, its records but the storages' data; the
    storages as (key, untyped storage) in key order): the records before the data in torch's order."""
    import io

    buffer = io.BytesIO()
    pickler = _StoragePickler(buffer)
    pickler.dump(state_dict)
    file = TorchSaveFile(path)
    file.add("data.pkl", buffer.getvalue())
    file.add(".format_version", b"1")
    file.add(".storage_alignment", str(ALIGN).encode())
    file.add("byteorder", sys.byteorder.encode())
    return file, pickler.storages


def snapshot_file(state_dict, path: str, arena: SnapshotArena, copies: Optional[DeviceCopies] = None,
                  clones: Optional[DeferredClones] = None) -> TorchSaveFile:
    """The file ``torch.save(state_dict, path)`` would write, its storages copied into ``arena``
    (host storages now; device storages on a side stream, tracked in ``copies``); a deferred
    clone's storage (``clones``) is filled from its original tensor. Where a :mod:`.shared_copies` records,
    it learns where each host storage was copied."""
    import torch

    file, storages = pickled_file(state_dict, path)
    side = None
    shared = active_copies()
    for key, storage in storages:
        nbytes = storage.nbytes()
        index, offset, view = arena.take(nbytes)
        deferred = clones.source_of(storage) if clones is not None else None
        if deferred is not None:
            stand_in, original = deferred
            # the clone's elements, in the clone's layout, straight from the original
            target = view.view(stand_in.dtype).as_strided(stand_in.size(), stand_in.stride()) if nbytes else None
            source = original
        else:
            target = view
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage) if nbytes else None
        if nbytes:
            if source.device.type == "cuda":
                if side is None:
                    side = _side_stream(source.device)
                    side.wait_stream(torch.cuda.current_stream(source.device))  # the state as of this call
                with torch.cuda.stream(side):
                    target.copy_(source, non_blocking=True)
                if copies is not None:
                    copies.sources.append(source)
            else:
                target.copy_(source)
                if shared is not None and deferred is None:
                    shared.snapshotted_storage(storage, arena, index, offset)
        file.add(f"data/{key}", MemoryRange(index, offset, nbytes))
    if side is not None:
        event = torch.cuda.Event()
        event.record(side)
        torch.cuda.current_stream(side.device).wait_event(event)
        if copies is None:
            event.synchronize()
        else:
            copies.events.append(event)
    return file


_SIDE_STREAMS: dict = {}


def _side_stream(device):
    import torch

    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def storage_sizes(value) -> List[int]:
    """Byte sizes of the distinct storages the tensors in ``value`` use, in the order torch.save meets
    them (depth first): what a snapshot of it takes."""
    import torch

    seen, sizes, stack = set(), [], [value]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            storage = item.untyped_storage()
            key = (storage.device.type, storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                sizes.append(storage.nbytes())
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return sizes


class CheckpointEngineStandIn:
    """What every stand-in for DeepSpeed's checkpoint engine during one save does alike: folders are
    made as DeepSpeed asks, anything else it asks of the engine goes to the engine it configured, and
    ``commit`` reports success (the files exist only once the stand-in's owner has written them, and
    publication waits for that)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def makedirs(self, path, exist_ok=False):
        return self._inner.makedirs(path, exist_ok=exist_ok)

    def create(self, info):
        return self._inner.create(info)

    def commit(self, info):
        return True


class CaptureCheckpointEngine(CheckpointEngineStandIn):
    """Stands in for DeepSpeed's checkpoint engine during one save: folders are made as DeepSpeed
    asks, files are snapshotted into ``files`` instead of written.

    With ``limit`` (bytes), a file whose storages would take the snapshot's memory past it is written
    at once by the engine DeepSpeed configured (torch.save, the same bytes), during the call: the
    memory held never exceeds the limit, and the call blocks for that file's write."""

    def __init__(self, inner, arena: SnapshotArena, files: List[TorchSaveFile], limit: Optional[int] = None,
                 copies: Optional[DeviceCopies] = None, clones: Optional[DeferredClones] = None):
        super().__init__(inner)
        self._arena = arena
        self._files = files
        self._limit = limit
        self._copies = copies
        self._clones = clones
        self.written_now: List[str] = []  # files written during the call (over the limit)

    def save(self, state_dict, path):
        if self._limit is not None and self._arena.held_after(storage_sizes(state_dict)) > self._limit:
            if self._clones is not None:
                self._clones.materialize()  # torch.save writes the clones' bytes
            self._inner.save(state_dict, path)
            self.written_now.append(path)
            return
        self._files.append(snapshot_file(state_dict, path, self._arena, self._copies, self._clones))
        if self._clones is not None:
            self._clones.clear()  # this file's stand-ins are done with
