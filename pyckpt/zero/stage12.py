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
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..errors import AutoEPError, CheckpointFormatError, UnsupportedCheckpointError
from ..tensors import ITEMSIZE, NewTensor, numel
from ..formats.pickle_read import TensorRef
from ..native import CONVERT_TO_F32
from ..planning.plan import Piece, Segments
from ..planning.state import TENSOR_STATES, CheckpointState
from .autoep.layers import (ZERO12_PATTERNS, aggregate_zero12, check_expert_files, resaved_model_states,
                            zero12_param_info)
from .autoep.stage12 import Holding, plan_zero12_experts
from .discovery import ZeroCheckpoint, expert_files_in
from .optimizer_state import universal_optimizer_state
from .tp_merge import Slice, TpRules
from .shards import Step


def universal_checkpoint_info(ck: ZeroCheckpoint, inject_missing_state: bool):
    info = ck.model[0].universal_info
    if info is None:
        if not inject_missing_state:
            raise CheckpointFormatError(
                f"{ck.model[0].path}: Required universal_checkpoint_info state is missing in checkpoint. Verify "
                "that client creates this state (save with client_state={'universal_checkpoint_info': {}}), or "
                "pass --inject_missing_state")
        info = {"universal_checkpoint_version": 0.4}
    return info


@dataclass(slots=True)
class _Held:
    """One parameter's fragments on one mp rank, gathered in dp order: per wanted state its bytes
    (Segments), dtype and requires_grad; the step of the first rank that saved one, and whether a
    later rank's differs."""

    states: Dict[str, list]
    step: Optional[Step] = None
    steps_differ: bool = False


def _gather(row, wanted, dp: int, want_step: bool, keep: set, expert_groups: Optional[set]
            ) -> Tuple[Dict[str, _Held], Dict[str, List[Holding]]]:
    """One walk over an mp rank's shards (a ShardRow reads them as it goes): every parameter's byte
    ranges of each wanted state, so that no shard record outlives its turn. Parameters in ``keep``
    (AutoEP experts, planned by their own rules) get their (shard, group, fragment) holdings instead;
    with ``expert_groups`` (a set to fill), parameters of groups partitioned over fewer than dp ranks
    (DeepSpeed-MoE expert groups) are named there and not gathered."""
    held_by_name: Dict[str, _Held] = {}
    holdings: Dict[str, List[Holding]] = {}
    for shard in row:
        skipped = ()
        if expert_groups is not None:
            counts = shard.partition_counts
            skipped = {g for g in range(len(shard.slice_mappings)) if g < len(counts) and counts[g] != dp}
            for g in skipped:
                expert_groups.update(shard.slice_mappings[g])
        for group in shard.groups:
            if group.index in skipped:
                continue
            for name, frag in shard.slice_mappings[group.index].items():
                if name in keep:
                    holdings.setdefault(name, []).append((shard, group, frag))
                    continue
                held = held_by_name.get(name)
                if held is None:
                    held = held_by_name[name] = _Held({s: [Segments(), None, False] for s in wanted})
                for state_name, acc in held.states.items():
                    src = group.tensor(state_name)
                    if src is None:
                        raise CheckpointFormatError(f"{shard.path}: group {group.index} has no {state_name} tensor "
                                                    f"for {name}")
                    if acc[1] is None:
                        acc[1] = src.dtype
                    elif src.dtype != acc[1]:
                        raise CheckpointFormatError(f"{shard.path}: {state_name} of {name} is {src.dtype} here but "
                                                    f"{acc[1]} on a lower dp rank")
                    acc[2] |= src.requires_grad
                    acc[0].append(shard.file, *shard.file.tensor_byte_range(src, frag.start, frag.numel))
                step = group.step if want_step else None
                if step is not None:
                    if held.step is None:
                        held.step = step
                    elif not held.steps_differ and step.key() != held.step.key():
                        held.steps_differ = True
    return held_by_name, holdings


