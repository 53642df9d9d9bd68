"""Which elements a rank loads when the live parameter carries AutoTP or AutoEP restore metadata.

DeepSpeed 0.19.8 attaches to parameters it shards itself a description of the shard
(``ds_autotp_universal_checkpoint_meta``, ``ds_autoep_uc_meta``), and its universal loader cuts the
rank's piece of each state file by it (``deepspeed/checkpoint/universal_checkpoint.py``:
``_resolve_autotp_partition``, ``_resolve_autoep_partition``): an affine map (blocks of the full
tensor, each with its place in the shard), or, without a usable map, a replicated tensor, uneven
``partition_sizes``, sub-parameters with per-rank ``sub_param_shard_widths``, or an even split. Here
the same cuts are runs of the file tensor's elements, in shard order.

The metadata is the running engine's own, not the checkpoint's. DeepSpeed's checks of it keep their
exception types and messages, so a load through pyckpt fails where and as DeepSpeed's would. A map
piece held at a scale other than 1 is not a copy; :class:`NotACopy` hands such a parameter back.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..errors import quoted
from ..tensors import numel
from ..zero.tp_merge import SCALE_POWER
from .slice import Run, append_run, remap, select_along


class NotACopy(Exception):
    """The rank's piece is not a copy of file elements (a scaled map piece, unset shard elements)."""


def _rank_entry(ranks, rank: int):
    if not isinstance(ranks, dict):
        return None
    for key, value in ranks.items():
        try:
            if int(key) == rank:
                return value
        except (TypeError, ValueError):
            continue
    return None


def _ints(values, what: str) -> Tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
        raise NotACopy(f"affine map {what} is {quoted(values)}, not a list of integers")
    return tuple(values)


def affine_runs(serialized: dict, rank: int) -> Optional[List[Run]]:
    """``ParamAffineMap.extract(full, rank)`` (``deepspeed/checkpoint/affine.py``) as runs of the full
    tensor's elements in shard order; None when the map has no entry for ``rank``."""
    entry = _rank_entry(serialized.get("ranks"), rank)
    if entry is None:
        return None
    shard = numel(_ints(entry.get("shard_shape"), "shard_shape"))
    rows = []  # (shard element, full element, count)
    for piece in entry.get("pieces") or ():
        if float(piece.get("scale", 1.0)) != 1.0:
            raise NotACopy(f"an affine map piece is held at scale {piece['scale']}")
        shape = _ints(piece.get("shape"), "piece shape")
        s_off, s_strides = piece.get("source")
        d_off, d_strides = piece.get("dest")
        s_strides, d_strides = _ints(s_strides, "source strides"), _ints(d_strides, "dest strides")
        if len(s_strides) != len(shape) or len(d_strides) != len(shape) or numel(shape) == 0:
            continue
        # the trailing dimensions both sides hold contiguously are one run per outer index
        k, inner = len(shape), 1
        while k > 0 and (shape[k - 1] == 1 or (s_strides[k - 1] == inner and d_strides[k - 1] == inner)):
            inner *= shape[k - 1]
            k -= 1
        outer = shape[:k]
        for flat in range(numel(outer)):
            s, d, rest = int(s_off), int(d_off), flat
            for dim in reversed(range(k)):
                i = rest % outer[dim]
                rest //= outer[dim]
                s += i * s_strides[dim]
                d += i * d_strides[dim]
            rows.append((d, s, inner))
    rows.sort()
    runs: List[Run] = []
    at = 0
    for d, s, n in rows:
        if d != at:
            raise NotACopy(f"the affine map's pieces {'overlap' if d < at else 'leave shard elements unset'} "
                           f"at element {min(d, at)}")
        append_run(runs, s, n)
        at += n
    if at != shard:
        raise NotACopy(f"the affine map's pieces fill {at} of the shard's {shard} elements")
    return runs


def _scaled_anywhere(serialized: dict) -> bool:
    ranks = serialized.get("ranks")
    return isinstance(ranks, dict) and any(
        float(p.get("scale", 1.0)) != 1.0 for r in ranks.values() if isinstance(r, dict) for p in r.get("pieces") or ())


