"""AutoEP (DeepSpeed's automatic expert parallelism): expert consolidation and load-side rules.

An AutoEP layer keeps its routed experts as three fused parameters ``<prefix>.w1/w2/w3`` whose
first dimension is the expert. Each EP rank trains its own ``num_local_experts`` rows, and ZeRO
partitions them again over the ranks of its expert-data-parallel (EDP) group. A universal expert
file holds all ``num_experts`` rows in global expert order, tagged ``is_expert_param`` and
``ep_num_experts`` so a loader can take rows ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``.

Conversion follows DeepSpeed 0.19.8's ds_to_universal (ZeRO-1/2: ``consolidate_autoep_zero12_*``;
ZeRO-3: the partition-native format), keeping the seed's safety checks: a per-expert file that the
metadata promises must exist, two ``mp_rank`` files for one expert are refused, and per-expert
files without metadata (native DeepSpeed-MoE) are refused unless the caller asks to convert only
the dense part.
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import AutoEPError, CheckpointFormatError, MissingExpertFileError, UnsupportedCheckpointError
from .names import check_param_name
from ..native import CONVERT_TO_F32
from ..planning.plan import Plan, Segments
from ..formats.pickle_read import ITEMSIZE, TensorRef, numel
from ..formats.pickle_write import NewTensor
from .zero3_partition import rank_pieces

WEIGHTS = ("w1", "w2", "w3")
STATES = ("fp32", "exp_avg", "exp_avg_sq")
# Fields DeepSpeed keeps of each layer entry when it aggregates ZeRO-1/2 metadata (and writes back).
ZERO12_FIELDS = ("moe_layer_id", "module_path", "expert_key_prefix", "num_experts", "num_local_experts", "ep_size")
REQUIRED_FIELDS = ("expert_key_prefix", "num_experts", "num_local_experts", "ep_size")
ZERO3_REQUIRED = {"moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix"}
ZERO3_PARTITIONED_REQUIRED = {"checkpoint_format_version", "ep_group_name", "ep_rank", "expert_data_parallel_rank",
                              "expert_data_parallel_world_size", "global_expert_start", "global_expert_end"}
ZERO12_PATTERNS = [r"\.experts\.w[123]$"]
ZERO3_PATTERNS = [r".*\.experts\.w[123]$"]


def layers_of(model_state) -> object:
    """``ds_autoep_layers``, or the legacy ``autoep_layers`` key."""
    meta = model_state.get("ds_autoep_layers")
    if meta is None:
        meta = model_state.get("autoep_layers")
    return meta


def expert_files_in(folder: str) -> List[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("layer_") and "_expert_" in n
                  and n.endswith("_model_states.pt"))


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ----------------------------------------------------------------------------------------------
# ZeRO-1/2
# ----------------------------------------------------------------------------------------------


def aggregate_zero12(model_files) -> Tuple[Optional[list], bool]:
    """DeepSpeed's ``_aggregate_autoep_zero12_metadata`` over the mp_rank files."""
    by_prefix: Dict[str, dict] = {}
    source: Dict[str, str] = {}
    ordering: Dict[str, bool] = {}
    for mf in model_files:
        state = mf.load()
        meta = layers_of(state)
        if meta is not None:
            if not isinstance(meta, list):
                raise AutoEPError(f"AutoEP metadata must be a list in {mf.path}.")
            for entry in meta:
                if not isinstance(entry, dict):
                    raise AutoEPError(f"AutoEP layer metadata must contain dictionaries in {mf.path}.")
                light = {k: entry[k] for k in ZERO12_FIELDS if k in entry}
                prefix = light.get("expert_key_prefix")
                if not isinstance(prefix, str) or not prefix:
                    raise AutoEPError(f"AutoEP expert_key_prefix must be a non-empty string in {mf.path}.")
                if prefix in by_prefix and by_prefix[prefix] != light:
                    raise AutoEPError(f"Conflicting AutoEP metadata for expert_key_prefix {prefix!r} in "
                                      f"{source[prefix]} and {mf.path}.")
                if prefix not in by_prefix:
                    by_prefix[prefix] = light
                    source[prefix] = mf.path
        config = state.get("ds_config", {})
        if not isinstance(config, dict):
            raise AutoEPError(f"DeepSpeed checkpoint ds_config must be a dictionary in {mf.path}.")
        flag = config.get("use_data_before_expert_parallelism", False)
        if not isinstance(flag, bool):
            raise AutoEPError(f"DeepSpeed checkpoint use_data_before_expert_parallelism must be a boolean in "
                              f"{mf.path}.")
        ordering[mf.path] = flag
    if len(set(ordering.values())) > 1:
        raise AutoEPError(f"DeepSpeed checkpoint use_data_before_expert_parallelism disagrees across model-state "
                          f"files: {ordering}")
    return (list(by_prefix.values()) or None), next(iter(ordering.values()), False)


