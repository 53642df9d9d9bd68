"""AutoEP experts of a partition-native ZeRO-3 checkpoint → universal expert files.

DeepSpeed >= 0.19.6 saves ZeRO-3 AutoEP experts in the ``zero3_partitioned`` format: each rank's
model states name its EP rank, its expert-data-parallel rank and world, and the expert placement
(which global experts its local rows are). A universal expert file gathers, per EP rank, the
expert-DP partitions of its local tensor, and puts each local row at its global expert id; an
expert replicated on several EP ranks must hold the same bytes on each.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, Tuple

from ...errors import AutoEPError, UnsupportedCheckpointError
from ...tensors import ITEMSIZE, NewTensor, numel
from ...planning.plan import Segments
from ...planning.state import TENSOR_STATES, CheckpointState
from ..stage3_partition import shard_pieces
from .layers import (WEIGHTS, ZERO3_PATTERNS, Placement, in_files, is_partitioned, placement_of, resaved_model_states,
                     validate_zero3)


def plan_zero3_experts(ck, out: CheckpointState) -> set:
    """Partition-native ZeRO-3 AutoEP experts; returns the expert parameter names (left out of the dense path)."""
    metas = {r: ms.autoep_layers for r, ms in enumerate(ck.model) if ms.autoep_layers is not None}
    if not metas:
        return set()
    partitioned = {}
    for r, m in metas.items():
        if isinstance(m, list):
            validate_zero3(m, ck.model[r].path, require_partitioned=False)
            if any(is_partitioned(e) for e in m):
                validate_zero3(m, ck.model[r].path, require_partitioned=True)
                partitioned[r] = m
    if not partitioned:
        raise UnsupportedCheckpointError(
            f"{ck.folder}: this ZeRO-3 checkpoint has AutoEP metadata but not the partition-native format "
            "(checkpoint_format: zero3_partitioned): AutoEP universal conversion needs ZeRO stage 1 or 2, or the "
            "partition-native ZeRO-3 format of DeepSpeed >= 0.19.6")
    expert_names = {f"{e['expert_key_prefix']}.{w}" for m in partitioned.values() for e in m if is_partitioned(e)
                    for w in WEIGHTS}

    # (name, state) -> {ep_rank: [(partition_rank, Segments, requires_grad, edp world, dtype, path)]}
    frags: Dict[Tuple[str, str], Dict[int, list]] = {}
    layer_of: Dict[str, dict] = {}
    placement_of_param: Dict[str, Placement] = {}
    skipped: Dict[Tuple[str, str], str] = {}  # (name, moment) -> a shard lacking it
    local_shape_of: Dict[Tuple[str, int], tuple] = {}
    for r, meta in partitioned.items():
        ms, shard = ck.model[r], ck.optim[r]
        sf = shard.file
        info = {f"{e['expert_key_prefix']}.{w}": (e, placement_of(e, ms.path))
                for e in meta if is_partitioned(e) for w in WEIGHTS}
        for name, (e, placement) in info.items():
            if name not in ms.shapes and placement.experts_of(e["ep_rank"]):
                raise AutoEPError(f"AutoEP expert parameters are missing from rank {r} ZeRO param_shapes "
                                  f"({ms.path}): {name}")
        frozen = set(ms.frozen) & set(info)
        if frozen:
            raise AutoEPError(f"AutoEP frozen expert parameters cannot be converted from the ZeRO-3 partition-native "
                              f"format: {sorted(frozen)} in {ms.path}")
        for group, name, shape, _, offset, real in shard_pieces(ms, shard):
            if name not in info:
                continue
            e, placement = info[name]
            ep_rank = e["ep_rank"]
            if placement_of_param.setdefault(name, placement) != placement:
                raise AutoEPError(f"AutoEP expert placement disagrees across ranks for {name} (at {ms.path}).")
            layer_of.setdefault(name, e)
            expected = (len(placement.experts_of(ep_rank)), ) + shape[1:]
            if shape != expected:
                raise AutoEPError(f"AutoEP expert shard shape mismatch for {name}, EP rank {ep_rank}: got "
                                  f"{shape}, expected {expected} (in {ms.path}).")
            local_shape_of[(name, ep_rank)] = shape
            for state in out.wanted(TENSOR_STATES):
                t = group.tensor(state)
                if t is None:
                    if state == "fp32":
                        raise AutoEPError(f"Missing fp32 partition for AutoEP expert parameter {name} on "
                                          f"ZeRO rank {r} ({sf.path})")
                    skipped.setdefault((name, state), sf.path)
                    continue
                seg = Segments([(sf, *sf.tensor_byte_range(t, offset, real))])
                frags.setdefault((name, state), {}).setdefault(ep_rank, []).append(
                    (group.partition_rank, seg, t.requires_grad, e["expert_data_parallel_world_size"], t.dtype,
                     sf.path))

    for (name, state), path in sorted(skipped.items()):
        warnings.warn(f"AutoEP: skipped {state} of {name}: no {state} in {path}", stacklevel=3)
    for (name, state), by_ep in sorted(frags.items()):
        if (name, state) in skipped:
            continue
        placement = placement_of_param[name]
        e0 = layer_of[name]
        # EP ranks holding experts that gave no fragment. A uniform placement's ep_size is a bare number from
        # the checkpoint and each of its ranks holds experts: the first len(by_ep) + 8 ranks show up to eight.
        ranks = range(placement.ep_size if placement.explicit is not None else min(placement.ep_size, len(by_ep) + 8))
        missing = [r for r in ranks if r not in by_ep and placement.experts_of(r)]
        if missing:
            more = placement.ep_size - len(by_ep) - len(missing) if len(ranks) < placement.ep_size else 0
            raise AutoEPError(f"Missing AutoEP universal fragments for {name}/{state} EP ranks: {missing}"
                              f"{f' and {more} more' if more > 0 else ''}"
                              f"{in_files([it[5] for items in by_ep.values() for it in items], ck.folder)}")
        locals_: Dict[int, Tuple[Segments, str, bool]] = {}
        for ep_rank, items in sorted(by_ep.items()):
            items.sort(key=lambda it: it[0])
            pranks = [it[0] for it in items]
            world = items[0][3]
            if len(pranks) != len(set(pranks)):
                raise AutoEPError(f"Duplicate AutoEP expert-DP partition ranks for {name}/{state} EP rank {ep_rank}: "
                                  f"{pranks}{in_files([it[5] for it in items], ck.folder)}")
            if set(pranks) != set(range(world)):
                raise AutoEPError(f"Incomplete AutoEP expert-DP fragments for {name}/{state} EP rank {ep_rank}: got "
                                  f"{sorted(pranks)}, expected {list(range(world))}{in_files([it[5] for it in items], ck.folder)}")
            seg = Segments()
            for it in items:
                seg.extend(it[1])
            dtype = items[0][4]
            shape = local_shape_of[(name, ep_rank)]
            locals_[ep_rank] = (seg.slice(0, numel(shape) * ITEMSIZE[dtype]), dtype, any(it[2] for it in items))
        out.put(name, state,
                _placed_expert_dict(name, state, placement, locals_, local_shape_of, e0["num_experts"],
                                    in_files([it[5] for items in by_ep.values() for it in items], ck.folder)))

    for ms in ck.model_files:
        out.put_model_file(os.path.basename(ms.path), resaved_model_states(ms, ZERO3_PATTERNS, ms.autoep_layers))
    return expert_names


def _placed_expert_dict(name, state, placement, locals_, local_shape_of, num_experts, files: str):
    """Rows of each EP rank's packed local tensor land at their global expert ids."""
    any_rank = next(iter(locals_))
    dtype = locals_[any_rank][1]
    row_shape = local_shape_of[(name, any_rank)][1:]
    row_bytes = numel(row_shape) * ITEMSIZE[dtype]
    owner: Dict[int, Tuple[int, int]] = {}  # expert id -> (ep rank, local row)
    for r, experts in enumerate(placement.experts_by_rank):
        for row, eid in enumerate(experts):
            if eid in owner:
                first = locals_[owner[eid][0]][0].slice(owner[eid][1] * row_bytes, row_bytes).read()
                again = locals_[r][0].slice(row * row_bytes, row_bytes).read()
                if first != again:
                    raise AutoEPError(f"Failed to rebuild AutoEP universal tensor for {name}/{state}: ranks "
                                      f"{owner[eid][0]} and {r} hold different data for replicated expert {eid}{files}")
                continue
            owner[eid] = (r, row)
    pieces = []
    for eid in range(num_experts):
        r, row = owner[eid]
        pieces.extend(locals_[r][0].slice(row * row_bytes, row_bytes).pieces(eid * row_bytes))
    tensor = NewTensor(dtype, (num_experts, ) + tuple(row_shape), pieces, any(v[2] for v in locals_.values()))
    return {"param": tensor, "cat_dim": 0, "is_expert_param": True, "ep_num_experts": num_experts}


