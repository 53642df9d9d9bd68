"""Tensor-parallel merge rules of ``universal_checkpoint_info`` (DeepSpeed 0.19.8 ``merge_tp_slices``).

Each tp rank's slice of a parameter is a byte-segment list (its dp fragments, concatenated) with the
rank's shape. The rules decide how slices form the full parameter; every rule except averaging is
expressed as block copies, so a row-parallel merge (concatenation along dim 1) becomes strided copies
straight into the output record. Precedence, pattern bookkeeping and error cases follow DeepSpeed:

1. ``tp_replicated_parameter_patterns``: all slices equal (else error), the first is kept;
2. ``parameter_to_average_patterns``: ``sum(slices) / tp`` (computed, the one non-copy);
3. ``parameter_with_2_sub_params_cat_dim_0``: halves of every slice, first halves then second halves;
4. ``parameter_with_sub_params``: per sub-parameter, each rank's width along ``partition_dim``;
5. otherwise concatenation along dim 1 (``parameter_with_row_parallelism_patterns``) or dim 0;
then ``vocabulary_parameter_patterns`` keep the first ``original_vocab_size`` rows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import CheckpointFormatError, UnsupportedCheckpointError
from .plan import Piece, Segments
from .safe_pickle import ITEMSIZE, Opaque
from .torch_pickle import NewTensor

PATTERN_KEYS = ("tp_replicated_parameter_patterns", "parameter_to_average_patterns",
                "parameter_with_row_parallelism_patterns", "vocabulary_parameter_patterns",
                "parameter_with_2_sub_params_cat_dim_0")
NUMPY_DTYPE = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


@dataclass
class Slice:
    """One tp rank's tensor of one state: dp fragments concatenated, in the rank's shape."""

    seg: Segments
    shape: Tuple[int, ...]
    dtype: str
    requires_grad: bool = False


class TpMergeError(CheckpointFormatError, AssertionError):
    """A merge rule's precondition failed (DeepSpeed asserts the same)."""


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def _subparam_shape(patterns, shape, partition_dim) -> Opaque:
    """A ``deepspeed.checkpoint.universal_checkpoint.SubparamShape`` written without importing DeepSpeed."""
    cls = type("SubparamShape", (Opaque, ), {"_global": ("deepspeed.checkpoint.universal_checkpoint",
                                                          "SubparamShape")})
    obj = cls.__new__(cls)
    obj.__setstate__({"patterns": patterns, "shape": shape, "partition_dim": partition_dim})
    return obj


def _field(sub, name):
    """A SubparamShape field, whether the metadata holds a dict or an inert DeepSpeed object."""
    if isinstance(sub, dict):
        return sub[name]
    return getattr(sub, name)