def zero12_param_info(layers: list, where: str = "AutoEP metadata") -> Dict[str, dict]:
    """DeepSpeed's ``get_autoep_zero12_expert_param_info`` (uniform placement: what ZeRO-1/2 keeps).

    ``where`` names the model-states file the metadata came from, for the errors."""
    if not isinstance(layers, list) or not layers:
        raise AutoEPError(f"{where}: AutoEP metadata must be a non-empty list for ZeRO-1/2 universal conversion.")
    out: Dict[str, dict] = {}
    for entry in layers:
        missing = [f for f in REQUIRED_FIELDS if f not in entry]
        if missing:
            raise AutoEPError(f"{where}: AutoEP layer metadata is missing fields: {missing}")
        prefix = entry["expert_key_prefix"]
        for f in ("num_experts", "ep_size"):
            if not _positive_int(entry[f]):
                raise AutoEPError(f"{where}: AutoEP {f} must be a positive integer, got {entry[f]!r}.")
        nl = entry["num_local_experts"]
        if not _positive_int(nl):
            raise AutoEPError(f"{where}: AutoEP num_local_experts must be a positive integer, got {nl!r}.")
        if entry["num_experts"] != nl * entry["ep_size"]:
            raise AutoEPError(f"{where}: AutoEP expert count mismatch for {prefix}: num_experts={entry['num_experts']}, "
                              f"num_local_experts={nl}, ep_size={entry['ep_size']}.")
        for w in WEIGHTS:
            name = check_param_name(f"{prefix}.{w}", f"{where} (ds_autoep_layers)", "expert parameter")
            if name in out:
                raise AutoEPError(f"{where}: Duplicate AutoEP expert parameter metadata for {name}.")
            out[name] = {"num_experts": entry["num_experts"], "num_local_experts": nl, "ep_size": entry["ep_size"],
                         "layer": entry}
    return out


def zero12_dp_ranks(ep_rank: int, dp: int, ep: int, data_before_expert: bool, where: str = "AutoEP metadata") -> range:
    """The ZeRO dp ranks holding one EP rank's expert partitions (DeepSpeed's group layout)."""
    if dp % ep != 0:
        raise AutoEPError(f"{where}: ZeRO DP degree {dp} is not divisible by AutoEP size {ep}.")
    if data_before_expert:
        edp = dp // ep
        return range(ep_rank * edp, (ep_rank + 1) * edp)
    return range(ep_rank, dp, ep)


def check_expert_files(folder: str, layers: list) -> Dict[Tuple[int, int], object]:
    """Every (layer, expert) the metadata promises has exactly one per-expert file with its keys."""
    from ..formats.torch_zip import SourceFile

    found = {}
    for entry in layers:
        layer_id = entry.get("moe_layer_id")
        prefix = entry["expert_key_prefix"]
        for eid in range(entry["num_experts"]):
            matches = sorted(glob.glob(os.path.join(glob.escape(folder),
                                                    f"layer_{layer_id}_expert_{eid}_mp_rank_*_model_states.pt")))
            if not matches:
                raise MissingExpertFileError(f"Expert checkpoint file not found: layer_{layer_id} expert_{eid} in "
                                             f"{folder} (the AutoEP metadata of {prefix} promises {entry['num_experts']} "
                                             "experts)")
            if len(matches) > 1:
                folded = any(isinstance(SourceFile(m).load(), dict) and "folding" in SourceFile(m).load()
                             for m in matches)
                if folded:
                    raise UnsupportedCheckpointError(
                        f"Universal checkpoint conversion for folded AutoEP+AutoTP expert shards is not supported: "
                        f"{[os.path.basename(m) for m in matches]}")
                raise UnsupportedCheckpointError(
                    f"Multiple expert checkpoint files found for layer_{layer_id} expert_{eid}: "
                    f"{[os.path.basename(m) for m in matches]}. Multi-mp_rank expert files are not supported.")
            sf = SourceFile(matches[0])
            state = sf.load()
            for w in WEIGHTS:
                key = f"{prefix}.{w}.{eid}"
                if not isinstance(state, dict) or key not in state:
                    raise AutoEPError(f"Expected key '{key}' not found in {sf.path}")
            found[(layer_id, eid)] = sf
    return found


