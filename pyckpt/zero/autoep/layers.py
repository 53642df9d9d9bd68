"""AutoEP (DeepSpeed's automatic expert parallelism): the layer metadata and expert placement.

An AutoEP layer keeps its routed experts as three fused parameters ``<prefix>.w1/w2/w3`` whose
first dimension is the expert. Each EP rank trains its own ``num_local_experts`` rows, and ZeRO
partitions them again over the ranks of its expert-data-parallel (EDP) group. The model states
list the layers in ``ds_autoep_layers``; this module checks that list the way DeepSpeed 0.19.8's
``ds_to_universal`` does (``_aggregate_autoep_zero12_metadata``,
``validate_autoep_zero3_partitioned_metadata``), finds the per-expert files it promises, and says
which ranks hold which experts. The ZeRO-1/2 and ZeRO-3 consolidations and the load side are
its siblings.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ...errors import AutoEPError, MissingExpertFileError, UnsupportedCheckpointError, quoted
from ...formats.torch_zip import SourceFile, iter_sources
from ..model_states import ExpertWeights, ModelStates, read_expert_weights
from ..names import check_param_name

WEIGHTS = ("w1", "w2", "w3")
# Fields DeepSpeed keeps of each layer entry when it aggregates ZeRO-1/2 metadata (and writes back).
ZERO12_FIELDS = ("moe_layer_id", "module_path", "expert_key_prefix", "num_experts", "num_local_experts", "ep_size")
REQUIRED_FIELDS = ("expert_key_prefix", "num_experts", "num_local_experts", "ep_size")
ZERO3_REQUIRED = {"moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix"}
ZERO3_PARTITIONED_REQUIRED = {"checkpoint_format_version", "ep_group_name", "ep_rank", "expert_data_parallel_rank",
                              "expert_data_parallel_world_size", "global_expert_start", "global_expert_end"}
# The expert_parameter_patterns DeepSpeed's converter adds to universal_checkpoint_info.
ZERO12_PATTERNS = [r"\.experts\.w[123]$"]
ZERO3_PATTERNS = [r".*\.experts\.w[123]$"]


@dataclass(frozen=True)
class Placement:
    """Which global experts each EP rank holds, in its local row order.

    ``explicit`` lists them per rank; None is the uniform placement (rank r holds experts
    ``[r*n/ep, (r+1)*n/ep)``), kept as that rule rather than as lists, since the counts come from the
    checkpoint and only the files behind them bound them. A descriptor listing the uniform placement
    is stored as uniform, so that equal placements compare equal."""

    num_experts: int
    ep_size: int
    explicit: Optional[Tuple[Tuple[int, ...], ...]] = None

    def __post_init__(self):
        if self.explicit is not None and _is_uniform(self.num_experts, self.ep_size, self.explicit):
            object.__setattr__(self, "explicit", None)

    def experts_of(self, ep_rank: int) -> Sequence[int]:
        if self.explicit is not None:
            return self.explicit[ep_rank]
        local = self.num_experts // self.ep_size
        return range(ep_rank * local, (ep_rank + 1) * local)

    @property
    def experts_by_rank(self) -> Iterator[Sequence[int]]:
        return (self.experts_of(r) for r in range(self.ep_size))


def _is_uniform(n: int, ep: int, ranks) -> bool:
    # Costs what the lists hold (read from a file), never n.
    if n % ep or len(ranks) != ep:
        return False
    local = n // ep
    return all(len(held) == local and tuple(held) == tuple(range(r * local, (r + 1) * local))
               for r, held in enumerate(ranks))


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def aggregate_zero12(model_files: List[ModelStates]) -> Tuple[Optional[list], bool]:
    """DeepSpeed's ``_aggregate_autoep_zero12_metadata`` over the mp_rank files: the layer entries
    (the fields it keeps, one per prefix) and ``use_data_before_expert_parallelism``."""
    by_prefix: Dict[str, dict] = {}
    source: Dict[str, str] = {}
    ordering: Dict[str, bool] = {}
    for mf in model_files:
        meta = mf.autoep_layers
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
                    raise AutoEPError(f"Conflicting AutoEP metadata for expert_key_prefix {quoted(prefix)} in "
                                      f"{source[prefix]} and {mf.path}.")
                if prefix not in by_prefix:
                    by_prefix[prefix] = light
                    source[prefix] = mf.path
        flag = mf.ds_config.get("use_data_before_expert_parallelism", False)
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
            if not positive_int(entry[f]):
                raise AutoEPError(f"{where}: AutoEP {f} must be a positive integer, got {quoted(entry[f])}.")
        nl = entry["num_local_experts"]
        if not positive_int(nl):
            raise AutoEPError(f"{where}: AutoEP num_local_experts must be a positive integer, got {quoted(nl)}.")
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


# DeepSpeed's per-expert file name; the metadata's ids are matched as the text DeepSpeed formats
# into it (so "01" is not expert 1), the mp-rank part as its glob does (anything).
_EXPERT_FILE_RE = re.compile(r"^layer_([^_]*)_expert_([^_]*)_mp_rank_(.*)_model_states\.pt\Z")


def index_expert_files(names) -> Dict[Tuple[str, str], List[str]]:
    """The folder's per-expert files by (layer id, expert id) as written in their names: one pass over
    one listing, so finding every expert's file is linear in the folder's size (DeepSpeed's converter
    globs the folder once per expert, quadratic in the expert count)."""
    index: Dict[Tuple[str, str], List[str]] = {}
    for name in names:
        m = _EXPERT_FILE_RE.match(name)
        if m:
            index.setdefault((m.group(1), m.group(2)), []).append(name)
    return index


def check_expert_files(folder: str, names, layers: list) -> Dict[Tuple[int, int], ExpertWeights]:
    """Every (layer, expert) the metadata promises has exactly one per-expert file with its weights.

    ``names`` is the folder's listing (discovery's)."""
    index = index_expert_files(names)
    wanted = []  # ((layer id, expert id, prefix), path) in the metadata's order
    for entry in layers:
        layer_id = entry.get("moe_layer_id")
        prefix = entry["expert_key_prefix"]
        for eid in range(entry["num_experts"]):
            matches = sorted(os.path.join(folder, n) for n in index.get((str(layer_id), str(eid)), ()))
            if not matches:
                raise MissingExpertFileError(f"Expert checkpoint file not found: layer_{layer_id} expert_{eid} in "
                                             f"{folder} (the AutoEP metadata of {prefix} promises {entry['num_experts']} "
                                             "experts)")
            if len(matches) > 1:
                if any(read_expert_weights(SourceFile(m)).folded for m in matches):
                    raise UnsupportedCheckpointError(
                        f"Universal checkpoint conversion for folded AutoEP+AutoTP expert shards is not supported: "
                        f"{[os.path.basename(m) for m in matches]}")
                raise UnsupportedCheckpointError(
                    f"Multiple expert checkpoint files found for layer_{layer_id} expert_{eid}: "
                    f"{[os.path.basename(m) for m in matches]}. Multi-mp_rank expert files are not supported.")
            wanted.append(((layer_id, eid, prefix), matches[0]))
    found = {}
    for ((layer_id, eid, prefix), _), sf in zip(wanted, iter_sources(path for _, path in wanted)):
        weights = read_expert_weights(sf)
        for w in WEIGHTS:
            key = f"{prefix}.{w}.{eid}"
            if key not in weights.tensors:
                raise AutoEPError(f"Expected key '{key}' not found in {weights.path}")
        sf.release()  # its tensor records stay; the pickle of each of ~15,000 files need not
        found[(layer_id, eid)] = weights
    return found


def in_files(paths, fallback: str) -> str:
    """' (in FILE)' naming the files an inconsistency was found across (at most three), so a refusal
    points at a file even when the rule spans several."""
    paths = list(dict.fromkeys(paths)) or [fallback]
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return f" (in {shown})"


def resaved_model_states(ms: ModelStates, patterns, layers) -> dict:
    """A model-state file as the universal folder holds it: ``universal_checkpoint_info`` extended
    with the expert patterns and layers, as DeepSpeed's converter re-saves it."""
    state = dict(ms.raw())
    info = dict(ms.universal_info or {})
    info["expert_parameter_patterns"] = list(patterns)
    info["ds_autoep_layers"] = layers
    state["universal_checkpoint_info"] = info
    return state




