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

One module for all of them, longer than most: the rules share that precedence and the bookkeeping of
which patterns matched (DeepSpeed reports a pattern that matched nothing), which one reading order keeps
true; split by rule, the precedence would be spelled in each piece.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple


from ..errors import CheckpointFormatError, TpMergeError, UnsupportedCheckpointError, quoted
from ..tensors import ITEMSIZE, NewTensor, numel
from ..formats.pickle_read import Opaque
from ..planning.plan import Piece, Segments, row_pieces
from .schema import Schema

PATTERN_KEYS = ("tp_replicated_parameter_patterns", "parameter_to_average_patterns",
                "parameter_with_row_parallelism_patterns", "vocabulary_parameter_patterns",
                "parameter_with_2_sub_params_cat_dim_0")
NUMPY_DTYPES = ("float32", "float64", "float16")


@dataclass
class Slice:
    """One tp rank's tensor of one state: dp fragments concatenated, in the rank's shape."""

    seg: Segments
    shape: Tuple[int, ...]
    dtype: str
    requires_grad: bool = False


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

    def __init__(self, uc_info: dict, tp: int, where: str, source: Optional[str] = None):
        self.info = uc_info or {}
        self.tp = tp
        self.where = where
        # The model-states file the rules come from: what a refusal of the rules themselves names.
        self.source = source or where
        _check_rules(self.info, self.source)
        self._affine_checked = set()
        unsupported = self.info.get("autotp_unsupported_parameter_patterns") or {}
        if unsupported:
            details = ", ".join(f"{p}: {r}" for p, r in sorted(unsupported.items()))
            raise CheckpointFormatError(f"AutoTP universal checkpoint conversion is not supported for {details}.")
        affine = self.info.get("affine_map") or {}
        version = affine.get("version", 1)
        if version > 1:
            raise UnsupportedCheckpointError(f"{where}: Checkpoint records affine map format version {version}, but "
                                             "pyckpt understands up to 1. Reading it could misinterpret fields added "
                                             "since.")
        self.affine = dict(affine.get("params") or {})
        self.lists = {k: list(self.info.get(k) or []) for k in PATTERN_KEYS}
        self.sub_params = list(self.info.get("parameter_with_sub_params") or [])
        self.shard_widths = self.info.get("sub_param_shard_widths") or {}
        self.uc_version = self.info.get("universal_checkpoint_version", 0.0)
        self.all_patterns = set(p for lst in self.lists.values() for p in lst)
        for sub in self.sub_params:
            self.all_patterns.update(_field(sub, "patterns"))
        self.used = set()

    def _match_affine(self, name: str):
        found = [p for p in self.affine if re.match(p, name)]
        if len(found) > 1:
            raise TpMergeError(f"{self.where}: Got more than one matching affine map patterns={quoted(found)} for "
                               f"{name}")
        if not found:
            return None
        if found[0] not in self._affine_checked:
            amap = self.affine[found[0]]
            _check_affine(name, amap, self.source)
            _check_tiling(name, amap["logical_shape"], amap["ranks"], self.source)
            self._affine_checked.add(found[0])
        return self.affine[found[0]]

    def empty_shard_shape(self, name: str, rank: int) -> Optional[tuple]:
        """The shape of ``rank``'s shard of ``name`` when the affine map records it as empty, else None.

        AutoTP with more TP ranks than KV heads leaves some ranks no heads: no rows of q/k/v, no
        columns of o_proj. ZeRO keeps no state for a zero-element parameter, so those ranks list no
        shape for it in param_shapes; the affine map is the only record that the shard is empty
        rather than lost."""
        amap = self._match_affine(name)
        if amap is None:
            return None
        ranks = {int(r): v for r, v in amap["ranks"].items()}
        entry = ranks.get(rank)
        if entry is None or any(numel(pc["shape"]) for pc in entry["pieces"]):
            return None
        shape = tuple(int(d) for d in entry["shard_shape"])
        return shape if numel(shape) == 0 else None

    def unused(self) -> List[str]:
        return sorted(self.all_patterns - self.used)

    def check_unused(self, strict: bool) -> None:
        """After the merge: a pattern no parameter matched is an error (DeepSpeed's ``--no_strict``
        turns it into a warning), since a misspelt rule would silently merge by the default."""
        unused = self.unused()
        if not unused:
            return
        if strict:
            raise TpMergeError(f"{self.where}: Unused patterns={quoted(unused)} while merging tp slices (no parameter "
                               "matches them; pass --no_strict to only warn)")
        warnings.warn(f"Unused patterns={quoted(unused)} while merging tp slices", stacklevel=3)

    def _match(self, key: str, name: str) -> Optional[str]:
        found = [p for p in self.lists[key] if re.match(p, name)]
        if len(found) > 1:
            raise TpMergeError(f"{self.where}: Got more than one matching patterns={quoted(found)} for {name}")
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
    def merge(self, name: str, slices: List[Slice], state: str = "fp32") -> Optional[dict]:
        """The universal dict of one state, or None when there is nothing to write (DeepSpeed's skip)."""
        affine = self._match_affine(name)
        if affine is not None:
            # The map is preferred; the category patterns it supersedes count as used, not unused.
            for key in PATTERN_KEYS:
                self._match(key, name)
            self._match_sub(name)
        sub, sub_pattern = self._match_sub(name)
        out: dict = {}
        if affine is not None:
            tensor = _affine_rebuild(name, affine, slices, state, self.where)
        elif self._match("tp_replicated_parameter_patterns", name):
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
        total = sum(numel(s.shape) for s in slices)
        holes = [i for i, d in enumerate(logical) if d is not None and d < 0]
        if holes:
            known = math.prod(d for i, d in enumerate(logical) if i not in holes)
            if len(holes) != 1 or known <= 0 or total % known:
                raise TpMergeError(f"{self.where}: Sub-parameter shape {logical} of {name} cannot be resolved for a "
                                   f"parameter with {total} elements.")
            logical[holes[0]] = total // known
        dtype = slices[0].dtype
        isz = ITEMSIZE[dtype]
        outer = numel(logical[:pd])
        inner = numel(logical[pd + 1:])
        full_row = logical[pd] * inner * isz
        pieces = []
        dst_col = 0
        rank_cols = [sum(w[t] for w in widths) for t in range(self.tp)]
        for t, s in enumerate(slices):
            if numel(s.shape) != outer * rank_cols[t] * inner:
                raise TpMergeError(f"{self.where}: tp rank {t} of {name} holds {numel(s.shape)} elements, but its "
                                   f"recorded shard widths describe {outer * rank_cols[t] * inner}.")
        src_col = [0] * self.tp
        for w in widths:
            for t, s in enumerate(slices):
                width = w[t]
                pieces += row_pieces(s.seg, outer, rank_cols[t] * inner * isz, src_col[t] * inner * isz, full_row,
                                  dst_col * inner * isz, width * inner * isz)
                src_col[t] += width
                dst_col += width
        return _tensor(dtype, tuple(logical), pieces, slices), normalized


