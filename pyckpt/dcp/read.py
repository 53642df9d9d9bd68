"""Reading a torch.distributed.checkpoint (DCP) folder as FSDP2 or torchtitan saved it: its entries,
each tensor's chunks, and each chunk's bytes in the data files, so that a writer plans byte copies
from them.

What torch 2.13's ``FileSystemWriter`` leaves (``torch/distributed/checkpoint/filesystem.py``,
``metadata.py``): a ``.metadata`` pickle of ``Metadata`` (every flattened key's dtype, size and
chunks, or "bytes" for any other value; each key's nesting path; for each chunk the data file and
byte range of its record) and data files ``__<rank>_<k>.distcp``, where each record is a whole
torch.save archive of one chunk (a tensor) or one value, written back to back. The safetensors-backed
layout of torch's ``HuggingFaceStorageWriter(save_distributed=True)`` is read by
:mod:`.read_safetensors` into the same records.

Everything a folder says is untrusted: the pickle is parsed by the allowlist reader (nothing runs);
data file names must be plain names of regular files inside the folder; records must lie inside
their files without overlapping; chunks must lie inside their tensor and tile it exactly; each
chunk's archive is parsed inside its byte range alone, and its tensor must have the entry's dtype and
the chunk's sizes, its bytes inside its storage record. Nothing is read of the tensors themselves:
a tensor becomes a :class:`~pyckpt.tensors.NewTensor` of pieces of the data files.
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, quoted
from ..formats.confined import check_links_inside, read_inside
from ..formats.pickle_read import MAX_INDEX, GlobalName, Opaque, TensorRef, TorchSize, loads, loads_with_storages
from ..formats.torch_zip import max_pickle_bytes, open_regular
from ..native import _core, native_errors
from ..planning.collector import pauses_collector
from ..planning.plan import Piece
from ..tensors import ITEMSIZE, NewTensor, numel
from .read_safetensors import is_sharded_safetensors_folder, sharded_chunks
from .tiling import LayoutTooIrregular, tiling_fault

METADATA_NAME = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
# Heads (member table and data.pkl) of this many chunk archives are read per native batch: bounded
# memory whatever the number of chunks.
_HEAD_BATCH = 512
# A value entry (a hyper-parameter, a step counter, a dataloader's state) is a small pickle.
MAX_VALUE_BYTES = 64 << 20


@dataclass(eq=False, slots=True)
class DataFile:
    """One data file of the folder: the source of the pieces planned from its records."""

    path: str
    size: int


@dataclass(slots=True)
class Record:
    """Bytes [offset, offset + length) of a data file: one chunk's or one value's archive."""

    file: DataFile
    offset: int
    length: int

    def where(self) -> str:
        """The record as an error names it."""
        return f"{self.file.path} (record at bytes [{self.offset}, {self.offset + self.length}))"


@dataclass(slots=True)
class Chunk:
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    record: Optional[Record] = None
    # absolute offset of the chunk's first element in record.file (set once its archive is read), or
    # for a safetensors-backed record, known from the header
    data_offset: Optional[int] = None


@dataclass
class DcpTensor:
    key: str
    path: Tuple[Any, ...]
    dtype: str
    shape: Tuple[int, ...]
    chunks: List[Chunk]

    def numel(self) -> int:
        return numel(self.shape)


@dataclass
class DcpObject:
    key: str
    path: Tuple[Any, ...]
    record: Record


@dataclass
class DcpCheckpoint:
    folder: str
    tensors: "OrderedDict[str, DcpTensor]" = field(default_factory=OrderedDict)
    objects: "OrderedDict[str, DcpObject]" = field(default_factory=OrderedDict)
    layout: str = "torch_save"  # or "safetensors"

    def entries(self) -> List[str]:
        return list(self.tensors) + list(self.objects)

    def assemble(self, keys: Iterable[str]) -> "OrderedDict[str, NewTensor]":
        """The tensors of ``keys`` as byte pieces of the data files, each chunk's archive read and checked."""
        wanted = [self.tensors[k] for k in keys]
        _locate_chunks(self.folder, [(t, c) for t in wanted for c in t.chunks if c.data_offset is None])
        return OrderedDict((t.key, _assembled(t)) for t in wanted)

    def tensor(self, key: str) -> NewTensor:
        return self.assemble([key])[key]

    def value(self, key: str) -> Any:
        """A value entry, parsed by the allowlist pickle reader (tensors in it are refused)."""
        obj = self.objects[key]
        return _read_value(self.folder, obj)


