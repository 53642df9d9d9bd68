"""A ZeRO checkpoint seen as the Universal Checkpoint it would convert to, without writing one.

The checkpoint's logical state (:func:`pyckpt.zero.read.read_zero_state`) already
says where every element of every parameter state comes from: byte pieces of the ZeRO shards, the
same values a converted folder's ``zero/<name>/<key>.pt`` files hold. Read through it, the planners
of this package see the same parameter states, global state and steps as in a converted folder, and gather each rank's element runs straight from the original shards: no
universal folder, no extra disk, each rank reading only its own bytes.

Checkpoints saved without ``universal_checkpoint_info`` are read as ``--inject_missing_state`` reads
them. The few tensors the plan computes in memory (averaged tensor-parallel replicas, scaled affine
pieces) are served from the bytes planning computed (every rank plans, so every rank has read their
sources); the ones it casts (the module fallback of parameters without fp32 state) are cast on the way.
"""

from __future__ import annotations

import bisect
import os
from typing import Dict, List, Tuple

from ...zero.discovery import discover
from ...universal.layout import OPTIMIZER_STATE, STATE_META_TYPES, param_folder, param_state_path
from ...zero.read import read_zero_state
from ...errors import CheckpointFormatError, metadata_errors, quoted
from ...planning.state import STEP
from ...tensors import ITEMSIZE, NewTensor
from ...native import KIND_COPY, KIND_SOURCE_DTYPE
from .state_files import GlobalState, ParamStates, StateFile, global_state_of, scalar_tensor

