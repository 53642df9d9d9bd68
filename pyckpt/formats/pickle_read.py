"""Reading the pickles inside torch.save files without running code from them.

DeepSpeed checkpoints are pickles, and ``torch.load(weights_only=False)`` will import and call any
global a pickle names. This module parses them with an allowlist instead:

* tensors become :class:`TensorRef` (storage record key, dtype, offset, shape, stride) - no bytes
  are read, so opening a 10 GB shard costs only its small ``data.pkl``;
* plain containers are rebuilt as themselves (dict, OrderedDict, list, tuple, set, torch.Size);
* a short list of known DeepSpeed/torch/numpy/argparse classes become :class:`Opaque` records of
  (global, arguments, state) - inert data that :mod:`pyckpt.formats.pickle_write` can write back under the
  same global name without importing it;
* anything else raises :class:`UnsafePickleError` naming the file and the global.

One module, longer than most: the opcode reader and the allowlist are one security boundary, and
everything that decides what a pickle may make is kept where one reading audits all of it.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..errors import CheckpointFormatError, UnsafePickleError, quoted
from ..tensors import ITEMSIZE, numel
from ..native import scan_pickle

# Legacy storage class names in persistent ids -> (dtype name, itemsize).
STORAGE_DTYPES: Dict[str, Tuple[str, int]] = {
    "FloatStorage": ("float32", 4),
    "DoubleStorage": ("float64", 8),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "ComplexFloatStorage": ("complex64", 8),
    "ComplexDoubleStorage": ("complex128", 16),
}
DTYPE_STORAGE = {dtype: name for name, (dtype, _) in STORAGE_DTYPES.items()}
assert {dtype: size for dtype, size in STORAGE_DTYPES.values()} == ITEMSIZE


@dataclass(eq=False, slots=True)
class StorageRef:
    """One tensor storage record of a torch.save archive (not read)."""

    source: Any  # the object that opened the file (pyckpt.formats.torch_zip.SourceFile)
    key: str
    dtype: str
    numel: int
    location: str = "cpu"
    # the record's absolute byte offset in ``source``, once that file has checked the record
    # against its member table (SourceFile.storage_offset)
    file_offset: Optional[int] = field(default=None, compare=False, repr=False)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(eq=False, slots=True)
class TensorRef:
    """A tensor as the pickle describes it: a strided view of a storage record."""

    storage: StorageRef
    offset: int  # in elements
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    requires_grad: bool = False
    # torch writes tensors that carry Python attributes (ZeRO-3's fp32 partitions have ``ds_id``)
    # through torch._tensor._rebuild_from_type_v2; keeping the attributes lets us write them back.
    py_state: Optional[dict] = None
    is_parameter: bool = False

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    def numel(self) -> int:
        return numel(self.shape)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and st != expected:
                return False
            expected *= size
        return True

    def __repr__(self) -> str:  # short, for --dry-run and error messages
        return f"TensorRef({self.dtype}{list(self.shape)} @{self.storage.key}+{self.offset})"


class Opaque:
    """An allowlisted object kept as data: which global built it, with what, and its state."""

    _global: Tuple[str, str] = ("", "")
    # What an object holds until the pickle says otherwise is the class's, and its lists of APPENDS and
    # SETITEMS are made when first asked for: a DCP .metadata builds hundreds of thousands of these
    # records, and two empty lists each were most of their cost.
    _state = None
    _how = "newobj"
    _items = property(lambda self: self.__dict__.setdefault("_item_list", []))
    _setitems = property(lambda self: self.__dict__.setdefault("_setitem_list", []))

    def __new__(cls, *args):
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args):
        # Only REDUCE goes through __init__ (NEWOBJ calls __new__ alone), so this tells them apart.
        self.__dict__["_how"] = "reduce"

    def __setstate__(self, state):
        self.__dict__["_state"] = state

    # APPENDS/SETITEMS on a reduced object call these; record instead of acting.
    def append(self, item):
        self._items.append(item)

    def extend(self, items):
        self._items.extend(items)

    def __setitem__(self, key, value):
        self._setitems.append((key, value))

    def __getattr__(self, name):
        state = self.__dict__.get("_state")
        if isinstance(state, dict) and name in state:
            return state[name]
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and name in state[1]:
            return state[1][name]  # (dict_state, slot_state) form
        raise AttributeError(f"{self._global[0]}.{self._global[1]} object has no field {name!r}")

    def __eq__(self, other):
        return (isinstance(other, Opaque) and self._global == other._global and self._args == other._args
                and self._state == other._state)

    def __hash__(self):
        return hash(self._global)

    def __repr__(self):
        mod, name = self._global
        inner = self._state if self._state is not None else self._args
        return f"<{mod}.{name} {inner!r}>"


class OpaqueEnum(Opaque):
    """An Enum member pickled as ``Cls(value)`` (DeepSpeed's ZeroStageEnum)."""

    @property
    def value(self):
        return self._args[0]

    def __int__(self):
        return int(self._args[0])

    def __eq__(self, other):
        if isinstance(other, int):
            return self._args[0] == other
        return Opaque.__eq__(self, other)

    def __hash__(self):
        return hash(self._args[0])


class OpaqueKey(Opaque):
    """A record that a pickle uses as a dict key: its hash is its fields' (those that hash), so equal
    records still hash alike and distinct ones rarely collide."""

    def __hash__(self):
        state = self._state
        try:
            if isinstance(state, dict):
                return hash((self._global, tuple(state.items())))
            return hash((self._global, self._args, state))
        except TypeError:  # a field that does not hash (a crafted file): the class alone, as any Opaque
            return hash(self._global)


class TorchSize(tuple):
    """torch.Size as data: a tuple that is written back as ``torch.Size`` (torch is never imported)."""

    __slots__ = ()

    def __new__(cls, dims=()):
        # torch.Size takes a sequence of ints and nothing else (no str, float or bytes that int()
        # would coerce): a file copied verbatim must load in torch as it parsed here.
        if not isinstance(dims, (tuple, list)):
            raise _BadData(f"torch.Size built from {type(dims).__name__}, expected a tuple of integers")
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, int):
                raise _BadData(f"torch.Size entry {_short(d)} is a {type(d).__name__}, not an integer")
            if not -(1 << 63) <= d < (1 << 63):
                raise _BadData(f"torch.Size entry {d} does not fit in 64 bits")
        return super().__new__(cls, dims)

    def numel(self) -> int:
        return numel(self)

    def __repr__(self):
        return f"torch.Size({list(self)})"


