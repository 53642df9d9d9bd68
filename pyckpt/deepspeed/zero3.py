"""ZeRO stage 3 → Universal: the copy plan, following DeepSpeed 0.19.8's ds_to_universal.

Each rank's pieces of every parameter are found by the partition arithmetic of
``zero3_partition``. The universal file of a dense parameter is the raw 1-D concatenation over
ranks (DeepSpeed writes no dict and no step here).
"""

from __future__ import annotations

import os
import warnings
from typing import Dict

from . import autoep
from .discovery import ZeroCheckpoint
from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from ..planning.plan import Plan, Segments
from .tp_merge import Slice, TpMergeError, TpRules
from ..formats.pickle_read import ITEMSIZE, TensorRef, numel
from ..formats.pickle_write import NewTensor
from .zero3_partition import rank_pieces

STATES = ("fp32", "exp_avg", "exp_avg_sq")



def _sub_group_shapes(mf):
    param_shapes = mf.load().get("param_shapes")
    if not isinstance(param_shapes, (list, tuple)) or not all(isinstance(g, dict) for g in param_shapes):
        raise CheckpointFormatError(f"{mf.path}: param_shapes must be a list of per-sub-group dicts")
    return param_shapes


def _extract(ck, t, param_shapes, experts):
    """(name, state) -> (Segments in dp order, dtype, requires_grad, numel) for tp rank t."""
    out: Dict[tuple, list] = {}
    for rank, sf in enumerate(ck.optim_grid[t]):
        osd = sf.load()["optimizer_state_dict"]
        flat_groups = osd.get("fp32_flat_groups")
        opt_state = (osd.get("optimizer_state_dict") or {}).get("state")
        if flat_groups is None or opt_state is None:
            raise CheckpointFormatError(f"{sf.path}: ZeRO-3 shard lacks fp32_flat_groups or "
                                        "optimizer_state_dict['state']")
        if len(flat_groups) != len(param_shapes):
            raise CheckpointFormatError(f"{sf.path}: {len(flat_groups)} fp32 sub-groups, but param_shapes lists "
                                        f"{len(param_shapes)}")
        partition_groups = osd.get("ds_zero_partition_groups") or []
        for idx, sub_shapes in enumerate(param_shapes):
            if idx not in opt_state:
                raise CheckpointFormatError(f"{sf.path}: optimizer state of sub-group {idx} is missing")
            flats = {"fp32": flat_groups[idx], "exp_avg": opt_state[idx].get("exp_avg"),
                     "exp_avg_sq": opt_state[idx].get("exp_avg_sq")}
            for key, tensor in flats.items():
                if not isinstance(tensor, TensorRef):
                    raise CheckpointFormatError(f"{sf.path}: sub-group {idx} has no {key} tensor")
            part = partition_groups[idx] if idx < len(partition_groups) else {}
            count = int(part.get("partition_count", ck.dp))
            prank = int(part.get("partition_rank", rank))
            for name, shape, n, offset, real in rank_pieces(sub_shapes, count, prank):
                if name not in experts:
                    for key, tensor in flats.items():
                        entry = out.setdefault((name, key), [Segments(), tensor.dtype, False, n])
                        if entry[1] != tensor.dtype:
                            raise CheckpointFormatError(f"{sf.path}: {key} of {name} is {tensor.dtype} here but "
                                                        f"{entry[1]} on a lower dp rank")
                        entry[0].append(sf, *sf.tensor_byte_range(tensor, offset, real))
                        entry[2] |= tensor.requires_grad
    return out


def plan_zero3(ck: ZeroCheckpoint, plan: Plan, strict: bool = True) -> Dict[str, int]:
    if ck.tp > 1 and any(autoep.layers_of(mf.load()) is not None for row in ck.model_grid for mf in row):
        raise UnsupportedCheckpointError(f"{ck.folder}: Universal checkpoint conversion of an AutoEP + AutoTP "
                                         "(tensor parallel) ZeRO-3 checkpoint is not supported (nor by DeepSpeed)")
    rules = None
    if ck.tp > 1:
        rules = TpRules(ck.model[0].load().get("universal_checkpoint_info") or {}, ck.tp, ck.folder,
                        ck.model[0].path)
    experts = autoep.plan_zero3_experts(ck, plan)
    shapes_by_tp = [_sub_group_shapes(row[0]) for row in ck.model_grid]
    extracted = [_extract(ck, t, shapes_by_tp[t], experts) for t in range(ck.tp)]
    names = [n for sub in shapes_by_tp[0] for n in sub.keys() if n not in experts]
    flat_shapes = [{n: tuple(int(d) for d in sh) for sub in shapes for n, sh in sub.items()} for shapes in shapes_by_tp]
    for name in names:
        for key in STATES:
            slices = []
            for t in range(ck.tp):
                if name not in flat_shapes[t]:
                    raise CheckpointFormatError(f"{ck.folder}: {name} is missing from the param_shapes of tp rank {t}")
                seg, dtype, requires_grad, n = extracted[t][(name, key)]
                if seg.nbytes != n * ITEMSIZE[dtype]:
                    raise CheckpointFormatError(f"{ck.folder}: ZeRO-3 fragments of {name} on tp rank {t} hold "
                                                f"{seg.nbytes} bytes, expected {n} elements (is a dp rank missing?)")
                slices.append(Slice(seg, flat_shapes[t][name], dtype, requires_grad))
            if rules is None:  # DeepSpeed writes dense ZeRO-3 parameters as raw flat tensors
                s0 = slices[0]
                plan.add_archive(f"zero/{name}/{key}.pt", NewTensor(s0.dtype, (numel(s0.shape), ), s0.seg.pieces(),
                                                                     s0.requires_grad))
            else:
                merged = rules.merge(name, slices, key)
                if merged is not None:
                    plan.add_archive(f"zero/{name}/{key}.pt", merged)
    if rules is not None and rules.unused():
        if strict:
            raise TpMergeError(f"{ck.folder}: Unused patterns={rules.unused()} while merging tp slices (pass "
                               "--no_strict to only warn)")
        warnings.warn(f"Unused patterns={rules.unused()} while merging tp slices", stacklevel=2)

    rank0 = ck.optim[0].load()["optimizer_state_dict"]
    common = dict(rank0)
    common["param_groups"] = rank0["optimizer_state_dict"]["param_groups"]
    plan.add_archive("zero/optimizer_state.pt", common)
    if not experts:  # with AutoEP the model files were re-saved with expert patterns instead
        for mf in ck.model_files:
            plan.add_copy(mf, os.path.basename(mf.path))
    return {"params": len(names) + len(experts), "fallback_params": 0, "experts": len(experts)}
