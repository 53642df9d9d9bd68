"""ZeRO stage 1/2 → Universal: the copy plan, following DeepSpeed 0.19.8's ds_to_universal.

Each dp rank's optimizer shard holds a flat fp32 partition per param group (padding stripped) and
flat Adam moments of the same layout; ``param_slice_mappings[g][name] = (start, numel)`` says where
a parameter's fragment sits in that rank's partition. A parameter's universal tensor is the
concatenation of its fragments in dp order, reshaped to ``param_shapes``. Every fragment is a
contiguous byte range, so the whole conversion is a list of byte copies.
"""

from __future__ import annotations

import os
import re
import warnings
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from .discovery import ZeroCheckpoint
from . import autoep
from ..errors import AutoEPError, CheckpointFormatError, UnsupportedCheckpointError
from ..native import CONVERT_TO_F32
from ..planning.plan import Piece, Plan, Segments
from ..formats.pickle_read import ITEMSIZE, TensorRef, numel
from ..formats.pickle_write import NewTensor
from .tp_merge import Slice, TpMergeError, TpRules

STATES = ("fp32", "exp_avg", "exp_avg_sq")
# ds_to_universal drops these from rank 0's optimizer state when it writes zero/optimizer_state.pt:
# they are per-rank and are rebuilt by the loader from the per-parameter files.
SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")



def flatten_param_shapes(model_file) -> "OrderedDict[str, tuple]":
    groups = model_file.load().get("param_shapes")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointFormatError(f"{model_file.path}: param_shapes must be a list of dicts (is this a ZeRO "
                                    "checkpoint?)")
    out = OrderedDict()
    for g in groups:
        out.update(g)
    return out


def universal_checkpoint_info(ck: ZeroCheckpoint, inject_missing_state: bool):
    info = ck.model[0].load().get("universal_checkpoint_info")
    if info is None:
        if not inject_missing_state:
            raise CheckpointFormatError(
                f"{ck.model[0].path}: Required universal_checkpoint_info state is missing in checkpoint. Verify "
                "that client creates this state (save with client_state={'universal_checkpoint_info': {}}), or "
                "pass --inject_missing_state")
        info = {"universal_checkpoint_version": 0.4}
    return info


def step_value(sf, step):
    """A comparable value of an Adam step (0-d tensor or number)."""
    if isinstance(step, TensorRef):
        off, nbytes = sf.tensor_byte_range(step)
        return (step.dtype, sf.read_bytes(off, nbytes))
    return step


def step_output(sf, step):
    """The step as step.pt holds it: a copy of the 0-d tensor, or the number itself."""
    if isinstance(step, TensorRef):
        off, nbytes = sf.tensor_byte_range(step)
        return NewTensor(step.dtype, step.shape, [Piece(sf, off, nbytes, 0)], step.requires_grad)
    return step


def _fragments(shards) -> Dict[str, List[Tuple[int, int, int, int]]]:
    """name -> [(dp rank, group, start, numel)] in dp order, from one mp rank's shards."""
    out: Dict[str, List[Tuple[int, int, int, int]]] = {}
    for rank, (sf, osd) in enumerate(shards):
        mappings = osd.get("param_slice_mappings")
        state = osd["base_optimizer_state"].get("state")
        fp32 = osd.get("single_partition_of_fp32_groups")
        if mappings is None or state is None or fp32 is None:
            raise CheckpointFormatError(f"{sf.path}: ZeRO-1/2 optimizer shard lacks param_slice_mappings, "
                                        "base_optimizer_state['state'] or single_partition_of_fp32_groups")
        for g in range(len(state)):
            if g >= len(mappings) or g >= len(fp32):
                raise CheckpointFormatError(f"{sf.path}: optimizer state has group {g} but the shard has only "
                                            f"{len(mappings)} slice mappings / {len(fp32)} fp32 partitions")
            for name, frag in mappings[g].items():
                out.setdefault(name, []).append((rank, g, int(frag.start), int(frag.numel)))
    return out


def _state_segments(name, state_name, frags, shards) -> Tuple[Segments, str, bool]:
    seg, dtype, requires_grad = Segments(), None, False
    for rank, g, start, count in frags:
        sf, osd = shards[rank]
        src = (osd["single_partition_of_fp32_groups"][g]
               if state_name == "fp32" else osd["base_optimizer_state"]["state"][g].get(state_name))
        if not isinstance(src, TensorRef):
            raise CheckpointFormatError(f"{sf.path}: group {g} has no {state_name} tensor for {name}")
        if dtype is None:
            dtype = src.dtype
        elif src.dtype != dtype:
            raise CheckpointFormatError(f"{sf.path}: {state_name} of {name} is {src.dtype} here but {dtype} on a "
                                        "lower dp rank")
        requires_grad |= src.requires_grad
        seg.append(sf, *sf.tensor_byte_range(src, start, count))
    return seg, dtype, requires_grad