def plan_zero12_experts(ck, plan: Plan, shards, fragments, shapes, layers, data_before_expert,
                        expert_files) -> set:
    """Universal expert files from the fp32 master fragments in the ZeRO shards."""
    meta_file = ck.model[0].path  # aggregate_zero12 required the model-state files to agree
    info = zero12_param_info(layers, meta_file)
    dp = ck.dp
    for name, meta in info.items():
        if name not in shapes:
            raise AutoEPError(f"{meta_file}: AutoEP expert parameter {name} is missing from checkpoint parameter shapes.")
        local_shape = tuple(int(d) for d in shapes[name])
        if not local_shape:
            raise AutoEPError(f"{meta_file}: AutoEP local shape is empty for {name}.")
        if local_shape[0] != meta["num_local_experts"]:
            raise AutoEPError(f"{meta_file}: AutoEP local shape mismatch for {name}: shape={local_shape}, "
                              f"num_local_experts={meta['num_local_experts']}.")
        ep, n_exp = meta["ep_size"], meta["num_experts"]
        local_numel = numel(local_shape)
        by_rank = {rank: (g, start, count) for rank, g, start, count in fragments.get(name, [])}
        full_shape = (n_exp, ) + local_shape[1:]
        for state in STATES:
            ep_parts = []  # per EP rank: (Segments, dtype, requires_grad)
            absent = _absent_moment(state, name, by_rank, shards)
            if absent:
                # The seed's policy: expert optimizer state is best effort; fp32 is still written.
                warnings.warn(f"AutoEP: skipped {state} of {name}: no {state} in {absent}", stacklevel=3)
                continue
            for e in range(ep):
                seg, requires_grad, paths = Segments(), False, []
                for r in zero12_dp_ranks(e, dp, ep, data_before_expert, meta_file):
                    if r not in by_rank:
                        continue
                    g, start, count = by_rank[r]
                    sf, osd = shards[r]
                    paths.append(sf.path)
                    src = (osd["single_partition_of_fp32_groups"][g]
                           if state == "fp32" else osd["base_optimizer_state"]["state"][g].get(state))
                    if not isinstance(src, TensorRef):
                        raise AutoEPError(f"AutoEP {state} fragment is not a tensor: {name} in {sf.path}")
                    if src.dtype != "float32":
                        raise AutoEPError(f"AutoEP {state} fragment must be FP32, got {src.dtype} for {name} in "
                                          f"{sf.path}.")
                    requires_grad |= src.requires_grad
                    seg.append(sf, *sf.tensor_byte_range(src, start, count))
                got = seg.nbytes // 4
                if got == local_numel:
                    ep_parts.append((seg, "float32", requires_grad))
                    continue
                if state == "fp32" and got < local_numel:
                    # DeepSpeed 0.19.8 falls back to the per-expert weight files only here.
                    ep_parts.append(_expert_file_rows(meta, name, e, expert_files))
                    continue
                if got == 0:
                    raise AutoEPError(f"Missing AutoEP {state} fragments for {name}, EP rank {e}{_in(paths, meta_file)}.")
                raise AutoEPError(f"AutoEP {state} fragment size mismatch for {name}, EP rank {e}: got {got}, "
                                  f"expected {local_numel}{_in(paths, meta_file)}.")
            plan.add_archive(f"zero/{name}/{state}.pt", _expert_dict(ep_parts, full_shape, n_exp, meta_file))
        steps = []
        for r in range(dp):
            if r in by_rank:
                sf, osd = shards[r]
                group_state = osd["base_optimizer_state"]["state"][by_rank[r][0]]
                if "step" in group_state:
                    steps.append((sf, group_state["step"]))
        if not steps:
            raise AutoEPError(f"Missing AutoEP optimizer step for {name}{_in([sf.path for sf, _ in shards.values()], meta_file)}.")
        from .zero12 import step_output, step_value
        values = [step_value(sf, s) for sf, s in steps]
        if any(v != values[0] for v in values[1:]):
            raise AutoEPError(f"Inconsistent AutoEP optimizer steps for {name}{_in([sf.path for sf, _ in steps], meta_file)}.")
        plan.add_archive(f"zero/{name}/step.pt", step_output(*steps[0]))
    return set(info)


