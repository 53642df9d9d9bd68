"""DeepSpeed's own checks of a parameter's AutoTP / AutoEP restore metadata, run without data.

DeepSpeed's resolvers (``_resolve_autoep_partition``, ``_resolve_autotp_partition``,
``DeepSpeedZeroOptimizer_Stage3._slice_autoep_universal_expert_param``) validate the live metadata
against the checkpoint's markers and raise DeepSpeed's errors. They are pure functions of shapes and
metadata until they copy, so they run here on a ``meta``-device stand-in of the file tensor: every
check and error is DeepSpeed's, no byte is read, and the shape they cut is compared with the runs
pyckpt computes (:mod:`pyckpt.universal.restore_meta`), which then do the reading.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ...universal.restore_meta import autoep_runs
from ...universal.slice import Run
from .unsupported import Unsupported

AUTOEP_META = "ds_autoep_uc_meta"


def _probe(shape):
    import torch

    return torch.empty(tuple(shape), dtype=torch.float32, device="meta")


def _affine_of(meta) -> dict:
    from deepspeed.checkpoint.autoep_affine import autoep_metadata_to_affine_map

    return autoep_metadata_to_affine_map(meta, tuple(meta["logical_shape"])).to_dict()


def _checked(runs: List[Run], shape, cut, what: str) -> Tuple[List[Run], tuple]:
    if tuple(cut.shape) != tuple(shape):
        raise Unsupported(f"{what}: DeepSpeed cuts {tuple(cut.shape)}, pyckpt's runs {tuple(shape)}")
    return runs, tuple(shape)


def zero12_experts(lp, file_meta: dict, file_shape, ep_rank: int, what: str) -> Optional[Tuple[List[Run], tuple]]:
    """ZeRO-1/2: the rank's experts by the parameter's AutoEP metadata, or None without it."""
    meta = getattr(lp, AUTOEP_META, None)
    if meta is None:
        return None
    from deepspeed.checkpoint.universal_checkpoint import _resolve_autoep_partition

    cut = _resolve_autoep_partition(lp, dict(file_meta), _probe(file_shape), ep_rank)
    runs, shape = autoep_runs(_affine_of(meta), file_shape, ep_rank)
    return _checked(runs, shape, cut, what)


def zero3_experts(opt, param, file_meta: dict, file_shape, what: str) -> Tuple[List[Run], tuple]:
    """ZeRO-3: the rank's experts of an expert state file, by the parameter's metadata or by its
    local expert count (``_slice_autoep_universal_expert_param``)."""
    from deepspeed.utils import groups

    from ...universal.slice import select_along

    cut = opt._slice_autoep_universal_expert_param({**file_meta, "param": _probe(file_shape)}, param)
    ep_rank = groups._get_expert_parallel_rank(param.ds_zero_partition_group_name)
    meta = getattr(param, AUTOEP_META, None)
    if meta is not None:
        runs, shape = autoep_runs(_affine_of(meta), file_shape, ep_rank)
    else:
        local = cut.shape[0]
        runs = select_along(tuple(file_shape), 0, [(ep_rank * local, (ep_rank + 1) * local)])
        shape = (local, ) + tuple(file_shape[1:])
    return _checked(runs, shape, cut, what)


def autotp_numel(lp, file_meta: dict, shape, tp_rank: int, tp_size: int, key: str) -> Optional[int]:
    """DeepSpeed's AutoTP cut of a (possibly expert-sliced) tensor of ``shape``: its element count, or
    None where DeepSpeed falls back to the generic slicing. Raises DeepSpeed's errors."""
    from deepspeed.checkpoint.universal_checkpoint import _resolve_autotp_partition

    cut = _resolve_autotp_partition(lp, dict(file_meta), _probe(shape), tp_rank, tp_size, state_key=key)
    return None if cut is None else cut.numel()