def plan_zero12(ck: ZeroCheckpoint, plan: Plan, inject_missing_state: bool = False,
                dense_only: bool = False, strict: bool = True) -> Dict[str, int]:
    info = universal_checkpoint_info(ck, inject_missing_state)
    rules = TpRules(info, ck.tp, ck.folder, ck.model[0].path)
    per_mp_shapes = [flatten_param_shapes(mf) for mf in ck.model]
    layers, data_before_expert = autoep.aggregate_zero12(ck.model)
    expert_file_names = autoep.expert_files_in(ck.folder)
    if layers is None and expert_file_names and not dense_only:
        raise AutoEPError(
            f"{ck.folder}: found {len(expert_file_names)} per-expert files (e.g. {expert_file_names[0]}) but no AutoEP "
            "metadata (ds_autoep_layers): these are native DeepSpeed-MoE / Megatron-DeepSpeed experts, which need a "
            "model-specific migration to the AutoEP layout. Pass --dense-only to convert the dense parameters and "
            "leave the experts out (what ds_to_universal.py does).")
    if layers is not None and ck.tp * ck.pp != 1:
        raise UnsupportedCheckpointError(f"{ck.folder}: ZeRO-1/2 Universal Checkpoint conversion for AutoEP with "
                                         f"tensor or pipeline parallelism (tp={ck.tp}, pp={ck.pp}) is not supported.")
    grid = [[(sf, sf.load()["optimizer_state_dict"]) for sf in row] for row in ck.optim_grid]
    frags_by_mp = [_fragments(shards) for shards in grid]
    replicated_pp = list(info.get("pipeline_replicated_parameter_patterns") or [])

    # name -> per-tp shape (pipeline stages of one tp rank must agree), in DeepSpeed's union
    per_tp: Dict[str, List[Optional[tuple]]] = {}
    for m, shapes in enumerate(per_mp_shapes):
        pp, t = divmod(m, ck.tp)
        for name, shape in shapes.items():
            lst = per_tp.setdefault(name, [None] * ck.tp)
            shape = tuple(int(d) for d in shape)
            if lst[t] is not None and lst[t] != shape:
                raise CheckpointFormatError(f"{ck.folder}: Pipeline replicas of {name} on tp rank {t} disagree on "
                                            f"shape: {lst[t]} vs {shape}.")
            lst[t] = shape

    shards0 = grid[0]
    written = set()
    experts = set()
    if layers is not None:
        expert_files = autoep.check_expert_files(ck.folder, layers)
        experts = autoep.plan_zero12_experts(ck, plan, shards0, frags_by_mp[0], per_mp_shapes[0], layers,
                                             data_before_expert, expert_files)
        written |= experts
    elif expert_file_names:  # dense_only: leave out what lives in expert-parallel param groups
        experts = _expert_group_params([osd for row in grid for _, osd in row], ck.dp)
        written |= experts
        plan.notes.append(f"  dense only: {len(experts)} expert parameter(s) and {len(expert_file_names)} native "
                          "MoE expert files left out")
    params = len(experts) if layers is not None else 0
    for name, shapes in per_tp.items():
        if name in experts:
            continue
        sources = []  # per tp rank: (mp index, frags) of the stage that holds it
        for t in range(ck.tp):
            holders = []
            for pp in range(ck.pp):
                if pp > 0 and any(re.match(p, name) for p in replicated_pp):
                    continue  # tied weights replicated on the last stage are taken from the first
                m = pp * ck.tp + t
                if frags_by_mp[m].get(name):
                    holders.append((m, frags_by_mp[m][name]))
            sources.append(holders)
        if not any(sources):
            continue  # no optimizer state: the module fallback below writes fp32.pt, as DeepSpeed does
        params += 1
        written.add(name)
        for state_name in STATES:
            slices = []
            for t, holders in enumerate(sources):
                shape = shapes[t]
                if shape is None and not holders:
                    shape = rules.empty_shard_shape(name, t)
                if not holders:
                    if shape is None or numel(shape) != 0:
                        raise CheckpointFormatError(f"{ck.folder}: No fragments for tp rank {t} of {name}, whose "
                                                    f"recorded shape {shape} is not empty.")
                    slices.append(Slice(Segments(), shape, "float32"))
                    continue
                segs = [(_state_segments(name, state_name, fr, grid[m]), m) for m, fr in holders]
                (seg, dtype, rg), m0 = segs[0]
                for (other, _, _), m in segs[1:]:
                    if other.read() != seg.read():
                        raise CheckpointFormatError(f"{ck.folder}: {name} is held by pipeline stages "
                                                    f"{[m // ck.tp for _, m in segs]} of tp rank {t} with different "
                                                    "values and no pipeline_replicated_parameter_patterns entry")
                if seg.nbytes != numel(shape) * ITEMSIZE[dtype]:
                    raise CheckpointFormatError(f"{ck.folder}: the fragments of {name} on tp rank {t} hold "
                                                f"{seg.nbytes // ITEMSIZE[dtype]} elements, but param_shapes says "
                                                f"{shape}")
                slices.append(Slice(seg, shape, dtype, rg))
            for s in slices:  # empty placeholders take the dtype of the real slices
                if not s.seg.nbytes:
                    s.dtype = next((x.dtype for x in slices if x.seg.nbytes), s.dtype)
            merged = rules.merge(name, slices, state_name)
            if merged is not None:
                plan.add_archive(f"zero/{name}/{state_name}.pt", merged)
        steps = []
        for holders in sources:
            tp_steps = []
            for m, fr in holders[:1]:
                for rank, g, _, _ in fr:
                    sf, osd = grid[m][rank]
                    group_state = osd["base_optimizer_state"]["state"][g]
                    if "step" in group_state:
                        tp_steps.append((sf, group_state["step"]))
            if tp_steps:
                values = [step_value(sf, s) for sf, s in tp_steps]
                if any(v != values[0] for v in values[1:]):
                    raise CheckpointFormatError(f"{ck.folder}: dp ranks disagree on the Adam step of {name}")
                steps.append(tp_steps[0])
        if steps:
            plan.add_archive(f"zero/{name}/step.pt", step_output(*steps[0]))

    unused = rules.unused()
    if unused:
        if strict:
            raise TpMergeError(f"{ck.folder}: Unused patterns={unused} while merging tp slices (no parameter "
                               "matches them; pass --no_strict to only warn)")
        warnings.warn(f"Unused patterns={unused} while merging tp slices", stacklevel=2)

    # DeepSpeed 0.19.8 writes {'param': module[name].float()} for every module entry that got no fp32.pt:
    # frozen parameters, tied aliases, buffers, parameters without optimizer fragments.
    fallback = 0
    for mf in ck.model:
        module = mf.load().get("module")
        if module is None:
            continue
        for name, t in module.items():
            if name in written or not isinstance(t, TensorRef):
                continue
            written.add(name)
            fallback += 1
            plan.add_archive(f"zero/{name}/fp32.pt", {"param": _as_float32(mf, name, t)})

    plan.add_archive("zero/optimizer_state.pt", _common_optimizer_state(shards0[0][1], ck.dp))
    for mf in ck.model:
        if layers is not None:
            autoep.resave_with_expert_patterns(plan, mf, autoep.ZERO12_PATTERNS, layers)
        else:
            plan.add_copy(mf, os.path.basename(mf.path))
    return {"params": params, "fallback_params": fallback, "experts": len(experts)}


