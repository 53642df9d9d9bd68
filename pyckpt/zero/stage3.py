"""ZeRO stage 3 → Universal: the copy plan, following DeepSpeed 0.19.8's ds_to_universal.

Each rank's pieces of every parameter are found by the partition arithmetic of
``zero3_partition``. The universal file of a dense parameter is the raw 1-D concatenation over
ranks (DeepSpeed writes no dict and no step here).
"""

from __future__ import annotations

import os
from typing import Dict

from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from ..tensors import ITEMSIZE, NewTensor, numel
from ..planning.plan import Segments
from ..planning.state import TENSOR_STATES, CheckpointState
from .autoep.stage3 import plan_zero3_experts
from .discovery import ZeroCheckpoint
from .optimizer_state import universal_optimizer_state
from .tp_merge import Slice, TpRules
from .stage3_partition import shard_pieces


def _extract(ck: ZeroCheckpoint, t: int, experts, keys) -> Dict[tuple, list]:
    """(name, state) -> [Segments in dp order, dtype, requires_grad, numel] for tp rank t."""
    out: Dict[tuple, list] = {}
    for shard in ck.optim_grid[t]:
        # every dp rank's flat sub-groups follow the shapes that dp rank 0 saved
        for group, name, _, n, offset, real in shard_pieces(ck.model_grid[t][0], shard):
            if name in experts:
                continue
            for key in keys:
                tensor = group.tensor(key)
                if tensor is None:
                    raise CheckpointFormatError(f"{shard.path}: sub-group {group.index} has no {key} tensor")
                entry = out.setdefault((name, key), [Segments(), tensor.dtype, False, n])
                if entry[1] != tensor.dtype:
                    raise CheckpointFormatError(f"{shard.path}: {key} of {name} is {tensor.dtype} here but "
                                                f"{entry[1]} on a lower dp rank")
                entry[0].append(shard.file, *shard.file.tensor_byte_range(tensor, offset, real))
                entry[2] |= tensor.requires_grad
    return out


def plan_zero3(ck: ZeroCheckpoint, state: CheckpointState, strict: bool = True) -> Dict[str, int]:
    if ck.tp > 1 and any(ms.autoep_layers is not None for row in ck.model_grid for ms in row):
        raise UnsupportedCheckpointError(f"{ck.folder}: Universal checkpoint conversion of an AutoEP + AutoTP "
                                         "(tensor parallel) ZeRO-3 checkpoint is not supported (nor by DeepSpeed)")
    rules = TpRules(ck.model[0].universal_info or {}, ck.tp, ck.folder, ck.model[0].path) if ck.tp > 1 else None
    experts = plan_zero3_experts(ck, state)
    keys = state.wanted(TENSOR_STATES)
    extracted = [_extract(ck, t, experts, keys) for t in range(ck.tp)]
    names = [n for n in ck.model_grid[0][0].shapes if n not in experts]
    for name in names:
        for key in keys:
            slices = []
            for t in range(ck.tp):
                shapes = ck.model_grid[t][0].shapes
                if name not in shapes:
                    raise CheckpointFormatError(f"{ck.folder}: {name} is missing from the param_shapes of tp rank {t}")
                seg, dtype, requires_grad, n = extracted[t][(name, key)]
                if seg.nbytes != n * ITEMSIZE[dtype]:
                    raise CheckpointFormatError(f"{ck.folder}: ZeRO-3 fragments of {name} on tp rank {t} hold "
                                                f"{seg.nbytes} bytes, expected {n} elements (is a dp rank missing?)")
                slices.append(Slice(seg, shapes[name], dtype, requires_grad))
            if rules is None:  # DeepSpeed writes dense ZeRO-3 parameters as raw flat tensors
                s0 = slices[0]
                state.put(name, key, NewTensor(s0.dtype, (numel(s0.shape), ), s0.seg.pieces(), s0.requires_grad))
            else:
                merged = rules.merge(name, slices, key)
                if merged is not None:
                    state.put(name, key, merged)
    if rules is not None:
        rules.check_unused(strict)

    state.put_optimizer(universal_optimizer_state(ck.optim[0], ck.dp))
    if not experts:  # with AutoEP the model files were re-saved with expert patterns instead
        for ms in ck.model_files:
            state.copy_model_file(os.path.basename(ms.path), ms.file)
    return {"params": len(names) + len(experts), "fallback_params": 0, "experts": len(experts)}