def _in(paths, fallback: str) -> str:
    """' (in FILE)' naming the files an inconsistency was found across (at most three), so a refusal
    points at a file even when the rule spans several."""
    paths = list(dict.fromkeys(paths)) or [fallback]
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return f" (in {shown})"


def _absent_moment(state, name, by_rank, shards) -> Optional[str]:
    """The shard file lacking an Adam moment needed for ``name``, if any."""
    if state == "fp32":
        return None
    for r, (g, _, _) in sorted(by_rank.items()):
        sf, osd = shards[r]
        if not isinstance(osd["base_optimizer_state"]["state"].get(g, {}).get(state), TensorRef):
            return sf.path
    return None


def _expert_file_rows(meta, name, ep_rank, expert_files):
    """One EP rank's rows rebuilt from the low-precision per-expert weight files (0.19.8's fallback)."""
    layer, weight = meta["layer"], name.rsplit(".", 1)[1]
    nl = meta["num_local_experts"]
    seg, dtype = Segments(), None
    for eid in range(ep_rank * nl, (ep_rank + 1) * nl):
        sf = expert_files[(layer.get("moe_layer_id"), eid)]
        t = sf.load()[f"{layer['expert_key_prefix']}.{weight}.{eid}"]
        if dtype not in (None, t.dtype):
            raise AutoEPError(f"per-expert files of {name} mix dtypes {dtype} and {t.dtype} (at {sf.path})")
        dtype = t.dtype
        seg.append(sf, *sf.tensor_byte_range(t))
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


def resave_with_expert_patterns(plan: Plan, sf, patterns, layers) -> None:
    """Copy a model-state file with ``universal_checkpoint_info`` extended as DeepSpeed does."""
    state = dict(sf.load())
    info = state.get("universal_checkpoint_info")
    info = dict(info) if isinstance(info, dict) else {}
    info["expert_parameter_patterns"] = list(patterns)
    info["ds_autoep_layers"] = layers
    state["universal_checkpoint_info"] = info
    plan.add_archive(os.path.basename(sf.path), state)


# ----------------------------------------------------------------------------------------------
# ZeRO-3 (partition-native)
# ----------------------------------------------------------------------------------------------


def is_partitioned(entry) -> bool:
    return isinstance(entry, dict) and entry.get("checkpoint_format") == "zero3_partitioned"