def is_dcp_folder(path) -> bool:
    """Whether ``path`` is a folder holding a DCP ``.metadata`` or the safetensors-backed layout."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return False
    if os.path.lexists(os.path.join(path, METADATA_NAME)):
        return True
    return is_sharded_safetensors_folder(path)


@pauses_collector
def read_dcp(folder) -> DcpCheckpoint:
    """The entries of the DCP folder ``folder`` with their chunks and records (nothing of the tensors
    read). CheckpointFormatError / UnsafePickleError naming the file and the rule a defect breaks."""
    folder = os.path.abspath(os.fspath(folder))
    if not os.path.lexists(os.path.join(folder, METADATA_NAME)):
        return _read_sharded_safetensors(folder)
    where = os.path.join(folder, METADATA_NAME)
    meta = loads(read_inside(folder, METADATA_NAME, max_pickle_bytes(), "a DCP metadata pickle"), where=where)
    if not _is(meta, "Metadata") or not isinstance(meta._state, dict):
        raise CheckpointFormatError(f"{where}: not a torch.distributed.checkpoint Metadata record")
    fields = meta._state
    entries = fields.get("state_dict_metadata")
    storage = fields.get("storage_data")
    planner = fields.get("planner_data")
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointFormatError(f"{where}: Metadata without its entries (state_dict_metadata) or their storage "
                                    "records (storage_data)")
    if planner is not None and not isinstance(planner, dict):
        raise CheckpointFormatError(f"{where}: planner_data is a {type(planner).__name__}, not a dict")
    ck = DcpCheckpoint(folder)
    chunk_at: Dict[Tuple[str, Tuple[int, ...]], Chunk] = {}
    for key, md in entries.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{where}: an entry key is a {type(key).__name__}, not a string")
        path = _path(where, key, (planner or {}).get(key, (key, )))
        if _is(md, "BytesStorageMetadata"):
            ck.objects[key] = DcpObject(key, path, None)
        elif _is(md, "TensorStorageMetadata"):
            t = _tensor_entry(where, key, path, md)
            ck.tensors[key] = t
            for c in t.chunks:
                if chunk_at.setdefault((key, c.offsets), c) is not c:
                    raise CheckpointFormatError(f"{where}: {_shown(key)} lists two chunks at offsets {list(c.offsets)}")
        else:
            raise CheckpointFormatError(f"{where}: entry {_shown(key)} is described by {_kind(md)}, not tensor or "
                                        "bytes storage metadata")
    files: Dict[str, DataFile] = {}
    for index, info in storage.items():
        key, offsets = _index(where, index)
        record = _record(folder, where, key, info, files)
        if key in ck.objects and offsets is None:
            if ck.objects[key].record is not None:
                raise CheckpointFormatError(f"{where}: value {_shown(key)} has two storage records")
            ck.objects[key].record = record
            continue
        chunk = chunk_at.get((key, offsets)) if offsets is not None else None
        if chunk is None:
            raise CheckpointFormatError(f"{where}: a storage record names {_shown(key)} at offsets "
                                        f"{None if offsets is None else list(offsets)}, which no entry has")
        if chunk.record is not None:
            raise CheckpointFormatError(f"{where}: chunk {list(offsets)} of {_shown(key)} has two storage records")
        chunk.record = record
    for t in ck.tensors.values():
        for c in t.chunks:
            if c.record is None:
                raise CheckpointFormatError(f"{where}: chunk {list(c.offsets)} of {_shown(t.key)} has no storage "
                                            "record (the data of a rank is missing)")
        check_tiling(where, t)
    for obj in ck.objects.values():
        if obj.record is None:
            raise CheckpointFormatError(f"{where}: value {_shown(obj.key)} has no storage record")
    _check_shared_records(ck)
    _check_records_apart(folder, [c.record for t in ck.tensors.values() for c in t.chunks]
                         + [o.record for o in ck.objects.values()])
    return ck


def _check_shared_records(ck: DcpCheckpoint) -> None:
    """A record that two entries name must be one tensor saved once for both (a tied parameter): the same
    chunk of each (offsets and sizes), never two chunks of one tensor nor a value's record."""
    first_user: Dict[Tuple[int, int, int], tuple] = {}
    shared: Dict[Tuple[int, int, int], list] = {}  # the few records named more than once
    named = [((id(c.record.file), c.record.offset, c.record.length), (t.key, c))
             for t in ck.tensors.values() for c in t.chunks]
    named += [((id(o.record.file), o.record.offset, o.record.length), (o.key, None)) for o in ck.objects.values()]
    for where, user in named:
        held = first_user.setdefault(where, user)
        if held is not user:
            shared.setdefault(where, [held]).append(user)
    for (_, offset, length), found in shared.items():
        keys = [k for k, _ in found]
        first = found[0][1]
        same = all(c is not None and (c.offsets, c.sizes) == (first.offsets, first.sizes) for _, c in found)
        if not same or len(set(keys)) != len(keys):
            path = (first.record if first is not None else ck.objects[keys[0]].record).file.path
            raise CheckpointFormatError(f"{path}: the record at bytes [{offset}, {offset + length}) is named by "
                                        f"{', '.join(_shown(k) for k in keys[:4])} for different chunks or values; "
                                        "a record holds one chunk, shared only by the same chunk of tied tensors")


