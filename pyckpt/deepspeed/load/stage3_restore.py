"""Universal load for ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``).

The state DeepSpeed 0.19.8's ``_load_universal_checkpoint`` leaves, built from each rank's own
bytes: per sub-group, the flat fp32 partition overwritten whole (each parameter's ``ceil(n / W)``
elements at a running offset, zeros past the parameter's end and past the last parameter), one new
buffer per optimizer state likewise, then the low-precision partition cast from fp32 and every
``ds_tensor`` re-pointed into it. The module-only form (``load_optimizer_states=False``) fills the
low-precision partition, and the fp32 one when ``load_from_fp32_weights``, from ``fp32.pt`` alone.

Two differences, on purpose, where DeepSpeed's result is not the state of a run that never
checkpointed: every sub-group gets its own ``step`` tensor (DeepSpeed shares one object, which torch
Adam then advances once per sub-group: 3 becomes 5 in one step with two sub-groups), and each
optimizer param group gets its own hyper-parameters from the checkpoint (DeepSpeed gives every group
group 0's, its MoE group name included).
"""

from __future__ import annotations

import os
from typing import Dict, List

from ...universal.layout import state_file
from ...universal.slice import zero3_partition_runs
from ...errors import CheckpointFormatError
from ...planning.state import MOMENTS, TENSOR_STATES
from . import restore_targets
from .gather import TensorFill, state_buffer
from .state_files import FolderStates, loss_scaler
from .unsupported import Unsupported

# Keys of a param group that name the live engine's MoE group (DeepSpeed's
# split_params_into_different_moe_groups_for_optimizer: "ep_size_4" after a load at another
# expert-parallel size), not training hyper-parameters: a run that never checkpointed keeps its own.
LIVE_GROUP_KEYS = ("name", "moe")