def validate_zero3(meta, where: str, require_partitioned: bool) -> List[dict]:
    """DeepSpeed's ``validate_autoep_zero3_partitioned_metadata``; returns each entry's placement."""
    if not isinstance(meta, list):
        raise AutoEPError(f"{where}: ds_autoep_layers metadata is malformed: expected list, got "
                          f"{type(meta).__name__}")
    seen_ids, seen_prefixes, placements, partitioned = set(), set(), [], 0
    for entry in meta:
        if not isinstance(entry, dict):
            raise AutoEPError(f"{where}: ds_autoep_layers entry is malformed: expected dict, got "
                              f"{type(entry).__name__}")
        missing = ZERO3_REQUIRED - entry.keys()
        if missing:
            raise AutoEPError(f"{where}: ds_autoep_layers entry is invalid: missing fields {sorted(missing)}")
        if entry["moe_layer_id"] in seen_ids:
            raise AutoEPError(f"{where}: ds_autoep_layers metadata has duplicate moe_layer_id: {entry['moe_layer_id']}")
        seen_ids.add(entry["moe_layer_id"])
        if entry["expert_key_prefix"] in seen_prefixes:
            raise AutoEPError(f"{where}: ds_autoep_layers metadata has duplicate expert_key_prefix: "
                              f"{entry['expert_key_prefix']}")
        seen_prefixes.add(entry["expert_key_prefix"])
        for w in WEIGHTS:
            check_param_name(f"{entry['expert_key_prefix']}.{w}", where, "AutoEP expert parameter")
        placement = placement_of(entry, where)
        placements.append(placement)
        ep_rank = entry.get("ep_rank")
        if ep_rank is not None:
            ranks = {r["rank"]: r for r in placement["ranks"]}
            if ep_rank not in ranks:
                raise AutoEPError(f"{where}: AutoEP placement metadata does not contain current ep_rank {ep_rank}")
            if len(ranks[ep_rank]["experts"]) != entry["num_local_experts"]:
                raise AutoEPError(f"{where}: AutoEP placement metadata current-rank expert count does not match "
                                  f"num_local_experts: {len(ranks[ep_rank]['experts'])} != "
                                  f"{entry['num_local_experts']}")
        if not is_partitioned(entry):
            continue
        missing = ZERO3_PARTITIONED_REQUIRED - entry.keys()
        if missing:
            raise AutoEPError(f"{where}: AutoEP ZeRO-3 checkpoint metadata is invalid: missing fields "
                              f"{sorted(missing)}")
        if entry["checkpoint_format_version"] != 1:
            raise AutoEPError(f"{where}: Unsupported AutoEP ZeRO-3 checkpoint format version: "
                              f"{entry['checkpoint_format_version']}. pyckpt supports version 1.")
        if "expert_placement" not in entry:
            nl, ep, n = entry["num_local_experts"], entry["ep_size"], entry["num_experts"]
            if nl * ep != n:
                raise AutoEPError(f"{where}: AutoEP ZeRO-3 checkpoint metadata is inconsistent: "
                                  f"num_local_experts={nl}, ep_size={ep}, num_experts={n}")
            start = entry["ep_rank"] * nl
            if entry["global_expert_start"] != start or entry["global_expert_end"] != start + nl:
                raise AutoEPError(f"{where}: AutoEP ZeRO-3 checkpoint metadata has inconsistent global expert range: "
                                  f"got [{entry['global_expert_start']}, {entry['global_expert_end']}), expected "
                                  f"[{start}, {start + nl})")
        partitioned += 1
    if require_partitioned and partitioned == 0:
        raise AutoEPError(f"{where}: AutoEP ZeRO-3 partition-native checkpoint metadata was expected but no "
                          "partitioned AutoEP layer entries were found")
    return placements


def placement_of(entry: dict, where: str) -> dict:
    """The versioned expert placement descriptor, or the legacy uniform one it implies."""
    if "expert_placement" in entry:
        p = entry["expert_placement"]
        _validate_placement(p, where)
    else:
        n, nl, ep = entry["num_experts"], entry["num_local_experts"], entry["ep_size"]
        if not all(_positive_int(v) for v in (n, nl, ep)) or nl * ep != n:
            raise AutoEPError(f"{where}: AutoEP placement metadata is invalid: inconsistent legacy AutoEP metadata "
                              f"(num_local_experts={nl!r}, ep_size={ep!r}, num_experts={n!r})")
        p = {"version": 1, "num_experts": n, "ep_size": ep,
             "ranks": [{"rank": r, "experts": list(range(r * nl, (r + 1) * nl))} for r in range(ep)]}
    if p["num_experts"] != entry["num_experts"] or p["ep_size"] != entry["ep_size"]:
        raise AutoEPError(f"{where}: AutoEP placement metadata disagrees with its layer entry "
                          f"(num_experts {p['num_experts']} vs {entry['num_experts']}, ep_size {p['ep_size']} vs "
                          f"{entry['ep_size']})")
    return p


def _validate_placement(p, where: str) -> None:
    def bad(msg):
        raise AutoEPError(f"{where}: AutoEP placement metadata is invalid: {msg}")

    if not isinstance(p, dict):
        bad("AutoEP placement descriptor must be a dict.")
    if p.get("version") != 1:
        bad(f"Unsupported AutoEP placement descriptor version {p.get('version')!r}; expected 1.")
    n, ep, ranks = p.get("num_experts"), p.get("ep_size"), p.get("ranks")
    if not _positive_int(n) or not _positive_int(ep):
        bad(f"num_experts and ep_size must be positive integers; got {n!r}, {ep!r}.")
    if not isinstance(ranks, list) or len(ranks) != ep:
        bad(f"ranks must be a list of exactly {ep} entries.")
    seen, covered = set(), set()
    for r in ranks:
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int) or not 0 <= r["rank"] < ep:
            bad(f"placement rank entry {r!r} is invalid")
        if r["rank"] in seen:
            bad(f"AutoEP placement rank {r['rank']} appears more than once.")
        seen.add(r["rank"])
        experts = r.get("experts")
        if not isinstance(experts, list) or len(set(experts)) != len(experts) or any(
                not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n for x in experts):
            bad(f"experts of rank {r['rank']} must be distinct ids in [0, {n})")
        covered.update(experts)
    missing = sorted(set(range(n)) - covered)
    if missing:
        bad(f"AutoEP placement descriptor does not cover global expert IDs {missing}.")