def _read_sharded_safetensors(folder: str) -> DcpCheckpoint:
    """The safetensors-backed layout (:mod:`.read_safetensors`) as the same records: each tensor's size is
    where its chunks end, as torch's reader computes it."""
    ck = DcpCheckpoint(folder, layout="safetensors")
    files: Dict[str, DataFile] = {}
    found: "OrderedDict[str, DcpTensor]" = OrderedDict()
    for saved in sharded_chunks(folder):
        data = files.get(saved.path) or files.setdefault(saved.path, DataFile(saved.path, saved.file_size))
        chunk = Chunk(saved.offsets, saved.sizes, Record(data, saved.offset, saved.nbytes), saved.offset)
        held = found.get(saved.key)
        if held is None:
            held = found[saved.key] = DcpTensor(saved.key, (saved.key, ), saved.dtype, (), [])
        elif held.dtype != saved.dtype or len(held.chunks[0].sizes) != len(saved.sizes):
            raise CheckpointFormatError(f"{saved.path}: {_shown(saved.key)} is {saved.dtype} of "
                                        f"{len(saved.sizes)} dimensions here, {held.dtype} of "
                                        f"{len(held.chunks[0].sizes)} in another file")
        held.chunks.append(chunk)
    for t in found.values():
        t.shape = tuple(max(c.offsets[d] + c.sizes[d] for c in t.chunks) for d in range(len(t.chunks[0].sizes)))
        check_tiling(folder, t)
        ck.tensors[t.key] = t
    _check_records_apart(folder, [c.record for t in found.values() for c in t.chunks if c.record.length])
    return ck


def _is(obj, name: str, module: str = _MD) -> bool:
    return isinstance(obj, Opaque) and obj._global == (module, name)


def _kind(obj) -> str:
    return f"{obj._global[0]}.{obj._global[1]}" if isinstance(obj, Opaque) else type(obj).__name__


def _shown(key) -> str:
    return quoted(str(key))


def _dims(where: str, value, what) -> Tuple[int, ...]:
    """``value`` as sizes; ``what`` (a callable, called only for a message: a .metadata lists three of
    these per chunk) names it."""
    if not isinstance(value, (TorchSize, tuple, list)) or len(value) > 64:
        raise CheckpointFormatError(f"{where}: {what()} is not a list of at most 64 sizes")
    for d in value:
        if type(d) is not int or not 0 <= d < MAX_INDEX:
            raise CheckpointFormatError(f"{where}: {what()} holds {quoted(d)}, not a size")
    return tuple(value)


def _path(where: str, key: str, path) -> Tuple[Any, ...]:
    if not isinstance(path, tuple) or not path or len(path) > 64:
        raise CheckpointFormatError(f"{where}: the path of {_shown(key)} in planner_data is not a tuple of keys")
    for part in path:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise CheckpointFormatError(f"{where}: the path of {_shown(key)} holds a {type(part).__name__}")
    return path