@dataclass(frozen=True)
class GlobalName:
    """A global that is used as a value (a dtype, ``torch.Tensor``) and written back by name."""

    module: str
    name: str


_DCP_MD = "torch.distributed.checkpoint.metadata"
# Classes that are rebuilt as inert Opaque records.
OPAQUE_CLASSES = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
    ("argparse", "Namespace"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("copyreg", "_reconstructor"),
    # torch.distributed.checkpoint's .metadata (torch 2.13, metadata.py and filesystem.py): records of
    # keys, chunks and where each chunk's archive lies. StorageMeta keeps the checkpoint_id the job
    # saved to, a str or a pathlib path.
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
}
# Records used as dict keys (DCP's storage_data is keyed by MetadataIndex): hashed by their fields, so
# a dict of n of them is built in n steps, not n * n comparisons of equal hashes.
OPAQUE_KEYS = {
    (_DCP_MD, "MetadataIndex"),
}
OPAQUE_ENUMS = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
}
TORCH_DTYPE_NAMES = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
    "complex128", "float", "double", "half", "long", "int"
}


def _safe_codecs_encode(text, encoding="utf-8"):
    # Protocol-2 pickles of ``bytes`` use _codecs.encode(str, 'latin1'); nothing else is needed.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafePickleError(f"_codecs.encode called with {type(text).__name__}/{encoding!r}")
    return text.encode(encoding)


def _set(items=()):
    return set(items)


def _frozenset(items=()):
    return frozenset(items)