def plan_zero3_experts(ck, plan: Plan) -> set:
    """Partition-native ZeRO-3 AutoEP experts; returns the expert parameter names (left out of the dense path)."""
    metas = {r: layers_of(mf.load()) for r, mf in enumerate(ck.model)}
    metas = {r: m for r, m in metas.items() if m is not None}
    if not metas:
        return set()
    partitioned = {}
    for r, m in metas.items():
        if isinstance(m, list):
            validate_zero3(m, ck.model[r].path, require_partitioned=False)
            if any(is_partitioned(e) for e in m):
                validate_zero3(m, ck.model[r].path, require_partitioned=True)
                partitioned[r] = m
    if not partitioned:
        raise UnsupportedCheckpointError(
            f"{ck.folder}: this ZeRO-3 checkpoint has AutoEP metadata but not the partition-native format "
            "(checkpoint_format: zero3_partitioned): AutoEP universal conversion needs ZeRO stage 1 or 2, or the "
            "partition-native ZeRO-3 format of DeepSpeed >= 0.19.6")
    expert_names = {f"{e['expert_key_prefix']}.{w}" for m in partitioned.values() for e in m if is_partitioned(e)
                    for w in WEIGHTS}

    # (name, state) -> {ep_rank: [(partition_rank, Segments, requires_grad)]}
    frags: Dict[Tuple[str, str], Dict[int, list]] = {}
    layer_of: Dict[str, dict] = {}
    placement_of_param: Dict[str, dict] = {}
    skipped: Dict[Tuple[str, str], str] = {}  # (name, moment) -> a shard lacking it
    local_shape_of: Dict[Tuple[str, int], tuple] = {}
    for r, meta in partitioned.items():
        mf, sf = ck.model[r], ck.optim[r]
        info = {f"{e['expert_key_prefix']}.{w}": e for e in meta if is_partitioned(e) for w in WEIGHTS}
        shapes_groups = mf.load().get("param_shapes") or []
        names_here = {n for g in shapes_groups for n in g}
        for name, e in info.items():
            placement = placement_of(e, mf.path)
            holds = {x["rank"]: x["experts"] for x in placement["ranks"]}[e["ep_rank"]]
            if name not in names_here and holds:
                raise AutoEPError(f"AutoEP expert parameters are missing from rank {r} ZeRO param_shapes "
                                  f"({mf.path}): {name}")
        frozen = set(mf.load().get("frozen_param_shapes") or {}) & set(info)
        if frozen:
            raise AutoEPError(f"AutoEP frozen expert parameters cannot be converted from the ZeRO-3 partition-native "
                              f"format: {sorted(frozen)} in {mf.path}")
        osd = sf.load()["optimizer_state_dict"]
        groups = osd.get("ds_zero_partition_groups") or []
        for gi, sub in enumerate(shapes_groups):
            sub_state = osd["optimizer_state_dict"]["state"].get(gi, {})
            flats = {"fp32": osd["fp32_flat_groups"][gi], "exp_avg": sub_state.get("exp_avg"),
                     "exp_avg_sq": sub_state.get("exp_avg_sq")}
            part = groups[gi] if gi < len(groups) else {}
            count = int(part.get("partition_count", len(ck.model)))
            prank = int(part.get("partition_rank", r))
            for name, shape, _, offset, real in rank_pieces(sub, count, prank):
                e = info.get(name)
                if e is not None:
                    ep_rank = e["ep_rank"]
                    placement = placement_of(e, mf.path)
                    if placement_of_param.setdefault(name, placement) != placement:
                        raise AutoEPError(f"AutoEP expert placement disagrees across ranks for {name} (at {mf.path}).")
                    layer_of.setdefault(name, e)
                    expected = (len({x["rank"]: x["experts"] for x in placement["ranks"]}[ep_rank]), ) + tuple(
                        int(d) for d in shape)[1:]
                    if tuple(int(d) for d in shape) != expected:
                        raise AutoEPError(f"AutoEP expert shard shape mismatch for {name}, EP rank {ep_rank}: got "
                                          f"{tuple(shape)}, expected {expected} (in {mf.path}).")
                    local_shape_of[(name, ep_rank)] = tuple(int(d) for d in shape)
                    for state, t in flats.items():
                        if not isinstance(t, TensorRef):
                            if state == "fp32":
                                raise AutoEPError(f"Missing fp32 partition for AutoEP expert parameter {name} on "
                                                  f"ZeRO rank {r} ({sf.path})")
                            skipped.setdefault((name, state), sf.path)
                            continue
                        seg = Segments([(sf, *sf.tensor_byte_range(t, offset, real))])
                        frags.setdefault((name, state), {}).setdefault(ep_rank, []).append(
                            (prank, seg, t.requires_grad, e["expert_data_parallel_world_size"], t.dtype, sf.path))

    for (name, state), path in sorted(skipped.items()):
        warnings.warn(f"AutoEP: skipped {state} of {name}: no {state} in {path}", stacklevel=3)
    for (name, state), by_ep in sorted(frags.items()):
        if (name, state) in skipped:
            continue
        placement = placement_of_param[name]
        e0 = layer_of[name]
        held = {x["rank"]: x["experts"] for x in placement["ranks"]}
        missing = sorted(r for r in set(held) - set(by_ep) if held[r])
        if missing:
            raise AutoEPError(f"Missing AutoEP universal fragments for {name}/{state} EP ranks: {missing}"
                              f"{_in([it[5] for items in by_ep.values() for it in items], ck.folder)}")
        locals_: Dict[int, Tuple[Segments, str, bool]] = {}
        for ep_rank, items in sorted(by_ep.items()):
            items.sort(key=lambda it: it[0])
            pranks = [it[0] for it in items]
            world = items[0][3]
            if len(pranks) != len(set(pranks)):
                raise AutoEPError(f"Duplicate AutoEP expert-DP partition ranks for {name}/{state} EP rank {ep_rank}: "
                                  f"{pranks}{_in([it[5] for it in items], ck.folder)}")
            if set(pranks) != set(range(world)):
                raise AutoEPError(f"Incomplete AutoEP expert-DP fragments for {name}/{state} EP rank {ep_rank}: got "
                                  f"{sorted(pranks)}, expected {list(range(world))}{_in([it[5] for it in items], ck.folder)}")
            seg = Segments()
            for it in items:
                seg.extend(it[1])
            dtype = items[0][4]
            shape = local_shape_of[(name, ep_rank)]
            locals_[ep_rank] = (seg.slice(0, numel(shape) * ITEMSIZE[dtype]), dtype, any(it[2] for it in items))
        plan.add_archive(f"zero/{name}/{state}.pt",
                         _placed_expert_dict(name, state, placement, locals_, local_shape_of, e0["num_experts"],
                                             _in([it[5] for items in by_ep.values() for it in items], ck.folder)))

    for sf in ck.model_files:
        plan.add_archive(os.path.basename(sf.path), _resaved_zero3_state(sf))
    return expert_names