def _tensor_entry(where: str, key: str, path, md: Opaque) -> DcpTensor:
    fields = md._state if isinstance(md._state, dict) else {}
    props = fields.get("properties")
    dtype = None
    if _is(props, "TensorProperties") and isinstance(props._state, tuple) and props._state:
        dtype = props._state[0]
    elif _is(props, "TensorProperties") and isinstance(props._state, dict):
        dtype = props._state.get("dtype")
    if not isinstance(dtype, GlobalName) or dtype.module != "torch" or dtype.name not in ITEMSIZE:
        raise CheckpointFormatError(f"{where}: {_shown(key)} has dtype {quoted(dtype)}, not one pyckpt reads "
                                    f"({', '.join(ITEMSIZE)})")
    shape = _dims(where, fields.get("size"), lambda: f"the size of {_shown(key)}")
    if numel(shape) >= MAX_INDEX:
        raise CheckpointFormatError(f"{where}: {_shown(key)} claims {numel(shape)} elements")
    chunks = fields.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise CheckpointFormatError(f"{where}: {_shown(key)} has no chunks")
    out = []
    for c in chunks:
        if not _is(c, "ChunkStorageMetadata") or not isinstance(c._state, dict):
            raise CheckpointFormatError(f"{where}: a chunk of {_shown(key)} is {_kind(c)}, not ChunkStorageMetadata")
        offsets = _dims(where, c._state.get("offsets"), lambda: f"a chunk offset of {_shown(key)}")
        sizes = _dims(where, c._state.get("sizes"), lambda: f"a chunk size of {_shown(key)}")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CheckpointFormatError(f"{where}: chunk {list(offsets)}+{list(sizes)} of {_shown(key)} does not have "
                                        f"the {len(shape)} dimensions of its tensor")
        for o, s, full in zip(offsets, sizes, shape):
            if o + s > full:
                raise CheckpointFormatError(f"{where}: chunk at {list(offsets)} of size {list(sizes)} lies outside "
                                            f"{_shown(key)} of size {list(shape)}")
        out.append(Chunk(offsets, sizes))
    return DcpTensor(key, path, dtype.name, shape, out)


def check_tiling(where: str, t: DcpTensor) -> None:
    """The chunks of ``t`` (each inside it) cover it exactly once: their volumes add up to its elements,
    and no element is in two of them or in none (:mod:`.tiling`: O(n log n) in the chunks of a grid cut
    in any dimensions)."""
    total = sum(numel(c.sizes) for c in t.chunks)
    if total != t.numel():
        raise CheckpointFormatError(f"{where}: the chunks of {_shown(t.key)} hold {total} elements, its size "
                                    f"{list(t.shape)} has {t.numel()}: they do not tile it")
    try:
        fault = tiling_fault(t.shape, [(c.offsets, c.sizes) for c in t.chunks])
    except LayoutTooIrregular:
        raise UnsupportedCheckpointError(f"{where}: the {len(t.chunks)} chunks of {_shown(t.key)} (size "
                                         f"{list(t.shape)}) form a layout too irregular for pyckpt to check that "
                                         "they tile it") from None
    if fault is None:
        return
    element, holders = fault
    if len(holders) > 1:
        first, second = (t.chunks[i] for i in holders[:2])
        raise CheckpointFormatError(f"{where}: chunks at {list(first.offsets)} and {list(second.offsets)} of "
                                    f"{_shown(t.key)} overlap (both hold element {list(element)})")
    raise CheckpointFormatError(f"{where}: element {list(element)} of {_shown(t.key)} is in none of its chunks: "
                                "they do not tile it")


def _index(where: str, index) -> Tuple[str, Optional[Tuple[int, ...]]]:
    if not _is(index, "MetadataIndex"):
        raise CheckpointFormatError(f"{where}: a storage record is keyed by {_kind(index)}, not MetadataIndex")
    fields = index._state if isinstance(index._state, dict) else {}
    fqn, offset = fields.get("fqn"), fields.get("offset")
    if not isinstance(fqn, str):
        raise CheckpointFormatError(f"{where}: a storage record's key names no entry")
    if offset is None:
        return fqn, None
    return fqn, _dims(where, offset, lambda: f"a storage record offset of {_shown(fqn)}")