def plan_zero12(ck: ZeroCheckpoint, state: CheckpointState, inject_missing_state: bool = False,
                dense_only: bool = False, strict: bool = True) -> Dict[str, int]:
    info = universal_checkpoint_info(ck, inject_missing_state)
    rules = TpRules(info, ck.tp, ck.folder, ck.model[0].path)
    layers, data_before_expert = aggregate_zero12(ck.model)
    expert_file_names = expert_files_in(ck.names)
    if layers is None and expert_file_names and not dense_only:
        raise AutoEPError(
            f"{ck.folder}: found {len(expert_file_names)} per-expert files (e.g. {expert_file_names[0]}) but no AutoEP "
            "metadata (ds_autoep_layers): these are native DeepSpeed-MoE / Megatron-DeepSpeed experts, which need a "
            "model-specific migration to the AutoEP layout. Pass --dense-only to convert the dense parameters and "
            "leave the experts out (what ds_to_universal.py does).")
    if layers is not None and ck.tp * ck.pp != 1:
        raise UnsupportedCheckpointError(f"{ck.folder}: ZeRO-1/2 Universal Checkpoint conversion for AutoEP with "
                                         f"tensor or pipeline parallelism (tp={ck.tp}, pp={ck.pp}) is not supported.")
    replicated_pp = list(info.get("pipeline_replicated_parameter_patterns") or [])

    # name -> per-tp shape (pipeline stages of one tp rank must agree), in DeepSpeed's union
    per_tp: Dict[str, List[Optional[tuple]]] = {}
    for m, ms in enumerate(ck.model):
        pp, t = divmod(m, ck.tp)
        for name, shape in ms.shapes.items():
            lst = per_tp.setdefault(name, [None] * ck.tp)
            if lst[t] is not None and lst[t] != shape:
                raise CheckpointFormatError(f"{ck.folder}: Pipeline replicas of {name} on tp rank {t} disagree on "
                                            f"shape: {lst[t]} vs {shape}.")
            lst[t] = shape

    written = set()
    experts = set()
    expert_files = check_expert_files(ck.folder, ck.names, layers) if layers is not None else None
    autoep_info = zero12_param_info(layers, ck.model[0].path) if layers is not None else {}
    # dense_only: leave out what lives in expert-parallel param groups
    expert_groups = set() if layers is None and expert_file_names else None
    wanted = state.wanted(TENSOR_STATES)
    gathered, holdings = [], {}
    for row in ck.optim_grid:  # AutoEP has one row (tp = pp = 1, checked above)
        held, holdings = _gather(row, wanted, ck.dp, state.wants("step"), autoep_info.keys(), expert_groups)
        gathered.append(held)
    if layers is not None:
        experts = plan_zero12_experts(ck, state, holdings, autoep_info, data_before_expert, expert_files)
        written |= experts
    elif expert_groups is not None:
        experts = expert_groups
        written |= experts
        state.notes.append(f"  dense only: {len(experts)} expert parameter(s) and {len(expert_file_names)} native "
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
                if name in gathered[m]:
                    holders.append((m, gathered[m][name]))
            sources.append(holders)
        if not any(sources):
            continue  # no optimizer state: the module fallback below writes fp32.pt, as DeepSpeed does
        params += 1
        written.add(name)
        for state_name in wanted:
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
                segs = [(held.states[state_name], m) for m, held in holders]
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
                state.put(name, state_name, merged)
        for m in range(len(gathered)):
            gathered[m].pop(name, None)  # its byte ranges are pieces now
        if not state.wants("step"):
            continue
        # On each tp rank the dp ranks of the first stage holding the parameter must agree on its
        # step; DeepSpeed writes the first tp rank's.
        for held in (holders[0][1] for holders in sources if holders):
            if held.steps_differ:
                raise CheckpointFormatError(f"{ck.folder}: dp ranks disagree on the Adam step of {name}")
        step = next((holders[0][1].step for holders in sources if holders and holders[0][1].step is not None), None)
        if step is not None:
            state.put(name, "step", step.output())

    rules.check_unused(strict)

    # DeepSpeed 0.19.8 writes {'param': module[name].float()} for every module entry that got no fp32.pt:
    # frozen parameters, tied aliases, buffers, parameters without optimizer fragments.
    fallback = 0
    for mf in ck.model:
        for name, t in mf.module.items():
            if name in written:
                continue
            written.add(name)
            fallback += 1
            if state.wants("fp32"):
                state.put(name, "fp32", {"param": _as_float32(mf.file, name, t)})

    state.put_optimizer(universal_optimizer_state(ck.optim[0], ck.dp))
    for mf in ck.model:
        if layers is not None:
            state.put_model_file(os.path.basename(mf.path), resaved_model_states(mf, ZERO12_PATTERNS, layers))
        else:
            state.copy_model_file(os.path.basename(mf.path), mf.file)
    return {"params": params, "fallback_params": fallback, "experts": len(experts)}


def _as_float32(sf, name: str, t: TensorRef) -> NewTensor:
    kind = CONVERT_TO_F32.get(t.dtype)
    if kind is None:
        raise CheckpointFormatError(f"{sf.path}: module entry {name} has dtype {t.dtype}, which DeepSpeed's .float() "
                                    "fallback would convert but pyckpt cannot")
    off, nbytes = sf.tensor_byte_range(t)
    pieces = [Piece(sf, off, nbytes, 0, kind)] if nbytes else []
    return NewTensor("float32", t.shape, pieces, t.requires_grad)