def _resaved_zero3_state(sf):
    state = dict(sf.load())
    info = state.get("universal_checkpoint_info")
    info = dict(info) if isinstance(info, dict) else {}
    info["expert_parameter_patterns"] = list(ZERO3_PATTERNS)
    info["ds_autoep_layers"] = layers_of(state)
    state["universal_checkpoint_info"] = info
    return state


def _placed_expert_dict(name, state, placement, locals_, local_shape_of, num_experts, files: str):
    """Rows of each EP rank's packed local tensor land at their global expert ids."""
    any_rank = next(iter(locals_))
    dtype = locals_[any_rank][1]
    row_shape = local_shape_of[(name, any_rank)][1:]
    row_bytes = numel(row_shape) * ITEMSIZE[dtype]
    owner: Dict[int, Tuple[int, int]] = {}  # expert id -> (ep rank, local row)
    for entry in sorted(placement["ranks"], key=lambda x: x["rank"]):
        r = entry["rank"]
        for row, eid in enumerate(entry["experts"]):
            if eid in owner:
                first = locals_[owner[eid][0]][0].slice(owner[eid][1] * row_bytes, row_bytes).read()
                again = locals_[r][0].slice(row * row_bytes, row_bytes).read()
                if first != again:
                    raise AutoEPError(f"Failed to rebuild AutoEP universal tensor for {name}/{state}: ranks "
                                      f"{owner[eid][0]} and {r} hold different data for replicated expert {eid}{files}")
                continue
            owner[eid] = (r, row)
    pieces = []
    for eid in range(num_experts):
        r, row = owner[eid]
        pieces.extend(locals_[r][0].slice(row * row_bytes, row_bytes).pieces(eid * row_bytes))
    tensor = NewTensor(dtype, (num_experts, ) + tuple(row_shape), pieces, any(v[2] for v in locals_.values()))
    return {"param": tensor, "cat_dim": 0, "is_expert_param": True, "ep_num_experts": num_experts}