def _tensor(dtype, shape, pieces, slices) -> NewTensor:
    return NewTensor(dtype, tuple(int(d) for d in shape), pieces, any(s.requires_grad for s in slices))


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
    outer = numel(full[:cat_dim])
    inner = numel(full[cat_dim + 1:]) * isz
    pieces, col = [], 0
    for s in slices:
        width = s.shape[cat_dim] * inner
        pieces += row_pieces(s.seg, outer, width, 0, full[cat_dim] * inner, col, width)
        col += width
    return _tensor(slices[0].dtype, full, pieces, slices)


def _two_sub_params(name, slices: List[Slice]) -> NewTensor:
    # torch.chunk(s, 2, dim=0): the first chunk has ceil(rows/2) rows.
    isz = ITEMSIZE[slices[0].dtype]
    firsts, seconds = [], []
    rows_total = 0
    for s in slices:
        rows = s.shape[0]
        row_bytes = numel(s.shape[1:]) * isz
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
    import numpy as np  # only where slices are summed or compared; not at start-up
    np_dtype = np.dtype(dtype).type if dtype in NUMPY_DTYPES else None
    if np_dtype is None:
        raise UnsupportedCheckpointError(f"averaging tp slices of {name} in {dtype} is not supported")
    # Python's sum() starts from int 0, so -0.0 becomes +0.0 exactly as in DeepSpeed's sum(slices).
    acc = np.zeros(numel(slices[0].shape), dtype=np_dtype)
    for s in slices:
        acc = acc + np.frombuffer(s.seg.read(), dtype=np_dtype)
    result = (acc / np_dtype(len(slices))).astype(np_dtype)
    t = _tensor(dtype, slices[0].shape, [], slices)
    t.data = result.tobytes()
    return t


