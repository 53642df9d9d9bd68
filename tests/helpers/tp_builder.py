"""Tiny Megatron-style TP x PP ZeRO-1/2 checkpoints in DeepSpeed 0.19.8's format (test helper).

DeepSpeed cannot run Megatron-DeepSpeed's pipeline + tensor parallel training here, so these are
written the way DeepSpeed's engine writes them: one ``mp_rank_{pp*tp+t:02d}_model_states.pt`` per
(pp, tp) rank with ``checkpoint_parallel_dimensions`` and per-rank ``param_shapes``, and one
``zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` per (dp, mp) rank laid out by ZeRO-1/2's
partition arithmetic (flat group, 2*dp alignment, ``param_slice_mappings``), with DeepSpeed's own
classes (LossScaler, ZeroStageEnum, fragment_address). Each parameter is made whole first and then
cut into tp slices by the inverse of its merge rule, so a correct converter gets the whole back.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch


@dataclass
class Param:
    name: str
    full: torch.Tensor  # the logical tensor a universal checkpoint should hold
    split: Callable[[torch.Tensor, int, int], torch.Tensor]  # (full, tp rank, tp degree) -> slice
    stages: tuple = (0, )  # pipeline stages holding it


def split_dim(dim: int, widths: Optional[List[int]] = None):
    def f(full, t, tp):
        if widths is None:
            return full.chunk(tp, dim=dim)[t].clone()
        start = sum(widths[:t])
        return full.narrow(dim, start, widths[t]).clone()
    return f


def replicate(full, t, tp):
    return full.clone()


def perturb(full, t, tp):
    # Averaged parameters differ per rank; their mean is what the universal file holds.
    return (full + (t - (tp - 1) / 2) * 0.25).clone()


def two_sub_params(full, t, tp):
    a, b = full.chunk(2, dim=0)
    return torch.cat([a.chunk(tp, dim=0)[t], b.chunk(tp, dim=0)[t]], dim=0).clone()


def sub_params(sizes: List[int], widths: List[List[int]], dim: int):
    def f(full, t, tp):
        parts, off = [], 0
        for size, w in zip(sizes, widths):
            parts.append(full.narrow(dim, off + sum(w[:t]), w[t]))
            off += size
        return torch.cat(parts, dim=dim).clone()
    return f


def _flat_layout(shapes: "OrderedDict[str, torch.Size]", dp: int):
    n = sum(math.prod(s) for s in shapes.values())
    align = 2 * dp
    n_pad = -(-n // align) * align
    return n, n_pad, n_pad // dp


def build(root, params: List[Param], uc_info: dict, tp: int, pp: int, dp: int, stage: int = 2,
          tag: str = "global_step3", parallel_dims: bool = True) -> str:
    """Writes root/latest and root/<tag>/...; returns the tag folder."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    folder = os.path.join(root, tag)
    os.makedirs(folder, exist_ok=True)
    ds_config = {"train_batch_size": dp, "zero_optimization": {"stage": stage}}
    for p in range(pp):
        for t in range(tp):
            mp = p * tp + t
            slices = OrderedDict((prm.name, prm.split(prm.full, t, tp)) for prm in params if p in prm.stages)
            shapes = OrderedDict((k, v.shape) for k, v in slices.items())
            model_state = {
                "module": OrderedDict((k, v.clone()) for k, v in slices.items()),
                "buffer_names": [],
                "optimizer": None,
                "param_shapes": [shapes],
                "frozen_param_shapes": None,
                "shared_params": {},
                "frozen_param_fragments": None,
                "lr_scheduler": None,
                "data_sampler": None,
                "random_ltd": None,
                "sparse_tensor_module_names": set(),
                "skipped_steps": 0,
                "global_steps": 3,
                "global_samples": 3 * dp,
                "dp_world_size": dp,
                "mp_world_size": tp,
                "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp},
                "ds_config": ds_config,
                "ds_version": "0.19.8",
                "universal_checkpoint_info": uc_info,
                "iteration": 3,
            }
            if not parallel_dims:  # checkpoints from before DeepSpeed recorded it: the legacy file-count rule
                del model_state["checkpoint_parallel_dimensions"]
            torch.save(model_state, os.path.join(folder, f"mp_rank_{mp:02d}_model_states.pt"))
            n, n_pad, part = _flat_layout(shapes, dp)
            flat = torch.zeros(n_pad)
            if n:
                flat[:n] = torch.cat([v.reshape(-1).float() for v in slices.values()])
            # Moments follow the weights, so tp-replicated parameters have equal moments on every tp rank,
            # as they do in training (same gradients); the padding stays zero.
            avg = flat * 0.125
            avg_sq = flat * flat * 0.0625
            for r in range(dp):
                lo, hi = r * part, (r + 1) * part
                mappings, offset = OrderedDict(), 0
                for name, shape in shapes.items():
                    numel = math.prod(shape)
                    a, b = max(offset, lo), min(offset + numel, hi)
                    if a < b:
                        mappings[name] = fragment_address(numel=b - a, start=a - lo)
                    offset += numel
                padding = part if n <= lo else (hi - n if n < hi else 0)
                osd = {
                    "loss_scaler": LossScaler(1.0),
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "clip_grad": 1.0,
                    "base_optimizer_state": {
                        "state": {0: {"step": torch.tensor(3.0), "exp_avg": avg[lo:hi].clone(),
                                      "exp_avg_sq": avg_sq[lo:hi].clone()}},
                        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                          "amsgrad": False, "params": [0]}],
                    },
                    "single_partition_of_fp32_groups": [flat[lo:hi - padding].clone()],
                    "zero_stage": ZeroStageEnum(stage),
                    "group_paddings": [padding],
                    "partition_count": [dp],
                    "ds_version": "0.19.8",
                    "param_slice_mappings": [mappings],
                }
                torch.save({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": "0.19.8"},
                           os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag)
    return folder