def _record(folder: str, where: str, key: str, info, files: Dict[str, DataFile]) -> Record:
    if not _is(info, "_StorageInfo", "torch.distributed.checkpoint.filesystem") or not isinstance(info._state, dict):
        raise CheckpointFormatError(f"{where}: the storage record of {_shown(key)} is {_kind(info)}, not _StorageInfo")
    fields = info._state
    if fields.get("transform_descriptors"):
        raise UnsupportedCheckpointError(f"{where}: {_shown(key)} was stored through DCP storage transforms "
                                         f"{quoted(fields['transform_descriptors'])} (compression or extensions), "
                                         "which pyckpt does not decode")
    name, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
    for value, what in ((offset, "offset"), (length, "length")):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_INDEX:
            raise CheckpointFormatError(f"{where}: the storage record of {_shown(key)} has {what} {quoted(value)}")
    data = files.get(name) if isinstance(name, str) else None
    if data is None:
        data = files[name] = _data_file(folder, where, key, name)
    if offset + length > data.size:
        raise CheckpointFormatError(f"{data.path}: the record of {_shown(key)} at bytes [{offset}, {offset + length}) "
                                    f"lies past the end of the {data.size}-byte file (truncated?)")
    return Record(data, offset, length)


def _data_file(folder: str, where: str, key: str, name) -> DataFile:
    """A data file named by the metadata: a plain name of a regular file in the folder (a link only to a
    file inside it)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name
            or name == METADATA_NAME or len(name) > 255):
        raise CheckpointFormatError(f"{where}: the storage record of {_shown(key)} names the file "
                                    f"{_shown(name)}, not a file name inside the checkpoint folder")
    check_links_inside(folder, [name])
    path = os.path.join(folder, name)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing (the metadata's record of {_shown(key)} is in it)") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointFormatError(f"{path}: not a regular file")
    return DataFile(path, st.st_size)


def _check_records_apart(folder: str, records: Sequence[Record]) -> None:
    """No two records share a byte, unless they are one record: two chunks read from overlapping bytes would
    be one chunk's data passed off as another's. The same record under two entries is a tied tensor saved
    once (pyckpt's DCP export points a tied parameter's second name at the first one's chunks, and torch's
    reader loads it so); each entry's chunk is checked against that archive's one tensor all the same."""
    by_file: Dict[int, List[Record]] = {}
    for r in records:
        by_file.setdefault(id(r.file), []).append(r)
    for group in by_file.values():
        group.sort(key=lambda r: (r.offset, r.length))
        distinct = [r for i, r in enumerate(group)
                    if i == 0 or (r.offset, r.length) != (group[i - 1].offset, group[i - 1].length)]
        for a, b in zip(distinct, distinct[1:]):
            if a.offset + a.length > b.offset:
                raise CheckpointFormatError(f"{a.file.path}: records at bytes [{a.offset}, {a.offset + a.length}) and "
                                            f"[{b.offset}, {b.offset + b.length}) overlap")


def _archive_heads(records: Sequence[Record]):
    """(size, prefix, members, data.pkl bytes) of the archive in each record, read in native batches;
    a record whose archive cannot be read is opened alone to raise why."""
    cap = max_pickle_bytes()
    for lo in range(0, len(records), _HEAD_BATCH):
        batch = records[lo:lo + _HEAD_BATCH]
        heads = _core.read_archive_heads([r.file.path for r in batch], "data.pkl", cap, 0,
                                         [(r.offset, r.length) for r in batch])
        for r, head in zip(batch, heads):
            if head is None:
                os.close(open_regular(r.file.path))
                with native_errors():
                    _core.Archive(r.file.path, offset=r.offset, length=r.length).close()
                raise CheckpointFormatError(f"{r.file.path}: the archive at bytes [{r.offset}, "
                                            f"{r.offset + r.length}) cannot be read")
            yield r, head


def _where(r: Record) -> str:
    return r.where()


def _locate_chunks(folder: str, chunks: List[Tuple[DcpTensor, Chunk]]) -> None:
    """Read each chunk's archive head and check its one tensor against the chunk: dtype, sizes, its
    bytes inside its storage record; the chunk's data offset is set from it."""
    for (t, c), (r, head) in zip(chunks, _archive_heads([c.record for _, c in chunks])):
        where = _where(r)
        _, prefix, members, pkl = head
        if pkl is None:
            raise CheckpointFormatError(f"{where}: the chunk archive of {_shown(t.key)} has no {prefix}/data.pkl of "
                                        f"at most {max_pickle_bytes()} bytes")
        obj, storages = loads_with_storages(pkl, None, where)
        if not isinstance(obj, TensorRef):
            raise CheckpointFormatError(f"{where}: the record of a chunk of {_shown(t.key)} holds a "
                                        f"{type(obj).__name__}, not a tensor")
        if obj.dtype != t.dtype or tuple(obj.shape) != c.sizes:
            raise CheckpointFormatError(f"{where}: the chunk at {list(c.offsets)} of {_shown(t.key)} should be "
                                        f"{t.dtype}{list(c.sizes)}; its record holds {obj.dtype}{list(obj.shape)}")
        if not obj.is_contiguous():
            raise UnsupportedCheckpointError(f"{where}: the chunk of {_shown(t.key)} is saved as a strided view "
                                             f"(stride {list(obj.stride)}), not a contiguous tensor")
        name = f"{prefix}/data/{obj.storage.key}"
        entry = members.get(name)
        if entry is None:
            raise CheckpointFormatError(f"{where}: the pickle names storage record {name}, which is missing")
        off, size, _ = entry
        end = (obj.offset + obj.numel()) * obj.itemsize
        if obj.numel() and (size < obj.storage.nbytes or end > size):
            raise CheckpointFormatError(f"{where}: record {name} holds {size} bytes, fewer than the "
                                        f"{end} its chunk of {_shown(t.key)} needs")
        del storages
        c.data_offset = off + obj.offset * obj.itemsize