def autotp_runs(meta: dict, full_shape: Sequence[int], base: List[Run], tp_rank: int, tp_size: int,
                state_key: str) -> Optional[List[Run]]:
    """``_resolve_autotp_partition``: the rank's flattened shard of the (EP-sliced) file tensor whose
    elements ``base`` lists, or None where DeepSpeed falls back to its generic slicing."""
    if not meta:
        return None
    conversion = meta.get("conversion") or {}
    reason = conversion.get("unsupported_reason")
    if reason:
        raise RuntimeError(f"Cannot restore a universal checkpoint into this AutoTP parameter: {reason}")
    full = numel(full_shape)
    affine = conversion.get("affine_map")
    if affine is not None:
        logical = numel(_ints(affine.get("logical_shape"), "logical_shape"))
        if _rank_entry(affine.get("ranks"), tp_rank) is not None and logical == full:
            # a piece's scale applies to each stored state by its power (deepspeed/checkpoint/affine.py)
            if SCALE_POWER.get(state_key, 1) != 1 and _scaled_anywhere(affine):
                raise NotImplementedError(
                    'Converting an optimizer state through a scaled piece is not supported: the moments transform '
                    'correctly, but the optimizer group hyperparameters would still be in the source coordinate, '
                    'so a resumed run would diverge.')
            return remap(affine_runs(affine, tp_rank), base)
    partition_dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        assert partition_dim is None
        return list(base)
    logical_shape = meta.get("logical_shape")
    if partition_dim is None or logical_shape is None:
        return None
    view = tuple(logical_shape)
    if numel(view) != full:
        raise RuntimeError(f"shape '{list(view)}' is invalid for input of size {full}")
    dim = partition_dim
    sizes = meta.get("sub_param_sizes")
    sub_shape = meta.get("sub_param_shape")
    if sizes is None and sub_shape is not None:
        if hasattr(sub_shape, "shape") and hasattr(sub_shape, "partition_dim"):
            spec, dim = sub_shape.shape, sub_shape.partition_dim
        else:
            spec = sub_shape
        sizes = spec[dim]
    if sizes is not None:
        if not isinstance(sizes, (tuple, list)):
            sizes = (sizes, )
        ranges = _sub_param_ranges(view[dim], sizes, meta.get("sub_param_shard_widths"), tp_rank, tp_size,
                                   meta.get("universal_checkpoint_version", 0.0))
    elif meta.get("partition_sizes") is not None:
        widths = meta["partition_sizes"]
        start = sum(widths[:tp_rank])
        ranges = [(start, start + widths[tp_rank])]
    else:
        length = view[dim]
        assert length % tp_size == 0, (
            f"Dimension {dim} of size {length} is not divisible by tp_world_size "
            f"{tp_size}, and this checkpoint records no partition_sizes, so its uneven layout cannot "
            "be reconstructed.")
        width = length // tp_size
        ranges = [(tp_rank * width, (tp_rank + 1) * width)]
    return remap(select_along(view, dim, ranges), base)


def _sub_param_ranges(length: int, sizes, widths, tp_rank: int, tp_size: int, version) -> List[Tuple[int, int]]:
    """``_narrow_sub_params``: this rank's range of each sub-parameter along the partition dimension."""
    assert sum(sizes) == length, (
        f"Sub-parameter sizes {list(sizes)} sum to {sum(sizes)}, but dimension of the parameter is {length}. "
        "The metadata describes a different parameter.")
    if version < 0.4:
        uneven = [size for size in sizes if size % tp_size != 0]
        assert not uneven, (
            f"Sub-parameter sizes {uneven} are not divisible by tp_world_size {tp_size}, and this "
            "metadata records no sub_param_shard_widths, so its uneven layout cannot be reconstructed.")
        widths = [[size // tp_size] * tp_size for size in sizes]
    assert len(widths) == len(sizes), (f"Got {len(widths)} shard width entries for {len(sizes)} sub-parameters.")
    ranges, offset = [], 0
    for size, per_rank in zip(sizes, widths):
        assert len(per_rank) == tp_size, (
            f"Sub-parameter of size {size} has {len(per_rank)} shard widths, expected one per tp rank "
            f"({tp_size}).")
        assert sum(per_rank) == size, (f"Sub-parameter shard widths {list(per_rank)} sum to {sum(per_rank)}, "
                                       f"expected {size}.")
        start = offset + sum(per_rank[:tp_rank])
        ranges.append((start, start + per_rank[tp_rank]))
        offset += size
    return ranges


def autoep_runs(affine: dict, file_shape: Sequence[int], ep_rank: int) -> Tuple[List[Run], Tuple[int, ...]]:
    """The EP rank's packed local experts of the ``[num_experts, ...]`` file tensor, by the target's
    affine map (already checked by DeepSpeed's own validation of the live metadata): (runs, shape)."""
    runs = affine_runs(affine, ep_rank)
    if runs is None:
        raise ValueError(f'EP rank {ep_rank} is not present in the target affine map.')
    shard_shape = _ints(_rank_entry(affine["ranks"], ep_rank)["shard_shape"], "shard_shape")
    if numel(file_shape) != numel(_ints(affine.get("logical_shape"), "logical_shape")):
        raise RuntimeError("AutoEP universal checkpoint tensor shape disagrees with target logical shape")
    return runs, shard_shape
