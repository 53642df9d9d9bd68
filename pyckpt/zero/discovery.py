"""Finding a DeepSpeed checkpoint's files and its topology (ZeRO stage, dp/tp/pp degrees).

Mirrors how DeepSpeed 0.19.8 names and discovers files (engine.py save helpers, ds_to_universal.py,
checkpoint/reshape_utils.py), but checks what DeepSpeed leaves to chance: a missing rank file or a
partition count that disagrees with the files present is an error naming the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, quoted
from ..formats.confined import check_links_inside, inside, read_small_text
from ..formats.torch_zip import SourceFile, iter_sources
from ..planning.collector import pauses_collector
from .model_states import ModelStates, read_model_states
from .names import ZERO3_MODEL_RE, check_tag, missing_ranks
from .shard_row import ShardRow
from .shards import ZeroShard, read_zero_shard, read_zero_stage

_ZERO_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt\Z")


def natural_key(text: str):
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def is_expert_model_file(name: str) -> bool:
    """A per-expert weight file (``layer_L_expert_E_mp_rank_NN_model_states.pt``) of DeepSpeed-MoE or AutoEP."""
    return name.startswith("layer_") and "_expert_" in name and name.endswith("_model_states.pt")


def expert_files_in(names) -> List[str]:
    return sorted(n for n in names if is_expert_model_file(n))


def _tag_folder_and_names(path):
    """(tag folder, its listing when that was the folder listed here, else None): a tag folder given
    directly is listed once for both the test and discovery."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"{path}: not a folder")
    names = os.listdir(path)
    if any(n.endswith("_optim_states.pt") for n in names):
        return path, names
    if os.path.lexists(os.path.join(path, "latest")):
        return follow_pointer(path, "latest"), None
    _refuse_megatron_lm(path, names)
    raise CheckpointFormatError(f"{path}: no *_optim_states.pt files and no 'latest' file: not a DeepSpeed ZeRO "
                                "checkpoint folder (pass the tag folder, e.g. .../global_step100, or its parent)")