def chunk_pieces(shape: Tuple[int, ...], c: Chunk, itemsize: int, src) -> List[Piece]:
    """Where a chunk's contiguous bytes (at ``c.data_offset`` of ``src``) land in the whole tensor: one
    strided piece per index of the dimensions before the last two cut ones (one piece for a chunk cut
    along one or two dimensions, the layouts FSDP2 and tensor parallelism make)."""
    n = len(shape)
    if numel(c.sizes) == 0:
        return []
    k = n - 1
    while k >= 0 and c.sizes[k] == shape[k]:
        k -= 1
    inner = [1] * (n + 1)  # inner[j]: elements of one index of dimension j-1 of the whole tensor
    for j in range(n - 1, -1, -1):
        inner[j] = inner[j + 1] * shape[j]
    if k < 0:  # the whole tensor
        return [Piece(src, c.data_offset, numel(shape) * itemsize, 0)]
    run = c.sizes[k] * inner[k + 1]
    if k == 0:
        return [Piece(src, c.data_offset, run * itemsize, c.offsets[0] * inner[1] * itemsize)]
    rows, stride = c.sizes[k - 1], inner[k] * itemsize
    lead = c.offsets[k - 1] * inner[k] + c.offsets[k] * inner[k + 1]
    chunk_inner = [1] * (n + 1)
    for j in range(n - 1, -1, -1):
        chunk_inner[j] = chunk_inner[j + 1] * c.sizes[j]
    pieces = []

    def walk(j: int, dst: int, src_off: int) -> None:
        if j == k - 1:
            pieces.append(Piece(src, c.data_offset + src_off * itemsize, run * itemsize, (dst + lead) * itemsize, 0,
                                rows, stride))
            return
        for i in range(c.sizes[j]):
            walk(j + 1, dst + (c.offsets[j] + i) * inner[j + 1], src_off + i * chunk_inner[j + 1])

    walk(0, 0, 0)
    return pieces


def _assembled(t: DcpTensor) -> NewTensor:
    size = ITEMSIZE[t.dtype]
    pieces: List[Piece] = []
    for c in t.chunks:
        pieces.extend(chunk_pieces(t.shape, c, size, c.record.file))
    pieces.sort(key=lambda p: p.dst_off)
    return NewTensor(t.dtype, t.shape, pieces)


def _read_value(folder: str, obj: DcpObject) -> Any:
    r = obj.record
    if r.length > MAX_VALUE_BYTES:
        raise CheckpointFormatError(f"{_where(r)}: value {_shown(obj.key)} is {r.length} bytes, more than the "
                                    f"{MAX_VALUE_BYTES} a value entry may hold")
    (_, (_, prefix, members, pkl)), = list(_archive_heads([r]))
    if pkl is None:
        raise CheckpointFormatError(f"{_where(r)}: the archive of {_shown(obj.key)} has no {prefix}/data.pkl")
    value, storages = loads_with_storages(pkl, None, _where(r))
    if storages:
        raise UnsupportedCheckpointError(f"{_where(r)}: value {_shown(obj.key)} holds tensors inside a Python "
                                         "object, which pyckpt does not read")
    return value