class _Reader(pickle.Unpickler):

    def __init__(self, data: bytes, source, where: str):
        # A reader with peek(): CPython's unpickler then takes the pickle in one prefetch instead of
        # one read() call per opcode, which made a 3 KB shard pickle cost 200 us rather than 100.
        super().__init__(io.BufferedReader(io.BytesIO(data), buffer_size=max(len(data), 1)))
        self._source = source
        self._where = where
        self._storages: Dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str):
        # A pickle names a global per object it builds (a shard names ~16); a table lookup keeps
        # that from costing a chain of comparisons on every one of thousands of files.
        found = _GLOBALS.get((module, name))
        if found is None:
            raise UnsafePickleError(f"{self._where}: refusing to load global {_short(f'{module}.{name}', 120)}: it is "
                                    "not on pyckpt's allowlist of checkpoint types, so the file was not unpickled "
                                    "(nothing was run)")
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _BadData(f"unexpected persistent id {_short(pid)}")
        _, storage_type, key, location, count = pid
        if not isinstance(storage_type, GlobalName) or storage_type.name not in STORAGE_DTYPES:
            raise _BadData(f"unsupported storage type {_short(storage_type)}")
        # torch names records data/<key> with a decimal key; anything else could address other members.
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 20:
            raise _BadData(f"storage key {_short(key)} is not a decimal record number")
        if not isinstance(location, str):
            raise _BadData(f"storage location {_short(location)} is not a string")
        if type(count) is not int or not 0 <= count < MAX_INDEX:
            count = _index(count, f"element count of storage record {key}")
        dtype = STORAGE_DTYPES[storage_type.name][0]
        ref = self._storages.get(key)
        if ref is None:
            ref = StorageRef(self._source, shared_value(key), dtype, count, shared_value(location))
            self._storages[key] = ref
        elif (ref.dtype, ref.numel) != (dtype, count):
            raise _BadData(f"storage record {key} is named twice with different types ({ref.dtype}[{ref.numel}] vs "
                           f"{dtype}[{count}])")
        return ref

    def storages(self) -> Dict[str, StorageRef]:
        return self._storages


def _short(value, limit: int = 60) -> str:
    """A repr fit for a one-line message whatever the input holds."""
    return quoted(value, limit)


TORCH_TENSOR = GlobalName("torch", "Tensor")
# Offsets, sizes and counts beyond this cannot describe bytes of any real file; refusing them early
# keeps later arithmetic (and the native executor's int64 op table) free of overflow.
MAX_INDEX = 1 << 62


class _BadData(Exception):
    """A value in the pickle breaks a format rule; ``loads`` prefixes the file name."""