def _expert_group_params(shard_states, dp: int) -> set:
    """Parameters of param groups partitioned over fewer ranks than dp: DeepSpeed-MoE expert groups."""
    names = set()
    for osd in shard_states:
        counts = osd.get("partition_count") or []
        for g, mapping in enumerate(osd.get("param_slice_mappings") or []):
            if g < len(counts) and int(counts[g]) != dp:
                names.update(mapping.keys())
    return names


def _as_float32(sf, name: str, t: TensorRef) -> NewTensor:
    kind = CONVERT_TO_F32.get(t.dtype)
    if kind is None:
        raise CheckpointFormatError(f"{sf.path}: module entry {name} has dtype {t.dtype}, which DeepSpeed's .float() "
                                    "fallback would convert but pyckpt cannot")
    off, nbytes = sf.tensor_byte_range(t)
    pieces = [Piece(sf, off, nbytes, 0, kind)] if nbytes else []
    return NewTensor("float32", t.shape, pieces, t.requires_grad)


def _common_optimizer_state(osd, dp: int):
    out = {}
    for key, value in osd.items():
        if key in SHARDED_KEYS:
            continue
        if key == "partition_count" and value:
            value = [dp] * len(value)
        elif key == "group_paddings" and value:
            value = [0] * len(value)
        out[key] = value
    out["param_groups"] = osd["base_optimizer_state"]["param_groups"]
    return out