def is_partitioned(entry) -> bool:
    return isinstance(entry, dict) and entry.get("checkpoint_format") == "zero3_partitioned"


def validate_zero3(meta, where: str, require_partitioned: bool) -> List[Placement]:
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
            if not isinstance(ep_rank, int) or isinstance(ep_rank, bool) or not 0 <= ep_rank < placement.ep_size:
                raise AutoEPError(f"{where}: AutoEP placement metadata does not contain current ep_rank {ep_rank}")
            held = placement.experts_of(ep_rank)
            if len(held) != entry["num_local_experts"]:
                raise AutoEPError(f"{where}: AutoEP placement metadata current-rank expert count does not match "
                                  f"num_local_experts: {len(held)} != {entry['num_local_experts']}")
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


def placement_of(entry: dict, where: str) -> Placement:
    """The versioned expert placement descriptor, or the legacy uniform one it implies."""
    if "expert_placement" in entry:
        p = _placement(entry["expert_placement"], where)
    else:
        n, nl, ep = entry["num_experts"], entry["num_local_experts"], entry["ep_size"]
        if not all(positive_int(v) for v in (n, nl, ep)) or nl * ep != n:
            raise AutoEPError(f"{where}: AutoEP placement metadata is invalid: inconsistent legacy AutoEP metadata "
                              f"(num_local_experts={quoted(nl)}, ep_size={quoted(ep)}, num_experts={quoted(n)})")
        p = Placement(n, ep)
    if p.num_experts != entry["num_experts"] or p.ep_size != entry["ep_size"]:
        raise AutoEPError(f"{where}: AutoEP placement metadata disagrees with its layer entry "
                          f"(num_experts {p.num_experts} vs {entry['num_experts']}, ep_size {p.ep_size} vs "
                          f"{entry['ep_size']})")
    return p