class TpRules:
    """The pattern lists of one checkpoint, with DeepSpeed's used-pattern bookkeeping."""

    def __init__(self, uc_info: dict, tp: int, where: str):
        self.info = uc_info or {}
        self.tp = tp
        self.where = where
        unsupported = self.info.get("autotp_unsupported_parameter_patterns") or {}
        if unsupported:
            details = ", ".join(f"{p}: {r}" for p, r in sorted(unsupported.items()))
            raise CheckpointFormatError(f"AutoTP universal checkpoint conversion is not supported for {details}.")
        if self.info.get("affine_map"):
            raise UnsupportedCheckpointError(f"{where}: universal_checkpoint_info['affine_map'] (DeepSpeed 0.19.8 "
                                             "affine layouts) is not supported by this version of pyckpt")
        self.lists = {k: list(self.info.get(k) or []) for k in PATTERN_KEYS}
        self.sub_params = list(self.info.get("parameter_with_sub_params") or [])
        self.shard_widths = self.info.get("sub_param_shard_widths") or {}
        self.uc_version = self.info.get("universal_checkpoint_version", 0.0)
        self.all_patterns = set(p for lst in self.lists.values() for p in lst)
        for sub in self.sub_params:
            self.all_patterns.update(_field(sub, "patterns"))
        self.used = set()

    def unused(self) -> List[str]:
        return sorted(self.all_patterns - self.used)

    def _match(self, key: str, name: str) -> Optional[str]:
        found = [p for p in self.lists[key] if re.match(p, name)]
        if len(found) > 1:
            raise TpMergeError(f"{self.where}: Got more than one matching patterns={found} for {name}")
        if found:
            self.used.add(found[0])
            return found[0]
        return None

    def _match_sub(self, name: str):
        for sub in self.sub_params:
            for p in _field(sub, "patterns"):
                if re.match(p, name):
                    self.used.add(p)
                    return sub, p
        return None, None

    # -- the merge ---------------------------------------------------------------------------------
    def merge(self, name: str, slices: List[Slice]) -> Optional[dict]:
        """The universal dict of one state, or None when there is nothing to write (DeepSpeed's skip)."""
        sub, sub_pattern = self._match_sub(name)
        out: dict = {}
        if self._match("tp_replicated_parameter_patterns", name):
            first = slices[0].seg.read() if len(slices) > 1 else None
            for t, s in enumerate(slices[1:], 1):
                if s.shape != slices[0].shape or s.seg.read() != first:
                    raise TpMergeError(f"{self.where}: tp-replicated parameter {name} differs between tp rank 0 and "
                                       f"tp rank {t}")
            tensor = _tensor(slices[0].dtype, slices[0].shape, slices[0].seg.pieces(), slices)
        elif self._match("parameter_to_average_patterns", name):
            tensor = _average(name, slices)
        elif self._match("parameter_with_2_sub_params_cat_dim_0", name):
            tensor = _two_sub_params(name, slices)
            out["cat_dim"] = 0
            out["param_n_sub_params"] = 2
        elif sub is not None:
            tensor, normalized = self._sub_params(name, sub, sub_pattern, slices)
            out["sub_param_shape"] = normalized
        else:
            if not slices:
                return None
            cat_dim = 1 if self._match("parameter_with_row_parallelism_patterns", name) else 0
            tensor = _concat(name, slices, cat_dim)
            out["cat_dim"] = cat_dim
        if self._match("vocabulary_parameter_patterns", name):
            tensor = _keep_rows(tensor, int(self.info["original_vocab_size"]), name)
            out["vocab_tensor"] = True
        out["param"] = tensor
        return out

    def _sub_params(self, name, sub, pattern, slices):
        pd = int(_field(sub, "partition_dim"))
        spec_shape = list(_field(sub, "shape"))
        dim_spec = spec_shape[pd]
        if self.uc_version >= 0.4:
            sizes = tuple(dim_spec)
            normalized = sub if isinstance(sub, Opaque) else _subparam_shape(_field(sub, "patterns"),
                                                                            tuple(spec_shape), pd)
            if pattern not in self.shard_widths:
                raise TpMergeError(f"{self.where}: Universal checkpoint version {self.uc_version} records no "
                                   f"sub_param_shard_widths for {name}, whose pattern {pattern} declares sub-parameters.")
            widths = [list(w) for w in self.shard_widths[pattern]]
        else:
            if isinstance(dim_spec, tuple):
                sizes = dim_spec
                normalized = sub if isinstance(sub, Opaque) else _subparam_shape(_field(sub, "patterns"),
                                                                                tuple(spec_shape), pd)
            else:
                k = int(dim_spec)
                if any(len(s.shape) <= pd for s in slices):
                    raise TpMergeError(f"{self.where}: Legacy sub-parameter metadata for {name} needs per-rank shapes")
                full = sum(s.shape[pd] for s in slices)
                if k <= 0 or full % k:
                    raise TpMergeError(f"{self.where}: Legacy sub-parameter count {k} for {name} does not evenly "
                                       f"divide its full partition dimension {full}.")
                sizes = (full // k, ) * k
                shape = list(spec_shape)
                shape[pd] = sizes
                normalized = _subparam_shape(_field(sub, "patterns"), tuple(shape), pd)
            uneven = [s for s in sizes if s % self.tp]
            if uneven:
                raise TpMergeError(f"{self.where}: Sub-parameter sizes {uneven} of {name} are not divisible by "
                                   f"tp_degree {self.tp}, and universal checkpoint version {self.uc_version} predates "
                                   "sub_param_shard_widths, so its uneven layout cannot be reconstructed.")
            widths = [[s // self.tp] * self.tp for s in sizes]
        if len(widths) != len(sizes):
            raise TpMergeError(f"{self.where}: Got {len(widths)} shard width entries for {len(sizes)} sub-parameters "
                               f"of {name}.")
        for size, w in zip(sizes, widths):
            if len(w) != self.tp or sum(w) != size:
                raise TpMergeError(f"{self.where}: Shard widths {w} for a sub-parameter of {name} do not split "
                                   f"{size} over {self.tp} tp ranks.")
        logical = [sum(d) if isinstance(d, tuple) else d for d in spec_shape]
        logical[pd] = sum(sizes)
        total = sum(_numel(s.shape) for s in slices)
        holes = [i for i, d in enumerate(logical) if d is not None and d < 0]
        if holes:
            known = math.prod(d for i, d in enumerate(logical) if i not in holes)
            if len(holes) != 1 or known <= 0 or total % known:
                raise TpMergeError(f"{self.where}: Sub-parameter shape {logical} of {name} cannot be resolved for a "
                                   f"parameter with {total} elements.")
            logical[holes[0]] = total // known
        dtype = slices[0].dtype
        isz = ITEMSIZE[dtype]
        outer = _numel(logical[:pd])
        inner = _numel(logical[pd + 1:])
        full_row = logical[pd] * inner * isz
        pieces = []
        dst_col = 0
        rank_cols = [sum(w[t] for w in widths) for t in range(self.tp)]
        for t, s in enumerate(slices):
            if _numel(s.shape) != outer * rank_cols[t] * inner:
                raise TpMergeError(f"{self.where}: tp rank {t} of {name} holds {_numel(s.shape)} elements, but its "
                                   f"recorded shard widths describe {outer * rank_cols[t] * inner}.")
        src_col = [0] * self.tp
        for w in widths:
            for t, s in enumerate(slices):
                width = w[t]
                pieces += _blocks(s.seg, outer, rank_cols[t] * inner * isz, src_col[t] * inner * isz, full_row,
                                  dst_col * inner * isz, width * inner * isz)
                src_col[t] += width
                dst_col += width
        return _tensor(dtype, tuple(logical), pieces, slices), normalized


def _tensor(dtype, shape, pieces, slices) -> NewTensor:
    return NewTensor(dtype, tuple(int(d) for d in shape), pieces, any(s.requires_grad for s in slices))


def _blocks(seg: Segments, outer: int, src_row: int, src_off: int, dst_row: int, dst_off: int,
            block: int) -> List[Piece]:
    """Copy ``block`` bytes at ``src_off`` of each of ``outer`` source rows to ``dst_off`` of each
    destination row; contiguous runs become one strided op."""
    if block == 0 or outer == 0:
        return []
    pieces: List[Piece] = []
    if src_row == block:  # whole source rows: strided ops over each contiguous run of rows
        pos = 0
        for sf, off, n in seg.parts:
            first, last = pos // block, (pos + n - 1) // block
            r = first
            while r <= last:
                lo, hi = max(pos, r * block), min(pos + n, (r + 1) * block)
                if lo == r * block and hi == (r + 1) * block:
                    run_end = r
                    while run_end + 1 <= last and (run_end + 2) * block <= pos + n:
                        run_end += 1
                    rows = run_end - r + 1
                    pieces.append(Piece(sf, off + (lo - pos), block, r * dst_row + dst_off, 0, rows,
                                        dst_row if rows > 1 else 0))
                    r = run_end + 1
                else:
                    pieces.append(Piece(sf, off + (lo - pos), hi - lo, r * dst_row + dst_off + (lo - r * block)))
                    r += 1
            pos += n
        return pieces
    for r in range(outer):
        for p in seg.slice(r * src_row + src_off, block).pieces(r * dst_row + dst_off):
            pieces.append(p)
    return pieces


def _concat(name, slices: List[Slice], cat_dim: int) -> NewTensor:
    shapes = [s.shape for s in slices]
    base = list(shapes[0])
    if len(base) <= cat_dim:
        raise TpMergeError(f"cannot concatenate the tp slices of {name} (shapes {shapes}) along dim {cat_dim}")
    for sh in shapes[1:]:
        if len(sh) != len(base) or any(a != b for i, (a, b) in enumerate(zip(sh, base)) if i != cat_dim):
            raise TpMergeError(f"tp slices of {name} have shapes {shapes}, which do not concatenate along dim "
                               f"{cat_dim}")
    full = list(base)
    full[cat_dim] = sum(sh[cat_dim] for sh in shapes)
    isz = ITEMSIZE[slices[0].dtype]
    outer = _numel(full[:cat_dim])
    inner = _numel(full[cat_dim + 1:]) * isz
    pieces, col = [], 0
    for s in slices:
        width = s.shape[cat_dim] * inner
        pieces += _blocks(s.seg, outer, width, 0, full[cat_dim] * inner, col, width)
        col += width
    return _tensor(slices[0].dtype, full, pieces, slices)


def _two_sub_params(name, slices: List[Slice]) -> NewTensor:
    # torch.chunk(s, 2, dim=0): the first chunk has ceil(rows/2) rows.
    isz = ITEMSIZE[slices[0].dtype]
    firsts, seconds = [], []
    rows_total = 0
    for s in slices:
        rows = s.shape[0]
        row_bytes = _numel(s.shape[1:]) * isz
        half = -(-rows // 2)
        firsts.append(s.seg.slice(0, half * row_bytes))
        seconds.append(s.seg.slice(half * row_bytes, (rows - half) * row_bytes))
        rows_total += rows
    merged = Segments()
    for seg in firsts + seconds:
        merged.extend(seg)
    shape = (rows_total, ) + tuple(slices[0].shape[1:])
    return _tensor(slices[0].dtype, shape, merged.pieces(), slices)


def _average(name, slices: List[Slice]) -> NewTensor:
    dtype = slices[0].dtype
    np_dtype = NUMPY_DTYPE.get(dtype)
    if np_dtype is None:
        raise UnsupportedCheckpointError(f"averaging tp slices of {name} in {dtype} is not supported")
    # Python's sum() starts from int 0, so -0.0 becomes +0.0 exactly as in DeepSpeed's sum(slices).
    acc = np.zeros(_numel(slices[0].shape), dtype=np_dtype)
    for s in slices:
        acc = acc + np.frombuffer(s.seg.read(), dtype=np_dtype)
    result = (acc / np_dtype(len(slices))).astype(np_dtype)
    t = _tensor(dtype, slices[0].shape, [], slices)
    t.data = result.tobytes()
    return t


def _keep_rows(t: NewTensor, rows: int, name: str) -> NewTensor:
    if not t.shape or rows > t.shape[0]:
        raise TpMergeError(f"original_vocab_size {rows} exceeds the {t.shape[0] if t.shape else 0} rows of {name}")
    row_bytes = _numel(t.shape[1:]) * ITEMSIZE[t.dtype]
    limit = rows * row_bytes
    shape = (rows, ) + tuple(t.shape[1:])
    if t.data is not None:
        out = NewTensor(t.dtype, shape, [], t.requires_grad)
        out.data = t.data[:limit]
        return out
    kept = []
    for p in t.pieces:
        if p.rows > 1:
            fit = min(p.rows, max(0, (limit - p.dst_off + p.stride - p.nbytes) // p.stride + 1)
                      if p.dst_off + p.nbytes <= limit else 0)
            if fit:
                kept.append(Piece(p.src, p.src_off, p.nbytes, p.dst_off, p.kind, fit, p.stride if fit > 1 else 0))
        elif p.dst_off < limit:
            n = min(p.nbytes, limit - p.dst_off)
            kept.append(Piece(p.src, p.src_off, n, p.dst_off, p.kind))
    return NewTensor(t.dtype, shape, kept, t.requires_grad)