def follow_pointer(path: str, pointer: str) -> str:
    """The tag folder that the pointer file ``pointer`` (``latest``, ``latest_universal``) in ``path`` names."""
    latest = os.path.join(path, pointer)
    tag = check_tag(read_small_text(path, pointer).strip(), latest)
    tag_dir = inside(path, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointFormatError(f"{latest} names tag {quoted(tag)}, but {tag_dir} does not exist")
    return tag_dir


_MEGATRON_RANK_DIR_RE = re.compile(r"^mp_rank_\d+(_\d+)?\Z")
_MEGATRON_ITER_DIR_RE = re.compile(r"^iter_\d+\Z")
_MP_MODEL_RE = re.compile(r"^mp_rank_\d+(_\d+)?_model_states\.pt\Z")
_TP_PP_MODEL_RE = re.compile(r"^mp_rank_(\d+)_(\d+)_model_states\.pt\Z")


def _refuse_megatron_lm(path: str, names) -> None:
    """Megatron-LM's own layout (``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``) is not a DeepSpeed engine
    checkpoint; ds_to_universal cannot read it either, so say so instead of 'no optimizer files'."""
    rank_dirs = [n for n in names if _MEGATRON_RANK_DIR_RE.match(n) and os.path.isdir(os.path.join(path, n))]
    iter_dirs = [n for n in names if _MEGATRON_ITER_DIR_RE.match(n) and os.path.isdir(os.path.join(path, n))]
    if rank_dirs or iter_dirs or "latest_checkpointed_iteration.txt" in names:
        found = (rank_dirs or iter_dirs or ["latest_checkpointed_iteration.txt"])[0]
        raise UnsupportedCheckpointError(
            f"{path}: this is a Megatron-LM checkpoint ({found}; model_optim_rng.pt per tp/pp rank), not a "
            "DeepSpeed engine checkpoint. DeepSpeed's ds_to_universal does not read it either: save with "
            "DeepSpeed (Megatron-DeepSpeed) to get zero_pp_rank_*_optim_states.pt shards.")



@dataclass
class ZeroCheckpoint:
    """The files of one tag folder, read into validated records, and the topology they imply."""

    folder: str
    stage: int
    dp: int
    tp: int = 1
    pp: int = 1
    # optim_grid[mp][dp]: the ZeRO shards (mp = pp_rank * tp_degree + tp_rank; ZeRO-3: the tp rank);
    # ZeRO-1/2: rows that read their shards when walked (ShardRow), ZeRO-3: lists of records
    optim_grid: List[Sequence[ZeroShard]] = field(default_factory=list)
    # ZeRO-1/2: the mp_rank_* model states, by mp rank; ZeRO-3: model_grid[tp][dp]
    model: List[ModelStates] = field(default_factory=list)
    model_grid: List[List[ModelStates]] = field(default_factory=list)
    # every non-expert *_model_states.pt, read and checked: each is copied to the universal folder
    model_files: List[ModelStates] = field(default_factory=list)
    bf16_prefix: bool = False
    # the folder's listing, read once: later steps look names up in it rather than list or glob again
    names: List[str] = field(default_factory=list)

    @property
    def optim(self) -> List[ZeroShard]:
        """The shards of mp rank 0, by dp rank."""
        return self.optim_grid[0]


@pauses_collector
def discover(path) -> ZeroCheckpoint:
    folder, names = _tag_folder_and_names(path)
    names = sorted(os.listdir(folder) if names is None else names, key=natural_key)
    # every shard and model-state file is read by its path from here on
    check_links_inside(folder, names)
    optim_names = [n for n in names if n.endswith("_optim_states.pt")]
    zero_names = [n for n in optim_names if _ZERO_RE.match(n)]
    if not zero_names:
        if optim_names:
            raise CheckpointFormatError(f"{folder}: optimizer files {optim_names[:3]} are not ZeRO shards "
                                        "(zero_pp_rank_*): only ZeRO stage 1/2/3 checkpoints can be converted")
        raise CheckpointFormatError(f"{folder}: can't find *_optim_states.pt files")
    first = SourceFile(os.path.join(folder, zero_names[0]))
    stage = read_zero_stage(first)
    if stage <= 2:
        return _discover_zero12(folder, names, zero_names, first, stage)
    return _discover_zero3(folder, names, zero_names, first)


def _rank_table(folder: str, zero_names: List[str]) -> Dict[int, Dict[int, str]]:
    prefixes = {(_ZERO_RE.match(n).group(1) or "") for n in zero_names}
    if len(prefixes) > 1:
        raise CheckpointFormatError(f"{folder}: ZeRO shards with different prefixes {sorted(prefixes)} are mixed "
                                    "in one folder")
    grid: Dict[int, Dict[int, str]] = {}
    for n in zero_names:
        m = _ZERO_RE.match(n)
        dp, mp = int(m.group(2)), int(m.group(3))
        grid.setdefault(mp, {})[dp] = n
    return grid


def zero_shard_grid(folder: str, names, zero3: bool = False) -> Dict[int, List[str]]:
    """The ZeRO optimizer shard names of ``names`` (the folder's listing): {mp rank: names in dp rank
    order}, every row complete and as long as the others (the checks :func:`discover` makes)."""
    zero_names = [n for n in names if _ZERO_RE.match(n) and not (zero3 and n.startswith("fp16_"))]
    if not zero_names:
        raise CheckpointFormatError(f"{folder}: can't find ZeRO optimizer shards (zero_pp_rank_*_optim_states.pt)")
    grid = _rank_table(folder, zero_names)
    dp = _check_complete(folder, grid, "ZeRO optimizer shards")
    return {mp: [ranks[r] for r in range(dp)] for mp, ranks in sorted(grid.items())}


def _check_complete(folder: str, grid: Dict[int, Dict[int, str]], what: str) -> int:
    dp = 1 + max(max(d) for d in grid.values())
    for mp, ranks in sorted(grid.items()):
        if len(ranks) == dp:
            continue
        listed, count = missing_ranks(ranks, dp)
        first = listed[0]
        shown = str(listed) if count <= len(listed) else f"{listed} and {count - len(listed)} more"
        example = next(iter(ranks.values()))
        name = re.sub(r"zero_pp_rank_\d+", f"zero_pp_rank_{first}", example)
        found = sorted(ranks)
        raise CheckpointFormatError(f"{folder}: {what} for dp rank(s) {shown} of mp rank {mp} are missing "
                                    f"(expected e.g. {name}; found dp ranks {found if len(found) <= 16 else found[:16] + ['...']})")
    return dp


def _discover_zero12(folder, names, zero_names, first, stage) -> ZeroCheckpoint:
    mp_names = sorted(n for n in names if _MP_MODEL_RE.match(n))
    # DeepSpeed's converter takes every name that starts with mp_rank_ as a model-state file (a prefix
    # match); pyckpt copies them into its output by name, so one that only starts like one is refused
    odd = sorted(n for n in names if n.startswith("mp_rank_") and n not in mp_names and
                 not os.path.isdir(os.path.join(folder, n)))
    if odd:
        raise CheckpointFormatError(f"{os.path.join(folder, odd[0])}: named like a model-state file but not "
                                    "mp_rank_NN_model_states.pt; DeepSpeed would count it among the model states. "
                                    "Remove or rename it")
    tp_pp_named = [n for n in mp_names if _TP_PP_MODEL_RE.match(n)]
    if tp_pp_named:
        # DeepSpeed numbers model states by the model-parallel rank alone (mp_rank_{pp*tp_degree+tp:02d});
        # a two-index name has no defined order for the shards beside it, and DeepSpeed's converter
        # would silently pair the wrong files.
        raise UnsupportedCheckpointError(
            f"{os.path.join(folder, tp_pp_named[0])}: model states named mp_rank_<tp>_<pp> (Megatron-LM style) "
            "are not a DeepSpeed layout; DeepSpeed writes one mp_rank_<NN>_model_states.pt per model-parallel "
            "rank, NN = pp_rank * tp_degree + tp_rank. Rename them that way if the ZeRO shards follow the same "
            "numbering.")
    if not mp_names:
        raise CheckpointFormatError(f"{folder} seems a bogus DeepSpeed checkpoint folder: no mp_rank_* model-state "
                                    "files")
    grid = _rank_table(folder, zero_names)
    dp = _check_complete(folder, grid, "ZeRO optimizer shards")
    model = [read_model_states(SourceFile(os.path.join(folder, n))) for n in mp_names]
    pp, tp = parallel_degrees(folder, model, names, sum(len(r) for r in grid.values()))
    if sorted(grid) != list(range(pp * tp)):
        raise CheckpointFormatError(f"{folder}: ZeRO shards exist for mp ranks {sorted(grid)}, but the model states "
                                    f"say pp={pp} x tp={tp}")
    # Each row reads its dp rank 0 here and the others when a planner walks it (see ShardRow).
    optim_grid = []
    for m in range(pp * tp):
        row = [grid[m][r] for r in range(dp)]
        rank0 = first if os.path.basename(first.path) == row[0] else SourceFile(os.path.join(folder, row[0]))
        optim_grid.append(ShardRow(folder, row, read_zero_shard(rank0, 0, dp), stage))
    return ZeroCheckpoint(folder, stage, dp, tp, pp, optim_grid, model, model_files=list(model),
                          bf16_prefix=zero_names[0].startswith("bf16_"), names=list(names))


def _read_shards(folder, grid, first, mp_ranks, dp, stage) -> List[List[ZeroShard]]:
    """ZeRO-3: every shard read into its record, by tp rank then dp rank."""
    opened = {os.path.basename(first.path): first}
    rows = []
    for m in mp_ranks:
        names = [grid[m][r] for r in range(dp)]
        fresh = iter_sources(os.path.join(folder, n) for n in names if n not in opened)
        row = []
        for r, n in enumerate(names):
            shard = read_zero_shard(opened.get(n) or next(fresh), r, dp)
            if shard.stage != stage:
                raise CheckpointFormatError(f"{shard.path}: a ZeRO stage {shard.stage} shard beside stage {stage} "
                                            f"ones ({first.path})")
            if r > 0:
                # Only dp rank 0's whole optimizer state is written out (zero/optimizer_state.pt);
                # the others keep their records, not their parsed files: each holds the torch
                # param_groups with every parameter's index, so kept whole they made memory grow
                # with dp x params.
                shard.saved = shard.param_groups = None
                shard.file.release()
            row.append(shard)
        rows.append(row)
    return rows


def parallel_degrees(folder, model, names, n_zero):
    """(pp, tp) as DeepSpeed derives them: checkpoint_parallel_dimensions, else the legacy file counts."""
    dims = [mf.parallel_dims for mf in model]
    given = [d for d in dims if d is not None]
    if given:
        if len(given) != len(dims):
            raise CheckpointFormatError(f"{folder}: checkpoint_parallel_dimensions is missing from some model-state "
                                        "files")
        pairs = set(given)
        if len(pairs) != 1:
            raise CheckpointFormatError(f"{folder}: checkpoint_parallel_dimensions disagrees across model-state "
                                        f"files: {sorted(pairs)}")
        pp, tp = pairs.pop()
        if len(model) != pp * tp:
            raise CheckpointFormatError(f"{folder}: {len(model)} model-state files, but pp_degree={pp} * "
                                        f"tp_degree={tp}")
    else:
        layer01 = [n for n in names if n.startswith("layer_01")]
        tp = len(layer01) or len(model)
        pp = max(1, len(model) // tp)
    if n_zero % (pp * tp):
        raise CheckpointFormatError(f"{folder}: {n_zero} ZeRO shards is not divisible by pp={pp} * tp={tp}")
    return pp, tp


def _discover_zero3(folder, names, zero_names, first) -> ZeroCheckpoint:
    zero3 = [n for n in zero_names if not n.startswith("fp16_")]
    grid = _rank_table(folder, zero3)
    dp = _check_complete(folder, grid, "ZeRO-3 optimizer shards")
    tp = 1 + max(grid)
    missing_tp, _ = missing_ranks(grid, tp)
    if missing_tp:
        raise CheckpointFormatError(f"{folder}: ZeRO-3 optimizer shards for tp rank(s) {missing_tp} are missing")
    model_names = [n for n in names if n.endswith("_model_states.pt") and not is_expert_model_file(n)]
    if not model_names:
        raise CheckpointFormatError(f"can't find ZeRO Stage 3 model state files in directory '{folder}'")
    by_rank = {}
    for n in model_names:
        m = ZERO3_MODEL_RE.match(n)
        if m:
            by_rank[(int(m.group(2)), int(m.group(1)))] = n
    for t in range(tp):
        missing, _ = missing_ranks({r for (tt, r) in by_rank if tt == t}, dp)
        if missing:
            raise CheckpointFormatError(f"{folder}: ZeRO-3 model-state files for dp rank(s) {missing} of tp rank {t} "
                                        f"are missing (expected zero_pp_rank_{missing[0]}_mp_rank_{t:02d}_model_states.pt)")
    optim_grid = _read_shards(folder, grid, first, range(tp), dp, 3)
    # Every model-state file is copied into the output, so every one is read and checked, not only
    # the ones the plan reads.
    model_files = {n: read_model_states(sf)
                   for n, sf in zip(model_names, iter_sources(os.path.join(folder, n) for n in model_names))}
    model_grid = [[model_files[by_rank[(t, r)]] for r in range(dp)] for t in range(tp)]
    return ZeroCheckpoint(folder, 3, dp, tp, 1, optim_grid, model_grid[0], model_grid, list(model_files.values()),
                          bf16_prefix=zero3[0].startswith("bf16_"), names=list(names))
