"""AutoEP experts of a ZeRO-1/2 checkpoint → universal expert files (DeepSpeed 0.19.8's
``consolidate_autoep_zero12_*`` in ``ds_to_universal``).

Under ZeRO-1/2 each EP rank's fused ``<prefix>.wN`` (its ``num_local_experts`` rows) lives in an
expert param group partitioned over the rank's expert-data-parallel group; the universal file
holds all ``num_experts`` rows in global expert order. Where the fp32 fragments fall short,
DeepSpeed 0.19.8 rebuilds the fp32 rows from the low-precision per-expert weight files, and so
does this; optimizer moments are best effort (a shard lacking one skips that state, with a warning).
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

from ...errors import AutoEPError
from ...tensors import ITEMSIZE, NewTensor, numel
from ...native import CONVERT_TO_F32
from ...planning.plan import Segments
from ...planning.state import TENSOR_STATES, CheckpointState
from ..optimizer_state import agreed_step
from ..shards import FlatGroup, Fragment, ZeroShard
from .layers import in_files, zero12_dp_ranks

Holding = Tuple[ZeroShard, FlatGroup, Fragment]


def plan_zero12_experts(ck, out: CheckpointState, fragments: Dict[str, List[Holding]], info, data_before_expert,
                        expert_files) -> set:
    """Universal expert files from the fp32 master fragments in the ZeRO shards of mp rank 0;
    ``info`` is zero12_param_info's record of each expert parameter (the caller has it already: its
    names are what the shard walk keeps holdings for), ``fragments`` maps each parameter to the
    (shard, group, fragment) holding it, in dp order."""
    meta_file = ck.model[0].path  # aggregate_zero12 required the model-state files to agree
    shapes = ck.model[0].shapes
    dp = ck.dp
    for name, meta in info.items():
        if name not in shapes:
            raise AutoEPError(f"{meta_file}: AutoEP expert parameter {name} is missing from checkpoint parameter shapes.")
        local_shape = shapes[name]
        if not local_shape:
            raise AutoEPError(f"{meta_file}: AutoEP local shape is empty for {name}.")
        if local_shape[0] != meta["num_local_experts"]:
            raise AutoEPError(f"{meta_file}: AutoEP local shape mismatch for {name}: shape={local_shape}, "
                              f"num_local_experts={meta['num_local_experts']}.")
        ep, n_exp = meta["ep_size"], meta["num_experts"]
        local_numel = numel(local_shape)
        by_rank = {held[0].dp_rank: held for held in fragments.get(name, [])}
        full_shape = (n_exp, ) + local_shape[1:]
        for state in out.wanted(TENSOR_STATES):
            ep_parts = []  # per EP rank: (Segments, dtype, requires_grad)
            absent = _absent_moment(state, by_rank)
            if absent:
                # Expert optimizer state is best effort: a loader can start the moments afresh,
                # but not the weights, so fp32 is still written.
                warnings.warn(f"AutoEP: skipped {state} of {name}: no {state} in {absent}", stacklevel=3)
                continue
            for e in range(ep):
                seg, requires_grad, paths = Segments(), False, []
                for r in zero12_dp_ranks(e, dp, ep, data_before_expert, meta_file):
                    if r not in by_rank:
                        continue
                    shard, group, frag = by_rank[r]
                    paths.append(shard.path)
                    src = group.tensor(state)
                    if src is None:
                        raise AutoEPError(f"AutoEP {state} fragment is not a tensor: {name} in {shard.path}")
                    if src.dtype != "float32":
                        raise AutoEPError(f"AutoEP {state} fragment must be FP32, got {src.dtype} for {name} in "
                                          f"{shard.path}.")
                    requires_grad |= src.requires_grad
                    seg.append(shard.file, *shard.file.tensor_byte_range(src, frag.start, frag.numel))
                got = seg.nbytes // 4
                if got == local_numel:
                    ep_parts.append((seg, "float32", requires_grad))
                    continue
                if state == "fp32" and got < local_numel:
                    # DeepSpeed 0.19.8 falls back to the per-expert weight files only here.
                    ep_parts.append(_expert_file_rows(meta, name, e, expert_files))
                    continue
                if got == 0:
                    raise AutoEPError(f"Missing AutoEP {state} fragments for {name}, EP rank {e}{in_files(paths, meta_file)}.")
                raise AutoEPError(f"AutoEP {state} fragment size mismatch for {name}, EP rank {e}: got {got}, "
                                  f"expected {local_numel}{in_files(paths, meta_file)}.")
            out.put(name, state, _expert_dict(ep_parts, full_shape, n_exp, meta_file))
        if not out.wants("step"):
            continue
        steps = [group.step for _, (_, group, _) in sorted(by_rank.items()) if group.step is not None]
        if not steps:
            raise AutoEPError(f"Missing AutoEP optimizer step for {name}"
                              f"{in_files([shard.path for shard in ck.optim], meta_file)}.")
        step = agreed_step(steps, lambda steps: AutoEPError(
            f"Inconsistent AutoEP optimizer steps for {name}{in_files([s.file.path for s in steps], meta_file)}."))
        out.put(name, "step", step.output())
    return set(info)


def _absent_moment(state, by_rank) -> Optional[str]:
    """The shard file lacking an Adam moment needed for a parameter, if any."""
    if state == "fp32":
        return None
    for _, (shard, group, _) in sorted(by_rank.items()):
        if group.tensor(state) is None:
            return shard.path
    return None


def _expert_file_rows(meta, name, ep_rank, expert_files):
    """One EP rank's rows rebuilt from the low-precision per-expert weight files (0.19.8's fallback)."""
    layer, weight = meta["layer"], name.rsplit(".", 1)[1]
    nl = meta["num_local_experts"]
    seg, dtype = Segments(), None
    for eid in range(ep_rank * nl, (ep_rank + 1) * nl):
        weights = expert_files[(layer.get("moe_layer_id"), eid)]
        t = weights.tensors[f"{layer['expert_key_prefix']}.{weight}.{eid}"]
        if dtype not in (None, t.dtype):
            raise AutoEPError(f"per-expert files of {name} mix dtypes {dtype} and {t.dtype} (at {weights.path})")
        dtype = t.dtype
        seg.append(weights.file, *weights.file.tensor_byte_range(t))
    return seg, dtype, False


def _expert_dict(ep_parts, full_shape, num_experts, where: str):
    # torch.cat promotes mixed dtypes: fallback rows (bf16) next to fp32 fragments come out fp32.
    dtypes = {d for _, d, _ in ep_parts}
    out_dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    pieces, dst = [], 0
    for seg, dtype, _ in ep_parts:
        kind = 0 if dtype == out_dtype else CONVERT_TO_F32[dtype]
        for p in seg.pieces(dst):
            p.kind = kind
            pieces.append(p)
        dst += seg.nbytes // ITEMSIZE[dtype] * ITEMSIZE[out_dtype]
    if dst != numel(full_shape) * ITEMSIZE[out_dtype]:
        raise AutoEPError(f"{where}: AutoEP consolidated expert count mismatch: got {dst // ITEMSIZE[out_dtype]} elements for "
                          f"shape {full_shape}")
    tensor = NewTensor(out_dtype, full_shape, pieces, any(rg for _, _, rg in ep_parts))
    return {"param": tensor, "cat_dim": 0, "is_expert_param": True, "ep_num_experts": num_experts}