# ----------------------------------------------------------------------------------------------
# Load side
# ----------------------------------------------------------------------------------------------


def valid_ep_sizes(num_experts: int, stage_size: Optional[int] = None) -> List[int]:
    return [e for e in range(1, num_experts + 1) if num_experts % e == 0 and (stage_size is None or stage_size % e == 0)]


def check_load_topology(layers: Sequence[dict], autoep_size: int, world_size: int, pp_size: int = 1,
                        target_shapes: Optional[Dict[str, tuple]] = None,
                        checkpoint_shapes: Optional[Dict[str, tuple]] = None) -> None:
    """Can a run with ``autoep_size`` over ``world_size / pp_size`` ranks load these experts?

    ``layers`` are the checkpoint's AutoEP layer entries (``module_path``/``expert_key_prefix`` and
    ``num_experts``). ``target_shapes``/``checkpoint_shapes`` map ``<prefix>.wN`` to the target run's
    local shape and the universal file's full shape. Raises ValueError naming layer, counts and sizes.
    """
    if not _positive_int(autoep_size):
        raise ValueError(f"autoep_size must be a positive integer, got {autoep_size!r}")
    if world_size % pp_size != 0:
        raise ValueError(f"world_size={world_size} is not divisible by pp_size={pp_size}")
    stage = world_size // pp_size
    if stage % autoep_size != 0:
        sizes = [e for e in range(1, stage + 1) if stage % e == 0]
        raise ValueError(f"autoep_size={autoep_size} must divide the stage size (world_size={world_size} / "
                         f"pp_size={pp_size} = {stage}). Valid autoep_size values: {sizes}")
    for entry in layers:
        layer = entry.get("module_path", entry.get("expert_key_prefix"))
        n = entry["num_experts"]
        if n % autoep_size != 0:
            raise ValueError(f"layer {layer!r}: num_experts={n} is not divisible by autoep_size={autoep_size}. "
                             f"Valid autoep_size values: {valid_ep_sizes(n, stage)}")
        for w in WEIGHTS:
            key = f"{entry['expert_key_prefix']}.{w}"
            if target_shapes is None or key not in target_shapes:
                continue
            target = tuple(target_shapes[key])
            full = tuple(checkpoint_shapes[key]) if checkpoint_shapes and key in checkpoint_shapes else None
            expected_local = n // autoep_size
            if target[0] != expected_local or (full is not None and tuple(full[1:]) != target[1:]):
                raise ValueError(f"layer {layer!r}: {key} has target shape {target}, but the checkpoint's {n} experts "
                                 f"{'of shape ' + str(full[1:]) + ' ' if full else ''}at autoep_size={autoep_size} "
                                 f"give {(expected_local, ) + (tuple(full[1:]) if full else target[1:])}. "
                                 f"Valid autoep_size values: {valid_ep_sizes(n, stage)}")


def expert_rows(num_experts: int, ep_rank: int, ep_size: int) -> Tuple[int, int]:
    if not _positive_int(ep_size) or num_experts % ep_size != 0:
        raise ValueError(f"num_experts ({num_experts}) not divisible by ep_size ({ep_size}). Valid ep sizes: "
                         f"{valid_ep_sizes(num_experts)}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} is outside [0, {ep_size})")
    local = num_experts // ep_size
    return ep_rank * local, local


def read_expert_slice(path, ep_rank: int, ep_size: int, key: str = "param", out=None, workers: int = 0):
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
        raise CheckpointFormatError(f"{sf.path}: not a universal parameter file (no tensor under {key!r})")
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
