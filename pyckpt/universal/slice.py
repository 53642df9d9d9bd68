"""Which elements of a Universal Checkpoint state file a target rank loads, as runs of elements.

DeepSpeed 0.19.8 loads ``zero/<name>/<key>.pt`` whole and slices it in memory; the slices it takes are
narrows and chunks of a row-major tensor, so each is a list of contiguous element runs of the file's
tensor. This module computes those runs, following the loader's order of operations
(``deepspeed/checkpoint/universal_checkpoint.py::load_hp_checkpoint_state`` for ZeRO-1/2 and BF16,
``deepspeed/runtime/zero/stage3.py::load_hp_checkpoint_state`` for ZeRO-3):

1. expert rows by ``ep_rank``: by the live parameter's AutoEP placement when it has one
   (:mod:`.restore_meta`), else the legacy contiguous ``ep_num_experts / ep_size`` rows;
2. the shape shortcut: a file tensor shaped like the live parameter is replicated or averaged, so the
   tensor-parallel slice is the whole tensor (not with AutoTP metadata);
3. vocabulary padding: zero rows appended up to ``lp.shape[0] * tp`` when the file says
   ``vocab_tensor`` (not with AutoTP metadata);
4. the parameter's AutoTP metadata where it describes the layout (:mod:`.restore_meta`), else the
   generic tensor-parallel slice: ``sub_param_shape``, ``param_n_sub_params`` or a plain
   ``chunk(tp, cat_dim)[tp_rank]``, then flattened;
5. ZeRO-1/2: ``narrow(lp_start, numel)`` of that flat; ZeRO-3: ``narrow(r * q, q)`` with
   ``q = ceil(n / W)`` after zero padding to ``W * q``.

A run is ``(src, n)``: ``n`` elements starting at element ``src`` of the file tensor, or ``n`` zeros
when ``src`` is None. Errors keep DeepSpeed's exception types and messages, so that a load through
pyckpt fails where and as DeepSpeed's would.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from ..tensors import numel
Run = Tuple[Optional[int], int]


def chunk_range(length: int, parts: int, index: int) -> Tuple[int, int]:
    """``torch.chunk(parts)[index]`` along a dimension of ``length``, as ``(start, stop)``.

    torch makes chunks of ``ceil(length / parts)`` and returns fewer than ``parts`` of them when the
    last ones would be empty; indexing past them is DeepSpeed's IndexError, kept here."""
    size = -(-length // parts) if length else 0
    count = -(-length // size) if size else 0
    if index >= max(count, 1 if length == 0 else 0):
        raise IndexError("tuple index out of range")
    start = index * size
    return start, min(start + size, length)


def select_along(shape: Sequence[int], dim: int, ranges: Sequence[Tuple[int, int]]) -> List[Run]:
    """The flattened ``torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim)`` of a contiguous
    tensor of ``shape``: for each index before ``dim``, one run per range."""
    outer = numel(shape[:dim])
    inner = numel(shape[dim + 1:])
    length = shape[dim]
    runs: List[Run] = []
    for o in range(outer):
        for a, b in ranges:
            if b > a:
                append_run(runs, (o * length + a) * inner, (b - a) * inner)
    return runs


def append_run(runs: List[Run], src: Optional[int], n: int) -> None:
    """Append a run, merging it into the last one when they are contiguous (or both zeros)."""
    if n <= 0:
        return
    if runs:
        last_src, last_n = runs[-1]
        if (src is None and last_src is None) or (src is not None and last_src is not None
                                                  and last_src + last_n == src):
            runs[-1] = (last_src, last_n + n)
            return
    runs.append((src, n))


def narrow(runs: Sequence[Run], start: int, length: int) -> List[Run]:
    """Elements ``[start, start + length)`` of the flat tensor the runs describe."""
    out: List[Run] = []
    pos = 0
    end = start + length
    for src, n in runs:
        lo, hi = max(pos, start), min(pos + n, end)
        if lo < hi:
            append_run(out, None if src is None else src + (lo - pos), hi - lo)
        pos += n
        if pos >= end:
            break
    return out


def total(runs: Sequence[Run]) -> int:
    return sum(n for _, n in runs)


def remap(runs: Sequence[Run], base: Sequence[Run]) -> List[Run]:
    """``runs`` address elements of the flat tensor ``base`` describes: the same elements as runs of
    the file tensor (zeros stay zeros)."""
    out: List[Run] = []
    for src, n in runs:
        if src is None:
            append_run(out, None, n)
        else:
            for s, m in narrow(base, src, n):
                append_run(out, s, m)
    return out


def tp_slice_runs(file_shape: Tuple[int, ...], meta: dict, lp_shape: Tuple[int, ...], tp_rank: int, tp_size: int,
                  ep_rank: int, ep_size: int, where: str, *, experts: Optional[Tuple[List[Run], tuple]] = None,
                  autotp: Optional[Callable[[tuple, List[Run]], Optional[List[Run]]]] = None) -> List[Run]:
    """ZeRO-1/2 and BF16: the flattened tensor-parallel slice of the live parameter (shape ``lp_shape``)
    in the state file ``where`` (a dict file; ``meta`` are its keys besides ``param``), as runs of the
    file tensor. Steps 1-4 of the module docstring. ``experts``: the rank's experts already cut by the
    parameter's AutoEP metadata (runs of the file tensor, their shape); ``autotp``: for a parameter
    with AutoTP restore metadata, its cut (:func:`.restore_meta.autotp_runs` bound to the metadata
    and rank: (shape, runs) -> runs, or None where the metadata leaves it to the generic slice); such
    a parameter gets neither the shape shortcut nor the vocabulary padding."""
    shape = tuple(file_shape)
    base: List[Run] = [(0, numel(shape))] if numel(shape) else []
    is_expert = meta.get("is_expert_param", False)
    if experts is not None:
        base, shape = experts[0], tuple(experts[1])
    elif is_expert and ep_size > 1:
        experts = meta.get("ep_num_experts")
        assert experts is not None, f"Expert param in {where} missing 'ep_num_experts' metadata"
        assert shape[0] == experts, f"Expert param dim 0 ({shape[0]}) != ep_num_experts ({experts})"
        assert experts % ep_size == 0, f"num_experts ({experts}) not divisible by ep_size ({ep_size})"
        local = experts // ep_size
        base = select_along(shape, 0, [(ep_rank * local, (ep_rank + 1) * local)])
        shape = (local, ) + shape[1:]
    if shape == tuple(lp_shape) and not autotp:
        tp_rank, tp_size = 0, 1
    if meta.get("vocab_tensor", False) and not is_expert and not autotp:
        padded = lp_shape[0] * tp_size
        assert padded >= shape[0], f"Vocab tensor padded size {padded} < loaded universal size {shape[0]}"
        if padded > shape[0]:
            base = base + [(None, (padded - shape[0]) * numel(shape[1:]))]
            shape = (padded, ) + shape[1:]
    if autotp:
        runs = autotp(shape, base)
        if runs is not None:
            return runs
    full = numel(shape)
    assert full == tp_size * numel(lp_shape), (f"Loading {where} full param numel {full} != tensor slice numel "
                                               f"{numel(lp_shape)} * tp_world_size {tp_size}")
    sub_shape = meta.get("sub_param_shape")
    dim = meta.get("cat_dim", 0)
    n_sub = meta.get("param_n_sub_params", 1)
    if sub_shape is not None:
        # SubparamShape(patterns, shape, partition_dim): the tensor viewed as the summed shape,
        # each sub-parameter's extent along partition_dim chunked separately.
        # (an inert record of the pickled dataclass: its fields read as attributes).
        dim, sub_dims = sub_shape.partition_dim, tuple(sub_shape.shape)
        sizes = tuple(sub_dims[dim]) if isinstance(sub_dims[dim], (tuple, list)) else (sub_dims[dim], )
        view = tuple(sum(d) if isinstance(d, (tuple, list)) else d for d in sub_dims)
        known = numel(d for d in view if d != -1)
        if list(view).count(-1) == 1 and known and full % known == 0:
            view = tuple(full // known if d == -1 else d for d in view)
        if numel(view) != full or any(d < 0 for d in view):
            raise RuntimeError(f"shape '{list(view)}' is invalid for input of size {full}")
        shape, ranges, offset = view, [], 0
        for size in sizes:
            a, b = chunk_range(size, tp_size, tp_rank)
            ranges.append((offset + a, offset + b))
            offset += size
    elif n_sub > 1:
        ranges = []
        for k in range(n_sub):
            s0, s1 = chunk_range(shape[dim], n_sub, k)
            a, b = chunk_range(s1 - s0, tp_size, tp_rank)
            ranges.append((s0 + a, s0 + b))
    else:
        ranges = [chunk_range(shape[dim], tp_size, tp_rank)]
    return remap(select_along(shape, dim, ranges), base)


def zero3_partition_runs(n: int, world: int, rank: int) -> List[Run]:
    """ZeRO-3: this rank's ``q = ceil(n / world)`` elements of the flat state, zeros past ``n``."""
    q = -(-n // world)
    lo, hi = rank * q, (rank + 1) * q
    runs: List[Run] = []
    append_run(runs, lo, max(0, min(hi, n) - lo))
    append_run(runs, None, hi - max(lo, min(hi, n)))
    return runs