class VirtualStateFile:
    """One planned ``zero/<name>/<key>.pt`` tensor: element runs resolve to byte ranges of the shards
    (cast on the way where the plan casts), to zeros, or to the bytes the plan computed in memory."""

    def __init__(self, label: str, tensor: NewTensor):
        self.path = label
        size = ITEMSIZE[tensor.dtype]
        # (dst_off, dst_bytes, shard path | computed bytes | None for zeros, src_off, src dtype), in
        # planned bytes; a strided piece (a tensor-parallel merge along a later dimension) is one row
        # per source row
        rows = []
        if tensor.data is not None:  # an averaged tensor-parallel replica, a scaled affine piece
            rows.append((0, len(tensor.data), bytes(tensor.data), 0, tensor.dtype))
        for p in tensor.pieces:
            dtype = tensor.dtype if p.kind == KIND_COPY or p.src is None else KIND_SOURCE_DTYPE.get(p.kind)
            if dtype is None:
                raise CheckpointFormatError(f"{label}: a piece of {p.src.path} is planned with conversion {p.kind}, "
                                            "which a load cannot apply")
            out_bytes = p.nbytes if p.src is None else p.nbytes // ITEMSIZE[dtype] * size
            for i in range(p.rows):
                rows.append((p.dst_off + i * p.stride, out_bytes, None if p.src is None else p.src.path,
                             p.src_off + i * p.nbytes, dtype))
        rows.sort(key=lambda r: r[0])
        self._pieces = rows
        self._starts = [r[0] for r in rows]
        covered = sum(r[1] for r in rows)
        if covered != tensor.numel() * size:
            raise CheckpointFormatError(f"{label}: the shards give {covered} bytes of a "
                                        f"{tensor.numel() * size}-byte tensor")

    def byte_runs(self, tensor: NewTensor, start: int, n: int) -> List[Tuple[object, int, int, str]]:
        """Elements [start, start + n) of the planned tensor as (where, byte offset, element count,
        dtype there): where is a shard's path, the computed bytes, or None for zeros."""
        size = ITEMSIZE[tensor.dtype]
        lo, hi = start * size, (start + n) * size
        out = []
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while lo < hi and i < len(self._pieces):
            dst, nbytes, where, src_off, dtype = self._pieces[i]
            a, b = max(lo, dst), min(hi, dst + nbytes)
            if a < b:
                if a != lo:
                    break  # a hole: reported below
                out.append((where, src_off + (a - dst) // size * ITEMSIZE[dtype], (b - a) // size, dtype))
                lo = b
            i += 1
        if lo < hi:
            raise CheckpointFormatError(f"{self.path}: elements [{start}, {start + n}) are outside the planned tensor")
        return out


def _scalar(t: NewTensor, where: str):
    if len(t.pieces) != 1:
        raise CheckpointFormatError(f"{where}: step is {t.dtype}{list(t.shape)}; expected one float or integer")
    p = t.pieces[0]
    return scalar_tensor(t.dtype, t.shape, t.numel(), lambda n: p.src.read_bytes(p.src_off, n), where)


class ZeroView:
    """The planners' reader (``global_state``, ``param_states``) over a ZeRO checkpoint's tag folder."""

    def __init__(self, tag_folder: str):
        with metadata_errors(tag_folder):
            self.ck = discover(tag_folder)
        with metadata_errors(self.ck.folder):
            self.state, _ = read_zero_state(self.ck, inject_missing_state=True)
        self.folder = self.ck.folder
        self._by_param: Dict[str, Dict[str, object]] = self.state.params

    def _label(self, relpath: str) -> str:
        return f"{self.folder} (as universal {relpath})"

    def global_state(self, stage: int) -> GlobalState:
        return global_state_of(self.state.optimizer, self._label(OPTIMIZER_STATE), stage, self.ck.optim[0].file)

    def param_states(self, name: str, stage: int) -> ParamStates:
        folder = self._label(param_folder(name))
        objs = self._by_param.get(name)
        if objs is None:
            raise CheckpointFormatError(f"{self.folder}: the checkpoint has no state for parameter {name!r} of the "
                                        "model being loaded")
        out = ParamStates(folder, label=lambda key: self._label(param_state_path(name, key)))
        for key, obj in sorted(objs.items()):
            label = self._label(param_state_path(name, key))
            if key == STEP:
                out.step = _scalar(obj, label) if isinstance(obj, NewTensor) else obj
                continue
            tensor, meta = (obj.get("param"), {k: v for k, v in obj.items() if k != "param"}) \
                if isinstance(obj, dict) else (obj, {})
            if not isinstance(tensor, NewTensor) or tensor.dtype != "float32":
                raise CheckpointFormatError(f"{label}: planned as {tensor!r}; expected a float32 tensor")
            for k, typ in STATE_META_TYPES.items():
                if k in meta and type(meta[k]) is not typ:
                    raise CheckpointFormatError(f"{label}: marker {quoted(k)} is {quoted(meta[k])}, expected a "
                                                f"{typ.__name__}")
            out.states[key] = StateFile(VirtualStateFile(label, tensor), tensor, meta, isinstance(obj, dict))
        if not out.states:
            raise CheckpointFormatError(f"{folder}: no state planned for the parameter")
        return out


# Tag folders being loaded through a view, by real path: the hooks look their checkpoint folder up here.
_VIEWS: Dict[str, ZeroView] = {}


def register(tag_folder: str, view_factory) -> None:
    _VIEWS[os.path.realpath(tag_folder)] = view_factory


def unregister(tag_folder: str) -> None:
    _VIEWS.pop(os.path.realpath(tag_folder), None)


def used(checkpoint_folder: str) -> bool:
    """Whether a planner has built the view registered for this folder."""
    return isinstance(_VIEWS.get(os.path.realpath(checkpoint_folder)), ZeroView)


def registered(checkpoint_folder: str) -> bool:
    return os.path.realpath(checkpoint_folder) in _VIEWS


def lookup(checkpoint_folder: str):
    """The view registered for this folder (built on first use, inside the planners, so that a
    failure is agreed between ranks like any other), or None."""
    key = os.path.realpath(checkpoint_folder)
    entry = _VIEWS.get(key)
    if entry is not None and not isinstance(entry, ZeroView):
        entry = _VIEWS[key] = entry()
    return entry
