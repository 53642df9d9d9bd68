"""AutoEP on the load side: which expert rows a target EP rank takes from a universal expert file,
whether a target topology can load the checkpoint's experts, and a reader of one rank's rows that
reads only their bytes (torch is imported here only, when a tensor is asked for)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from ..errors import CheckpointFormatError, quoted
from ..tensors import numel
from ..formats.pickle_read import TensorRef
from ..zero.autoep.ep_sizes import divisors, valid_ep_sizes
from ..zero.autoep.layers import WEIGHTS, positive_int


def check_load_topology(layers: Sequence[dict], autoep_size: int, world_size: int, *, pp_size: int = 1,
                        target_shapes: Optional[Dict[str, tuple]] = None,
                        checkpoint_shapes: Optional[Dict[str, tuple]] = None) -> None:
    """Can a run with ``autoep_size`` over ``world_size / pp_size`` ranks load these experts?

    ``layers`` are the checkpoint's AutoEP layer entries (``module_path``/``expert_key_prefix`` and
    ``num_experts``). ``target_shapes``/``checkpoint_shapes`` map ``<prefix>.wN`` to the target run's
    local shape and the universal file's full shape. Raises ValueError naming layer, counts and sizes.
    """
    if not positive_int(autoep_size):
        raise ValueError(f"autoep_size must be a positive integer, got {autoep_size!r}")
    if world_size % pp_size != 0:
        raise ValueError(f"world_size={world_size} is not divisible by pp_size={pp_size}")
    stage = world_size // pp_size
    if stage % autoep_size != 0:
        raise ValueError(f"autoep_size={autoep_size} must divide the stage size (world_size={world_size} / "
                         f"pp_size={pp_size} = {stage}). Valid autoep_size values: {divisors(stage)}")
    for entry in layers:
        layer = entry.get("module_path", entry.get("expert_key_prefix"))
        n = entry["num_experts"]
        if n % autoep_size != 0:
            raise ValueError(f"layer {quoted(layer)}: num_experts={n} is not divisible by autoep_size={autoep_size}. "
                             f"Valid autoep_size values: {valid_ep_sizes(n, stage)}")
        for w in WEIGHTS:
            key = f"{entry['expert_key_prefix']}.{w}"
            if target_shapes is None or key not in target_shapes:
                continue
            target = tuple(target_shapes[key])
            full = tuple(checkpoint_shapes[key]) if checkpoint_shapes and key in checkpoint_shapes else None
            expected_local = n // autoep_size
            if target[0] != expected_local or (full is not None and tuple(full[1:]) != target[1:]):
                shaped = f"of shape {full[1:]} " if full else ""
                raise ValueError(f"layer {quoted(layer)}: {key} has target shape {target}, but the checkpoint's {n} "
                                 f"experts {shaped}at autoep_size={autoep_size} "
                                 f"give {(expected_local, ) + (tuple(full[1:]) if full else target[1:])}. "
                                 f"Valid autoep_size values: {valid_ep_sizes(n, stage)}")


def expert_rows(num_experts: int, ep_rank: int, ep_size: int) -> Tuple[int, int]:
    if not positive_int(ep_size) or num_experts % ep_size != 0:
        raise ValueError(f"num_experts ({num_experts}) not divisible by ep_size ({ep_size}). Valid ep sizes: "
                         f"{valid_ep_sizes(num_experts)}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} is outside [0, {ep_size})")
    local = num_experts // ep_size
    return ep_rank * local, local


def read_expert_slice(path, ep_rank: int, ep_size: int, *, key: str = "param", out=None, workers: int = 0):
    """Rows ``[ep_rank*E/ep, (ep_rank+1)*E/ep)`` of a universal expert file, reading only those bytes.

    Returns a torch tensor (or fills ``out``, a contiguous tensor of the slice's shape and dtype).
    Only the small pickle and the slice's byte range are read, through the native executor.
    """
    import numpy as np
    import torch

    from ..formats.torch_zip import SourceFile
    from ..native import KIND_COPY, gather_into, op_table

    sf = SourceFile(path)
    obj = sf.load()
    if not isinstance(obj, dict) or not isinstance(obj.get(key), TensorRef):
        raise CheckpointFormatError(f"{sf.path}: not a universal parameter file (no tensor under {quoted(key)})")
    t = obj[key]
    num_experts = int(obj.get("ep_num_experts", t.shape[0]))
    if not obj.get("is_expert_param", False):
        raise CheckpointFormatError(f"{sf.path}: not an expert parameter (is_expert_param is not set)")
    if t.shape[0] != num_experts:
        raise CheckpointFormatError(f"{sf.path}: tensor has {t.shape[0]} rows but ep_num_experts={num_experts}")
    start, rows = expert_rows(num_experts, ep_rank, ep_size)
    row_numel = numel(t.shape[1:])
    off, nbytes = sf.tensor_byte_range(t, start * row_numel, rows * row_numel)
    shape = (rows, ) + tuple(t.shape[1:])
    dtype = getattr(torch, t.dtype)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {t.dtype} tensor of shape {shape}")
    if nbytes:
        buf = out.view(torch.uint8).reshape(-1).numpy() if out.numel() else np.empty(0, np.uint8)
        gather_into(sf.path, op_table([(0, off, 0, 0, 0, nbytes, KIND_COPY, 1, 0)]), buf, workers)
    return out