def _index(value, what: str) -> int:
    """A non-negative integer below MAX_INDEX, or _BadData naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadData(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= value < MAX_INDEX:
        raise _BadData(f"{what} {value} is out of range")
    return value


# A planner holds the records of every rank file at once, and rank files repeat the same few
# shapes, strides and strings ((520,), (1,), 'cpu', '0'): one shared object for each equal value
# instead of one per file keeps a 4,096-rank checkpoint's records from growing with equal copies.
# Bounded, so a hostile file of distinct values costs no more than without it.
_SHARED: Dict[Any, Any] = {}
_SHARED_MAX = 1 << 16


def shared_value(value):
    found = _SHARED.get(value)
    if found is not None:
        return found
    if len(_SHARED) < _SHARED_MAX:
        _SHARED[value] = value
    return value


def _dims(values, what: str) -> Tuple[int, ...]:
    # Every tensor of every file passes here twice (size, stride): the common case, a short tuple of
    # in-range ints, is accepted as it is; anything else takes the checks below.
    if type(values) is tuple and len(values) <= 64:
        for v in values:
            if type(v) is not int or not 0 <= v < MAX_INDEX:
                break
        else:
            return shared_value(values) if len(values) <= 4 else values
    if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)):
        raise _BadData(f"tensor {what} must be a tuple of integers, got {type(values).__name__}")
    if len(values) > 64:
        raise _BadData(f"tensor {what} has {len(values)} dimensions")
    return tuple(_index(v, f"tensor {what} entry") for v in values)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, StorageRef):
        raise _BadData(f"tensor rebuilt from {type(storage).__name__}, expected a storage record")
    if metadata:
        raise _BadData("tensors with serialized metadata (e.g. conjugate/negative views) are not supported")
    offset = storage_offset if type(storage_offset) is int and 0 <= storage_offset < MAX_INDEX else \
        _index(storage_offset, "tensor storage_offset")
    shape = _dims(size, "size")
    strides = _dims(stride, "stride")
    if len(shape) != len(strides):
        raise _BadData(f"tensor size {list(shape)} and stride {list(strides)} differ in length")
    # The view must lie inside its storage on both ends, as torch.load requires: the first element
    # at `offset`, the last at offset + sum((size-1)*stride).
    if 0 not in shape:
        last = offset
        for n, st in zip(shape, strides):
            last += (n - 1) * st
        if last >= storage.numel:
            raise _BadData(f"tensor view (offset {offset}, size {list(shape)}, stride {list(strides)}) reaches "
                           f"element {last}, past the end of storage record {storage.key} of {storage.numel} "
                           "elements")
    return TensorRef(storage, offset, shape, strides, bool(requires_grad))


def _rebuild_parameter(data, requires_grad, backward_hooks):
    if not isinstance(data, TensorRef):
        raise _BadData("parameter rebuilt from a non-tensor")
    data.requires_grad = bool(requires_grad)
    data.is_parameter = True
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    if func is not _rebuild_tensor_v2 or new_type is not TORCH_TENSOR:
        raise UnsafePickleError("_rebuild_from_type_v2 is only accepted for plain torch.Tensor")
    if not isinstance(args, tuple):
        raise _BadData("_rebuild_from_type_v2 arguments must be a tuple")
    tensor = _rebuild_tensor_v2(*args)
    if state is not None and not isinstance(state, dict):
        raise _BadData(f"tensor attributes must be a dict, got {type(state).__name__}")
    tensor.py_state = dict(state) if state else {}
    return tensor


def _allowed_globals() -> Dict[Tuple[str, str], Any]:
    """What each allowlisted global stands for while parsing. An opaque class is one class per global,
    shared by every file: it holds no state of its own (each object keeps its arguments and state)."""
    table: Dict[Tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Tensor"): TORCH_TENSOR,
        ("torch", "Size"): TorchSize,
        ("collections", "OrderedDict"): OrderedDict,
        ("builtins", "set"): _set,
        ("__builtin__", "set"): _set,
        ("builtins", "frozenset"): _frozenset,
        ("__builtin__", "frozenset"): _frozenset,
        ("_codecs", "encode"): _safe_codecs_encode,
    }
    for name in set(STORAGE_DTYPES) | TORCH_DTYPE_NAMES:
        table.setdefault(("torch", name), GlobalName("torch", name))
    for key in OPAQUE_CLASSES | OPAQUE_ENUMS | OPAQUE_KEYS:
        base = OpaqueEnum if key in OPAQUE_ENUMS else OpaqueKey if key in OPAQUE_KEYS else Opaque
        table[key] = type(key[1], (base, ), {"_global": key, "__module__": __name__})
    return table


_GLOBALS = _allowed_globals()


def loads(data: bytes, source=None, where: str = "<pickle>") -> Any:
    """Parse one pickle; ``where`` names the file in every error."""
    obj, _ = loads_with_storages(data, source, where)
    return obj


def loads_with_storages(data: bytes, source=None, where: str = "<pickle>",
                        scan=None) -> Tuple[Any, Dict[str, StorageRef]]:
    """``loads``, plus every storage record the pickle names (for checking them against the archive).

    ``scan`` is ``native.scan_pickle(data)`` when the caller already has it (SourceFile keeps one
    per file for its opcode check too)."""
    scan = scan_pickle(data) if scan is None else scan
    if scan.overlong_at >= 0:
        # The unpickler would allocate the claimed length before noticing the data ends.
        raise CheckpointFormatError(f"{where}: the argument of the opcode at byte {scan.overlong_at} claims more "
                                    f"bytes than the {len(data)}-byte pickle holds: truncated or corrupt pickle")
    if scan.max_index >= scan.stores:
        # CPython's unpickler would size its memo array from this index (a 5-byte edit can make it
        # allocate and zero gigabytes); a real pickler numbers its stores 0, 1, 2, ...
        raise CheckpointFormatError(f"{where}: memo index {scan.max_index} (at byte {scan.max_index_at}) is beyond "
                                    f"the {scan.stores} objects the pickle stores: corrupt or crafted pickle")
    reader = _Reader(data, source, where)
    try:
        return reader.load(), reader.storages()
    except UnsafePickleError as exc:
        if str(exc).startswith(f"{where}: "):
            raise
        raise UnsafePickleError(f"{where}: {exc}") from None
    except CheckpointFormatError:
        raise
    except _BadData as exc:
        raise CheckpointFormatError(f"{where}: {exc}") from None
    except Exception as exc:  # truncated or garbled bytes, absurd nesting, ...
        raise CheckpointFormatError(f"{where}: cannot parse pickle: {type(exc).__name__}: "
                                    f"{_short(str(exc), 200)}") from None