def _keep_rows(t: NewTensor, rows: int, name: str) -> NewTensor:
    if not t.shape or rows > t.shape[0]:
        raise TpMergeError(f"original_vocab_size {rows} exceeds the {t.shape[0] if t.shape else 0} rows of {name}")
    row_bytes = numel(t.shape[1:]) * ITEMSIZE[t.dtype]
    limit = rows * row_bytes
    shape = (rows, ) + tuple(t.shape[1:])
    if t.data is not None:
        out = NewTensor(t.dtype, shape, [], t.requires_grad)
        out.data = t.data[:limit]
        return out
    kept = []
    for p in t.pieces:
        if p.rows > 1:
            # Row i spans [dst_off + i*stride, +nbytes): it is kept when that ends by the limit.
            fit = min(p.rows, (limit - p.dst_off - p.nbytes) // p.stride + 1) if p.dst_off + p.nbytes <= limit else 0
            if fit:
                kept.append(Piece(p.src, p.src_off, p.nbytes, p.dst_off, p.kind, fit, p.stride if fit > 1 else 0))
        elif p.dst_off < limit:
            n = min(p.nbytes, limit - p.dst_off)
            kept.append(Piece(p.src, p.src_off, n, p.dst_off, p.kind))
    return NewTensor(t.dtype, shape, kept, t.requires_grad)


# How a shard's scale applies per state (DeepSpeed's SCALE_POWER_BY_STATE): a parameter stored as
# full*s has gradients, hence Adam moments, scaled by 1/s and 1/s^2.
SCALE_POWER = {"fp32": 1, "exp_avg": -1, "exp_avg_sq": -2}


def _affine_rebuild(name, amap, slices: List[Slice], state: str, where: str) -> NewTensor:
    """DeepSpeed's ``ParamAffineMap.rebuild`` as copies: each piece is an as_strided block of the full
    tensor (``source``) held at an as_strided block of a rank's shard (``dest``)."""
    logical = tuple(int(d) for d in amap["logical_shape"])
    ranks = {int(r): v for r, v in amap["ranks"].items()}
    power = SCALE_POWER[state]
    scaled = any(float(pc.get("scale", 1.0)) != 1.0 for v in ranks.values() for pc in v["pieces"])
    if scaled and power != 1:
        raise UnsupportedCheckpointError(f"{where}: Converting an optimizer state through a scaled affine piece is "
                                         f"not supported ({name}/{state}), as in DeepSpeed.")
    for r, v in ranks.items():
        held = sum(numel(pc["shape"]) for pc in v["pieces"])
        if held != numel(v["shard_shape"]):
            raise TpMergeError(f"{where}: affine map of {name}: rank {r} holds a shard of {numel(v['shard_shape'])} "
                               f"elements but its pieces account for {held}.")
        if v["pieces"] and (r >= len(slices) or numel(slices[r].shape) != numel(v["shard_shape"])):
            got = numel(slices[r].shape) if r < len(slices) else None
            raise TpMergeError(f"{where}: Rank {r} supplied a shard of {got} elements for {name}, but the affine map "
                               f"describes {numel(v['shard_shape'])}.")
    dtype = next(s.dtype for s in slices if s.seg.nbytes) if any(s.seg.nbytes for s in slices) else slices[0].dtype
    isz = ITEMSIZE[dtype]
    if scaled:
        return _affine_computed(name, logical, ranks, slices, dtype, power)
    pieces: List[Piece] = []
    written = {}
    for r, v in ranks.items():
        for pc in v["pieces"]:
            shape = [int(d) for d in pc["shape"]]
            (s_off, s_str), (d_off, d_str) = pc["source"], pc["dest"]
            runs = list(_runs(shape, int(s_off), [int(x) for x in s_str], int(d_off), [int(x) for x in d_str]))
            if len(pc["locations"]) > 1 and int(s_off) in written:
                first_r, first_runs = written[int(s_off)]
                a = b"".join(slices[first_r].seg.slice(so * isz, n * isz).read() for _, so, n in first_runs)
                b = b"".join(slices[r].seg.slice(so * isz, n * isz).read() for _, so, n in runs)
                if a != b:
                    raise TpMergeError(f"{where}: Ranks {sorted(pc['locations'])} hold different data for the same "
                                       f"block of replicated parameter {name}, starting at offset {s_off}.")
                continue
            if len(pc["locations"]) > 1:
                written[int(s_off)] = (r, runs)
            pieces += _runs_to_pieces(slices[r].seg, runs, isz)
    return _tensor(dtype, logical, pieces, slices)


def _runs_to_pieces(seg: Segments, runs, isz: int) -> List[Piece]:
    """Copies for a list of runs; a column block (equal runs, back to back in the shard, evenly
    spaced in the full tensor) becomes strided copies instead of one op per row."""
    if len(runs) > 2:
        (f0, s0, n), (f1, _, _) = runs[0], runs[1]
        fstride = f1 - f0
        regular = fstride > n and all(r[2] == n and r[1] == s0 + i * n and r[0] == f0 + i * fstride
                                      for i, r in enumerate(runs))
        if regular:
            return row_pieces(seg.slice(s0 * isz, len(runs) * n * isz), len(runs), n * isz, 0, fstride * isz,
                           f0 * isz, n * isz)
    out: List[Piece] = []
    for full_off, shard_off, n in runs:
        out += seg.slice(shard_off * isz, n * isz).pieces(full_off * isz)
    return out


def _runs(shape, full_off, full_strides, shard_off, shard_strides):
    """(full offset, shard offset, length) of the element runs contiguous on both sides."""
    dims = [(n, a, b) for n, a, b in zip(shape, full_strides, shard_strides) if n != 1]
    if any(n == 0 for n, _, _ in dims):
        return
    merged: List[list] = []
    for n, a, b in dims:
        if merged and merged[-1][1] == n * a and merged[-1][2] == n * b:
            merged[-1] = [merged[-1][0] * n, a, b]
        else:
            merged.append([n, a, b])
    if merged and merged[-1][1] == 1 and merged[-1][2] == 1:
        run = merged.pop()[0]
    else:
        run = 1
    outer = merged
    index = [0] * len(outer)
    while True:
        yield (full_off + sum(i * d[1] for i, d in zip(index, outer)),
               shard_off + sum(i * d[2] for i, d in zip(index, outer)), run)
        axis = len(outer) - 1
        while axis >= 0:
            index[axis] += 1
            if index[axis] < outer[axis][0]:
                break
            index[axis] = 0
            axis -= 1
        if axis < 0:
            return


def _affine_computed(name, logical, ranks, slices, dtype, power) -> NewTensor:
    import numpy as np  # only where slices are summed or compared; not at start-up
    np_dtype = np.dtype(dtype).type if dtype in NUMPY_DTYPES else None
    if np_dtype is None:
        raise UnsupportedCheckpointError(f"scaled affine pieces of {name} in {dtype} are not supported")
    full = np.empty(numel(logical), dtype=np_dtype)
    written = set()
    for r, v in ranks.items():
        shard = np.frombuffer(slices[r].seg.read(), dtype=np_dtype)
        for pc in v["pieces"]:
            shape = [int(d) for d in pc["shape"]]
            (s_off, s_str), (d_off, d_str) = pc["source"], pc["dest"]
            factor = float(pc.get("scale", 1.0)) ** power
            for full_off, shard_off, n in _runs(shape, int(s_off), list(s_str), int(d_off), list(d_str)):
                block = shard[shard_off:shard_off + n]
                block = block if factor == 1 else block / np_dtype(factor)
                if len(pc["locations"]) > 1 and (int(s_off), full_off) in written:
                    if not np.array_equal(full[full_off:full_off + n], block):
                        raise TpMergeError(f"Ranks {sorted(pc['locations'])} hold different data for replicated "
                                           f"parameter {name}")
                    continue
                full[full_off:full_off + n] = block
                written.add((int(s_off), full_off))
    t = _tensor(dtype, logical, [], slices)
    t.data = full.tobytes()
    return t


# -- checks of the metadata the rules come from --------------------------------------------------------
# universal_checkpoint_info is read from a pickle like any other input: the planner below indexes and
# multiplies its fields freely, so every one is checked first, with the file named.

def _check_rules(info, path: str) -> None:
    s = Schema(path)
    s.dict(info, "universal_checkpoint_info")
    for key in PATTERN_KEYS:
        for i, p in enumerate(s.list(info.get(key), f"universal_checkpoint_info[{quoted(key)}]", optional=True) or ()):
            _check_pattern(s, p, f"universal_checkpoint_info[{quoted(key)}][{i}]")
    affine = s.dict(info.get("affine_map"), "universal_checkpoint_info['affine_map']", optional=True) or {}
    version = affine.get("version", 1)
    if not isinstance(version, (int, float)) or isinstance(version, bool) or version != version:
        s.fail("universal_checkpoint_info['affine_map']['version']", f"must be a number, got {type(version).__name__}")
    params = s.dict(affine.get("params"), "universal_checkpoint_info['affine_map']['params']", optional=True) or {}
    for p in params:
        _check_pattern(s, p, "universal_checkpoint_info['affine_map']['params'] key")
    for i, sub in enumerate(s.list(info.get("parameter_with_sub_params"),
                                   "universal_checkpoint_info['parameter_with_sub_params']", optional=True) or ()):
        where = f"universal_checkpoint_info['parameter_with_sub_params'][{i}]"
        try:
            patterns = _field(sub, "patterns")
        except (KeyError, AttributeError, TypeError):
            s.fail(where, "has no patterns")
        for j, p in enumerate(s.list(patterns, f"{where}.patterns")):
            _check_pattern(s, p, f"{where}.patterns[{j}]")


def _check_pattern(s: Schema, pattern, where: str) -> None:
    if not isinstance(pattern, str):
        s.fail(where, f"must be a regular expression (a string), got {type(pattern).__name__}")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        s.fail(where, f"is not a valid regular expression ({exc})")


def _check_affine(name: str, amap, path: str) -> None:
    """Types and bounds of one affine map entry: every piece's source view inside the logical tensor
    and its dest view inside its rank's shard (the tiling is checked where the pieces are used)."""
    s = Schema(path)
    w = f"affine map of {name}:"
    s.dict(amap, w)
    logical = numel(s.shape(amap.get("logical_shape"), f"{w} logical_shape"))
    for r, v in s.dict(amap.get("ranks"), f"{w} ranks").items():
        s.int(r, f"{w} rank key")
        rw = f"{w} ranks[{r}]"
        s.dict(v, rw)
        shard = numel(s.shape(v.get("shard_shape"), f"{rw}['shard_shape']"))
        for i, pc in enumerate(s.list(v.get("pieces"), f"{rw}['pieces']")):
            pw = f"{rw}['pieces'][{i}]"
            s.dict(pc, pw)
            shape = s.shape(pc.get("shape"), f"{pw}['shape']")
            for key, bound, what in (("source", logical, "logical tensor"), ("dest", shard, "rank's shard")):
                view = s.list(pc.get(key), f"{pw}['{key}']")
                if len(view) != 2:
                    s.fail(f"{pw}['{key}']", f"must be (offset, strides), got {len(view)} items")
                off = s.int(view[0], f"{pw}['{key}'] offset")
                strides = s.shape(view[1], f"{pw}['{key}'] strides")
                if len(strides) != len(shape):
                    s.fail(f"{pw}['{key}']", f"has {len(strides)} strides for a {len(shape)}-dimensional piece")
                if numel(shape):
                    last = off + sum((n - 1) * st for n, st in zip(shape, strides))
                    if last >= bound:
                        s.fail(f"{pw}['{key}']", f"reaches element {last}, past the {bound} elements of the {what}")
            for j, loc in enumerate(s.list(pc.get("locations"), f"{pw}['locations']")):
                s.int(loc, f"{pw}['locations'][{j}]")
            scale = pc.get("scale", 1.0)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or not scale:
                s.fail(f"{pw}['scale']", f"must be a finite non-zero number, got {quoted(scale)}")


def _check_tiling(name: str, logical, ranks, where: str) -> None:
    """The pieces must write every element of the logical tensor exactly once (a replicated piece,
    listed by each rank holding it, counts once): a gap would publish bytes nobody wrote, an overlap
    a tensor that depends on the order of the copies."""
    runs = []
    seen = set()
    for v in ranks.values():
        for pc in v["pieces"]:
            shape = [int(d) for d in pc["shape"]]
            (s_off, s_str), (d_off, d_str) = pc["source"], pc["dest"]
            if len(pc["locations"]) > 1:
                if int(s_off) in seen:
                    continue
                seen.add(int(s_off))
            runs += [(f, n) for f, _, n in _runs(shape, int(s_off), [int(x) for x in s_str], int(d_off),
                                                 [int(x) for x in d_str])]
    runs.sort()
    at = 0
    for f, n in runs:
        if f != at:
            problem = f"overlap at element {f}" if f < at else f"no piece writes elements [{at}, {f})"
            raise TpMergeError(f"{where}: affine map of {name}: pieces do not tile the logical tensor: {problem}")
        at = f + n
    if at != numel(logical):
        raise TpMergeError(f"{where}: affine map of {name}: pieces cover {at} of the {numel(logical)} elements of "
                           "the logical tensor")
