"""Writing the ``data.pkl`` of a torch.save archive, without importing what it names.

Python's pickler insists on importing every class it writes; pyckpt must write DeepSpeed objects
(loss scalers, ZeroStageEnum, SubparamShape) without DeepSpeed installed and tensors that do not
exist in memory yet. So this is a small protocol-2 emitter for exactly the values checkpoints hold,
producing the same opcodes torch.save produces, plus the list of storage records to write.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from ..tensors import NewTensor
from .pickle_read import DTYPE_STORAGE, GlobalName, Opaque, TensorRef, TorchSize


@dataclass
class StorageOut:
    """A storage record of the archive being written, and where its bytes come from."""

    key: str
    dtype: str
    numel: int
    source: Any  # StorageRef (copied whole) or NewTensor (assembled)


@dataclass(eq=False)  # hashed by identity: it may be a dict key (DCP's MetadataIndex)
class Constructed:
    """An object of a class pyckpt does not import, written as its pickle builds it: the class by
    name, called with ``args`` (``how``: "newobj" creates it without __init__, as pickle does for a
    plain class; "reduce" calls it), then BUILD with ``state`` unless that is None."""

    module: str
    name: str
    args: tuple = ()
    how: str = "newobj"
    state: Any = None


def _contiguous_stride(shape):
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


class _Emitter:

    def __init__(self):
        self.out = bytearray(b"\x80\x02")
        self.storages: List[StorageOut] = []
        self._storage_keys: Dict[int, str] = {}

    # -- scalars ------------------------------------------------------------------------------
    def _int(self, v: int):
        if 0 <= v < 256:
            self.out += b"K" + bytes([v])
        elif 0 <= v < 65536:
            self.out += b"M" + struct.pack("<H", v)
        elif -2**31 <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw

    def _str(self, s: str):
        raw = s.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw

    def _global(self, module: str, name: str):
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def _tuple(self, items):
        if len(items) == 0:
            self.out += b")"
            return
        if len(items) <= 3:
            for it in items:
                self.dump(it)
            self.out += {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(items)]
            return
        self.out += b"("
        for it in items:
            self.dump(it)
        self.out += b"t"

    def _setitems(self, items):
        items = list(items)
        for start in range(0, len(items), 1000):
            self.out += b"("
            for k, v in items[start:start + 1000]:
                self.dump(k)
                self.dump(v)
            self.out += b"u"

    def _appends(self, items):
        items = list(items)
        for start in range(0, len(items), 1000):
            self.out += b"("
            for it in items[start:start + 1000]:
                self.dump(it)
            self.out += b"e"

    # -- tensors -------------------------------------------------------------------------------
    def _storage_key(self, source, dtype: str, numel: int) -> str:
        ident = id(source)
        key = self._storage_keys.get(ident)
        if key is None:
            key = str(len(self.storages))
            self._storage_keys[ident] = key
            self.storages.append(StorageOut(key, dtype, numel, source))
        return key

    def _tensor_args(self, storage_source, dtype, numel, offset, shape, stride, requires_grad):
        key = self._storage_key(storage_source, dtype, numel)
        self.out += b"(("  # marks: the argument tuple, then the persistent-id tuple
        self._str("storage")
        self._global("torch", DTYPE_STORAGE[dtype])
        self._str(key)
        self._str("cpu")
        self._int(numel)
        self.out += b"tQ"  # TUPLE, BINPERSID
        self._int(offset)
        self._tuple(list(shape))
        self._tuple(list(stride))
        self.out += b"\x88" if requires_grad else b"\x89"
        self._global("collections", "OrderedDict")
        self.out += b")R"
        self.out += b"t"  # 6-tuple of _rebuild_tensor_v2 arguments

    def _tensor(self, t):
        if isinstance(t, NewTensor):
            args = (t, t.dtype, t.numel(), 0, t.shape, _contiguous_stride(t.shape), t.requires_grad)
            py_state, is_param = None, False
        else:
            st = t.storage
            args = (st, st.dtype, st.numel, t.offset, t.shape, t.stride, t.requires_grad)
            py_state, is_param = t.py_state, t.is_parameter
        if is_param:
            raise NotImplementedError("writing torch.nn.Parameter objects is not needed by any output")
        if py_state is not None:
            self._global("torch._tensor", "_rebuild_from_type_v2")
            self.out += b"("
            self._global("torch._utils", "_rebuild_tensor_v2")
            self._global("torch", "Tensor")
            self._tensor_args(*args)
            self.dump(py_state)
            self.out += b"tR"
        else:
            self._global("torch._utils", "_rebuild_tensor_v2")
            self._tensor_args(*args)
            self.out += b"R"

    # -- everything ----------------------------------------------------------------------------
    def dump(self, obj):
        if obj is None:
            self.out += b"N"
        elif obj is True:
            self.out += b"\x88"
        elif obj is False:
            self.out += b"\x89"
        elif isinstance(obj, int) and not isinstance(obj, Opaque):
            self._int(int(obj))
        elif isinstance(obj, float):
            self.out += b"G" + struct.pack(">d", obj)
        elif isinstance(obj, str):
            self._str(obj)
        elif isinstance(obj, (TensorRef, NewTensor)):
            self._tensor(obj)
        elif isinstance(obj, TorchSize) or _is_torch_size(obj):
            self._global("torch", "Size")
            self._tuple([tuple(obj)])
            self.out += b"R"
        elif isinstance(obj, OrderedDict):
            self._global("collections", "OrderedDict")
            self.out += b")R"
            self._setitems(obj.items())
        elif isinstance(obj, dict):
            self.out += b"}"
            self._setitems(obj.items())
        elif isinstance(obj, list):
            self.out += b"]"
            self._appends(obj)
        elif isinstance(obj, tuple):
            self._tuple(list(obj))
        elif isinstance(obj, (set, frozenset)):
            self._global("builtins", type(obj).__name__)
            self.out += b"]"
            self._appends(sorted(obj, key=repr))
            self.out += b"\x85R"
        elif isinstance(obj, bytes):
            self._global("_codecs", "encode")
            self._str(obj.decode("latin1"))
            self._str("latin1")
            self.out += b"\x86R"
        elif isinstance(obj, GlobalName):
            self._global(obj.module, obj.name)
        elif isinstance(obj, Opaque):
            self._opaque(obj)
        elif isinstance(obj, Constructed):
            self._global(obj.module, obj.name)
            self._tuple(list(obj.args))
            self.out += b"\x81" if obj.how == "newobj" else b"R"
            if obj.state is not None:
                self.dump(obj.state)
                self.out += b"b"
        else:
            raise TypeError(f"cannot write {type(obj).__name__} into a checkpoint pickle")

    def _opaque(self, obj: Opaque):
        module, name = obj._global
        self._global(module, name)
        self._tuple(list(obj._args))
        self.out += b"\x81" if obj._how == "newobj" else b"R"
        if obj._state is not None:
            self.dump(obj._state)
            self.out += b"b"
        if obj._items:
            self._appends(obj._items)
        if obj._setitems:
            self._setitems(obj._setitems)


def _is_torch_size(obj) -> bool:
    # Callers may hand in real torch.Size objects; recognise them without importing torch.
    cls = type(obj)
    return cls.__name__ == "Size" and cls.__module__ == "torch"


def dumps(obj) -> Tuple[bytes, List[StorageOut]]:
    """Pickle ``obj`` the way torch.save does; returns the bytes and the storage records it names."""
    em = _Emitter()
    em.dump(obj)
    em.out += b"."
    return bytes(em.out), em.storages


_SCALARS = (type(None), bool, int, float, str, bytes, GlobalName)
# exactly these types (not subclasses): nothing to walk into
_PLAIN = frozenset((type(None), bool, int, float, str, bytes))


def storages_of(obj) -> List[StorageOut]:
    """The storage records ``dumps(obj)`` would name, without writing the pickle: what a dry run
    reports for every output. It walks the values ``dumps`` writes, in its order, so the records
    (keys, dtypes, sizes, sources) are the same; a DeepSeek-shaped plan's optimizer state and model
    states are large nested objects whose pickles took a third of its dry run."""
    found: List[StorageOut] = []
    keys: Dict[int, str] = {}

    def storage(source, dtype, numel):
        if id(source) not in keys:
            keys[id(source)] = str(len(found))
            found.append(StorageOut(keys[id(source)], dtype, numel, source))

    def walk(value):
        if type(value) in _PLAIN or isinstance(value, _SCALARS) and not isinstance(value, Opaque):
            return
        if isinstance(value, NewTensor):
            storage(value, value.dtype, value.numel())
        elif isinstance(value, TensorRef):
            if value.is_parameter:
                raise NotImplementedError("writing torch.nn.Parameter objects is not needed by any output")
            storage(value.storage, value.storage.dtype, value.storage.numel)
            if value.py_state is not None:
                walk(value.py_state)
        elif isinstance(value, TorchSize) or _is_torch_size(value):
            return
        elif isinstance(value, dict):
            for k, v in value.items():  # most keys and many values are plain: no call for them
                if type(k) not in _PLAIN:
                    walk(k)
                if type(v) not in _PLAIN:
                    walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                if type(v) not in _PLAIN:
                    walk(v)
        elif isinstance(value, (set, frozenset)):
            for v in sorted(value, key=repr):
                walk(v)
        elif isinstance(value, Opaque):
            walk(value._args)
            walk(value._state)
            walk(value._items)
            for k, v in value._setitems:
                walk(k)
                walk(v)
        elif isinstance(value, Constructed):
            walk(value.args)
            walk(value.state)
        else:
            raise TypeError(f"cannot write {type(value).__name__} into a checkpoint pickle")

    walk(obj)
    return found