def _state_runs(opt, param, sf, autotp) -> list:
    """This rank's ``ceil(n / W)`` elements of the parameter's state file ``sf`` as runs of its tensor,
    in DeepSpeed's order (``stage3.py::load_hp_checkpoint_state``): the rank's experts of an expert
    state, the AutoTP shard by the parameter's metadata, then the zero-padded data-parallel slice."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    from ...universal.restore_meta import NotACopy, autotp_runs
    from ...universal.slice import remap, total

    where = sf.source.path
    n = sf.tensor.numel()
    base = [(0, n)] if n else []
    try:
        if sf.is_dict and sf.meta.get("is_expert_param", False):
            base, shape = restore_targets.zero3_experts(opt, param, sf.meta, tuple(sf.tensor.shape), where)
            n = total(base)
        if sf.is_dict and autotp:
            tp_group = groups.get_tensor_model_parallel_group()
            tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
            # DeepSpeed cuts the flattened tensor, and with the parameter's scale power whatever the state
            expected = restore_targets.autotp_numel(param, sf.meta, (n, ), tp_rank, tp_size, "fp32")
            cut = autotp_runs(autotp, (n, ), base, tp_rank, tp_size, "fp32")
            if (cut is None) != (expected is None) or (cut is not None and total(cut) != expected):
                raise Unsupported(f"{where}: DeepSpeed cuts {expected} elements, pyckpt's runs "
                                  f"{None if cut is None else total(cut)}")
            if cut is not None:
                base, n = cut, total(cut)
    except NotACopy as exc:
        raise Unsupported(f"{where}: {exc}") from None
    group = opt._get_param_partition_group(param)
    return remap(zero3_partition_runs(n, dist.get_world_size(group=group), dist.get_rank(group=group)), base)


def _param_runs(opt, states, keys, cache: Dict[str, object]) -> List[tuple]:
    """Per sub-group: [(param, {key: state file}, {key: runs})], runs of ``ceil(n / W)`` elements each."""
    out = []
    for fp16_group in opt.fp16_groups:
        entries = []
        for param in fp16_group:
            if param not in opt.param_names:
                raise ValueError("failed to find optimizer param in named params")
            name = opt.param_names[param]
            ps = cache.get(name) or states.param_states(name, 3)
            cache[name] = ps
            autotp = getattr(param, "ds_autotp_universal_checkpoint_meta", None)
            files, runs = {}, {}
            for key in keys:
                sf = ps.states.get(key)
                if sf is None:
                    raise CheckpointFormatError(f"{os.path.join(ps.folder, state_file(key))}: missing")
                files[key] = sf
                runs[key] = _state_runs(opt, param, sf, autotp)
            if len({sum(n for _, n in r) for r in runs.values()}) != 1:
                raise CheckpointFormatError(f"{ps.folder}: the state files hold different element counts")
            entries.append((param, files, runs))
        out.append(entries)
    return out


def _fill(tensor, entries, key: str) -> TensorFill:
    """The sub-group flat ``tensor`` overwritten whole: each parameter's runs at a running offset,
    zeros after the last one."""
    fill = TensorFill(tensor)
    offset = 0
    for _, files, runs in entries:
        sf = files[key]
        offset += fill.add(sf.source, sf.tensor, runs[key], offset)
    fill.add(None, None, [(None, fill.numel - offset)], offset)
    return fill


def _repoint(opt) -> None:
    for g in range(len(opt.fp16_partitioned_groups_flat)):
        updated = opt.unflatten(opt.fp16_partitioned_groups_flat[g], opt.fp16_partitioned_groups[g])
        for partitioned_param, q in zip(opt.fp16_partitioned_groups[g], updated):
            partitioned_param.data = q.data


def plan(opt, checkpoint_dir: str, load_optimizer_states: bool, load_from_fp32_weights: bool, states=None):
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "swap_param", False) or \
            getattr(opt, "offload_param", False) and getattr(opt, "params_in_nvme_and_cpu", False):
        raise Unsupported("NVMe-swapped optimizer or parameter state")
    states = states or FolderStates(checkpoint_dir)
    if not load_optimizer_states:
        return _plan_module_only(opt, states, load_from_fp32_weights)
    gs = states.global_state(3)
    n_live = len(opt.optimizer.param_groups)
    if n_live != len(gs.param_groups):
        raise CheckpointFormatError(f"{gs.path}: {len(gs.param_groups)} optimizer param groups, but the optimizer "
                                    f"being loaded has {n_live}")
    scaler = loss_scaler(gs.raw["loss_scaler"], None, gs.path) if "loss_scaler" in gs.raw else None
    per_group = _param_runs(opt, states, TENSOR_STATES, {})
    extra = sorted({k for entries in per_group for _, files, _ in entries for k in files} - {"fp32"})

    def apply(workers: int = 0) -> int:
        import torch

        if "loss_scaler" in gs.raw:
            opt.loss_scaler = scaler
        opt.dynamic_loss_scale = gs.raw.get("dynamic_loss_scale", opt.dynamic_loss_scale)
        opt.overflow = gs.raw.get("overflow", opt.overflow)
        nbytes = 0
        for g, entries in enumerate(per_group):
            flat = opt.fp32_partitioned_groups_flat[g]
            fill = _fill(flat, entries, "fp32")
            fill.run(workers)
            nbytes += fill.bytes_read
            step = gs.step
            opt.optimizer.state[flat]["step"] = step.clone() if torch.is_tensor(step) else step
            for key in MOMENTS + tuple(k for k in extra if k not in TENSOR_STATES):
                # _fill writes every element, zeros included
                buffer = state_buffer(opt.optimizer.state[flat], key, flat)
                fill = _fill(buffer, entries, key)
                fill.run(workers)
                nbytes += fill.bytes_read
                opt.optimizer.state[flat][key] = buffer
        for group, ckpt_group in zip(opt.optimizer.param_groups, gs.param_groups):
            for key, value in ckpt_group.items():
                if key not in LIVE_GROUP_KEYS:
                    group[key] = [] if key == "params" else value
        for g in range(len(opt.fp32_partitioned_groups_flat)):
            fp32 = opt.fp32_partitioned_groups_flat[g]
            if sum(fp32.size()) > 0:
                opt.fp16_partitioned_groups_flat[g].data.copy_(fp32.data)
        _repoint(opt)
        return nbytes

    return apply


def _plan_module_only(opt, states, load_from_fp32_weights: bool):
    for g, flat in enumerate(opt.fp16_partitioned_groups_flat):
        if flat is None:
            raise RuntimeError("ZeRO-3 universal module-only checkpoint load requires available parameter "
                               f"partitions for subgroup {g}.")
    per_group = _param_runs(opt, states, ("fp32", ), {})

    def apply(workers: int = 0) -> int:
        nbytes = 0
        for g, entries in enumerate(per_group):
            targets = [opt.fp16_partitioned_groups_flat[g]]
            if load_from_fp32_weights:
                targets.append(opt.fp32_partitioned_groups_flat[g])
            for t in targets:
                fill = _fill(t, entries, "fp32")
                fill.run(workers)
                nbytes += fill.bytes_read
        if not load_from_fp32_weights:
            opt.refresh_fp32_params()
        _repoint(opt)
        return nbytes

    return apply