def _placement(p, where: str) -> Placement:
    def bad(msg):
        raise AutoEPError(f"{where}: AutoEP placement metadata is invalid: {msg}")

    if not isinstance(p, dict):
        bad("AutoEP placement descriptor must be a dict.")
    if p.get("version") != 1:
        bad(f"Unsupported AutoEP placement descriptor version {quoted(p.get('version'))}; expected 1.")
    n, ep, ranks = p.get("num_experts"), p.get("ep_size"), p.get("ranks")
    if not positive_int(n) or not positive_int(ep):
        bad(f"num_experts and ep_size must be positive integers; got {quoted(n)}, {quoted(ep)}.")
    if not isinstance(ranks, list) or len(ranks) != ep:
        bad(f"ranks must be a list of exactly {ep} entries.")
    by_rank: Dict[int, Tuple[int, ...]] = {}
    for r in ranks:
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int) or not 0 <= r["rank"] < ep:
            bad(f"placement rank entry {quoted(r)} is invalid")
        if r["rank"] in by_rank:
            bad(f"AutoEP placement rank {r['rank']} appears more than once.")
        experts = r.get("experts")
        if not isinstance(experts, list) or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n
                                                for x in experts) or len(set(experts)) != len(experts):
            bad(f"experts of rank {r['rank']} must be distinct ids in [0, {n})")
        by_rank[r["rank"]] = tuple(experts)
    covered = set().union(*by_rank.values())
    if len(covered) != n:  # every id lies in [0, n): only a count can fall short, found without counting to n
        missing = list(itertools.islice((i for i in itertools.count() if i not in covered), 8))
        bad(f"AutoEP placement descriptor does not cover global expert IDs {missing}"
            f"{f' and {n - len(covered) - len(missing)} more' if n - len(covered) > len(missing) else ''}.")
    return Placement(n, ep, tuple(by_rank[r] for r in range(ep)))
