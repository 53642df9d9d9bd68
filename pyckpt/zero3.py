"""ZeRO stage 3 → Universal: the copy plan, following DeepSpeed 0.19.8's ds_to_universal.

Under ZeRO-3 every parameter is split on its own: with W ranks in its partition group, each rank
holds ``q = ceil(numel / W)`` elements (the last rank's tail is padding), and a sub-group's flat
fp32 buffer is those per-parameter pieces back to back. Rank r's real elements of a parameter are
``max(0, min(q, numel - r*q))`` starting at the running offset. The universal file of a dense
parameter is the raw 1-D concatenation over ranks (DeepSpeed writes no dict and no step here).
"""

from __future__ import annotations

import math
import os
from typing import Dict, List

from . import autoep
from .checkpoint import ZeroCheckpoint
from .errors import CheckpointFormatError
from .plan import Piece, Plan
from .safe_pickle import ITEMSIZE, TensorRef
from .torch_pickle import NewTensor

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def plan_zero3(ck: ZeroCheckpoint, plan: Plan) -> Dict[str, int]:
    experts = autoep.plan_zero3_experts(ck, plan)
    param_shapes = ck.model[0].load().get("param_shapes")
    if not isinstance(param_shapes, (list, tuple)) or not all(isinstance(g, dict) for g in param_shapes):
        raise CheckpointFormatError(f"{ck.model[0].path}: param_shapes must be a list of per-sub-group dicts")

    # (name, state) -> list of pieces in dp order, and their dtype
    pieces: Dict[tuple, List[Piece]] = {}
    meta: Dict[tuple, list] = {}
    for rank, sf in enumerate(ck.optim):
        osd = sf.load()["optimizer_state_dict"]
        flat_groups = osd.get("fp32_flat_groups")
        opt_state = (osd.get("optimizer_state_dict") or {}).get("state")
        if flat_groups is None or opt_state is None:
            raise CheckpointFormatError(f"{sf.path}: ZeRO-3 shard lacks fp32_flat_groups or "
                                        "optimizer_state_dict['state']")
        if len(flat_groups) != len(param_shapes):
            raise CheckpointFormatError(f"{sf.path}: {len(flat_groups)} fp32 sub-groups, but param_shapes in "
                                        f"{ck.model[0].path} lists {len(param_shapes)}")
        partition_groups = osd.get("ds_zero_partition_groups") or []
        for idx, sub_shapes in enumerate(param_shapes):
            if idx not in opt_state:
                raise CheckpointFormatError(f"{sf.path}: optimizer state of sub-group {idx} is missing")
            flats = {"fp32": flat_groups[idx], "exp_avg": opt_state[idx].get("exp_avg"),
                     "exp_avg_sq": opt_state[idx].get("exp_avg_sq")}
            for key, t in flats.items():
                if not isinstance(t, TensorRef):
                    raise CheckpointFormatError(f"{sf.path}: sub-group {idx} has no {key} tensor")
            part = partition_groups[idx] if idx < len(partition_groups) else {}
            count = int(part.get("partition_count", ck.dp))
            prank = int(part.get("partition_rank", rank))
            offset = 0
            for name, shape in sub_shapes.items():
                n = _numel(shape)
                q = math.ceil(n / count)
                real = max(0, min(q, n - prank * q))
                if name in experts:
                    offset += q
                    continue
                for key, t in flats.items():
                    off, nbytes = sf.tensor_byte_range(t, offset, real)
                    lst = pieces.setdefault((name, key), [])
                    dst = lst[-1].dst_off + lst[-1].nbytes if lst else 0
                    lst.append(Piece(sf, off, nbytes, dst))
                    m = meta.setdefault((name, key), [t.dtype, False, n])
                    if m[0] != t.dtype:
                        raise CheckpointFormatError(f"{sf.path}: {key} of {name} is {t.dtype} here but {m[0]} on "
                                                    "a lower dp rank")
                    m[1] |= t.requires_grad
                offset += q

    names = [n for sub in param_shapes for n in sub.keys() if n not in experts]
    for name in names:
        for key in STATES:
            dtype, requires_grad, n = meta[(name, key)]
            ps = [p for p in pieces[(name, key)] if p.nbytes]
            got = sum(p.nbytes for p in ps)
            if got != n * ITEMSIZE[dtype]:
                raise CheckpointFormatError(f"{ck.folder}: ZeRO-3 fragments of {name} hold {got} bytes, expected "
                                            f"{n} elements (is a dp rank missing?)")
            plan.add_archive(f"zero/{name}/{key}.pt", NewTensor(dtype, (n, ), ps, requires_grad))

    rank0 = ck.optim[0].load()["optimizer_state_dict"]
    common = dict(rank0)
    common["param_groups"] = rank0["optimizer_state_dict"]["param_groups"]
    plan.add_archive("zero/optimizer_state.pt", common)
    if not experts:  # with AutoEP the model files were re-saved with expert patterns instead
        for path in ck.model_paths:
            plan.add_copy(path, os.path.basename(path))
    return {"params": len(names) + len(experts), "fallback_params": 0, "experts": len(experts)}

