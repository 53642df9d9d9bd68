"""Finding a DeepSpeed checkpoint's files and its topology (ZeRO stage, dp/tp/pp degrees).

Mirrors how DeepSpeed 0.19.8 names and discovers files (engine.py save helpers, ds_to_universal.py,
checkpoint/reshape_utils.py), but checks what DeepSpeed leaves to chance: a missing rank file or a
partition count that disagrees with the files present is an error naming the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List

from ..formats.torch_zip import SourceFile, read_small_text
from .schema import (check_model_state, check_zero12_shard, check_zero3_shard, optimizer_state,
                                zero_stage)
from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from .names import check_tag

_ZERO_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def natural_key(text: str):
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def is_expert_model_file(name: str) -> bool:
    return name.startswith("layer_") and "_expert_" in name


def resolve_tag_folder(path) -> str:
    """Accept the tag folder itself, or the save_dir holding ``latest``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"{path}: not a folder")
    names = os.listdir(path)
    if any(n.endswith("_optim_states.pt") for n in names):
        return path
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        tag = check_tag(read_small_text(latest).strip(), latest)
        tag_dir = os.path.join(path, tag)
        if not os.path.isdir(tag_dir):
            raise CheckpointFormatError(f"{latest} names tag {tag!r}, but {tag_dir} does not exist")
        return tag_dir
    _refuse_megatron_lm(path, names)
    raise CheckpointFormatError(f"{path}: no *_optim_states.pt files and no 'latest' file: not a DeepSpeed ZeRO "
                                "checkpoint folder (pass the tag folder, e.g. .../global_step100, or its parent)")


_MEGATRON_RANK_DIR_RE = re.compile(r"^mp_rank_\d+(_\d+)?$")
_MEGATRON_ITER_DIR_RE = re.compile(r"^iter_\d+$")
_TP_PP_MODEL_RE = re.compile(r"^mp_rank_(\d+)_(\d+)_model_states\.pt$")


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
    """The files of one tag folder and the topology they imply."""

    folder: str
    stage: int
    dp: int
    tp: int = 1
    pp: int = 1
    # optim[dp] of mp rank 0; optim_grid[mp][dp] for all mp ranks (mp = pp * tp_degree + tp)
    optim: List[SourceFile] = field(default_factory=list)
    # ZeRO-1/2: the mp_rank_* files; ZeRO-3: zero_pp_rank_*_model_states.pt by dp rank
    model: List[SourceFile] = field(default_factory=list)
    # every non-expert *_model_states.pt, parsed and checked, copied to the universal folder
    model_files: List[SourceFile] = field(default_factory=list)
    bf16_prefix: bool = False
    optim_grid: List[List[SourceFile]] = field(default_factory=list)
    model_grid: List[List[SourceFile]] = field(default_factory=list)  # ZeRO-3: [tp][dp]



def _optim_state(sf: SourceFile):
    return optimizer_state(sf.path, sf.load())


def _model_state(sf: SourceFile):
    obj = sf.load()
    check_model_state(sf.path, obj)
    return obj


def discover(path) -> ZeroCheckpoint:
    folder = resolve_tag_folder(path)
    names = sorted(os.listdir(folder), key=natural_key)
    optim_names = [n for n in names if n.endswith("_optim_states.pt")]
    zero_names = [n for n in optim_names if _ZERO_RE.match(n)]
    if not zero_names:
        if optim_names:
            raise CheckpointFormatError(f"{folder}: optimizer files {optim_names[:3]} are not ZeRO shards "
                                        "(zero_pp_rank_*): only ZeRO stage 1/2/3 checkpoints can be converted")
        raise CheckpointFormatError(f"{folder}: can't find *_optim_states.pt files")
    first = SourceFile(os.path.join(folder, zero_names[0]))
    stage = zero_stage(first.path, _optim_state(first).get("zero_stage"))
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


def _check_complete(folder: str, grid: Dict[int, Dict[int, str]], what: str) -> int:
    dp = 1 + max(max(d) for d in grid.values())
    for mp, ranks in sorted(grid.items()):
        missing = [r for r in range(dp) if r not in ranks]
        if missing:
            example = next(iter(ranks.values()))
            name = re.sub(r"zero_pp_rank_\d+", f"zero_pp_rank_{missing[0]}", example)
            raise CheckpointFormatError(f"{folder}: {what} for dp rank(s) {missing} of mp rank {mp} are missing "
                                        f"(expected e.g. {name}; found dp ranks {sorted(ranks)})")
    return dp


def _discover_zero12(folder, names, zero_names, first, stage) -> ZeroCheckpoint:
    mp_names = sorted(n for n in names if n.startswith("mp_rank_"))
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
    model = [SourceFile(os.path.join(folder, n)) for n in mp_names]
    for mf in model:
        _model_state(mf)
    pp, tp = _parallel_dims(folder, model, names, sum(len(r) for r in grid.values()))
    if sorted(grid) != list(range(pp * tp)):
        raise CheckpointFormatError(f"{folder}: ZeRO shards exist for mp ranks {sorted(grid)}, but the model states "
                                    f"say pp={pp} x tp={tp}")
    opened = {os.path.basename(first.path): first}
    optim_grid = [[opened.get(grid[m][r]) or SourceFile(os.path.join(folder, grid[m][r])) for r in range(dp)]
                  for m in range(pp * tp)]
    optim = optim_grid[0]
    for sf in (sf for row in optim_grid for sf in row):
        osd = _optim_state(sf)
        check_zero12_shard(sf.path, osd)
        counts = osd.get("partition_count")
        # Dense groups are partitioned over all dp ranks; expert groups over their expert-data-parallel
        # group, a divisor of dp. A missing top rank file shows up as a largest count != files present.
        if isinstance(counts, list) and counts and (max(int(c) for c in counts) != dp
                                                    or any(dp % int(c) for c in counts)):
            raise CheckpointFormatError(f"{sf.path}: partition_count {counts} disagrees with the {dp} optimizer "
                                        "shards present in the folder (a rank file is missing or foreign)")
    return ZeroCheckpoint(folder, stage, dp, tp, pp, optim, model, list(model),
                          bf16_prefix=zero_names[0].startswith("bf16_"), optim_grid=optim_grid)


def _parallel_dims(folder, model, names, n_zero):
    """(pp, tp) as DeepSpeed derives them: checkpoint_parallel_dimensions, else the legacy file counts."""
    dims = [mf.load().get("checkpoint_parallel_dimensions") for mf in model]
    given = [d for d in dims if d is not None]
    if given:
        if len(given) != len(dims):
            raise CheckpointFormatError(f"{folder}: checkpoint_parallel_dimensions is missing from some model-state "
                                        "files")
        pairs = set()
        for mf, d in zip(model, dims):
            if not isinstance(d, dict):
                raise CheckpointFormatError(f"{mf.path}: checkpoint_parallel_dimensions must be a dictionary")
            vals = (d.get("pp_degree"), d.get("tp_degree"))
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise CheckpointFormatError(f"{mf.path}: checkpoint_parallel_dimensions must hold positive "
                                            f"pp_degree/tp_degree, got {d}")
            pairs.add(vals)
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
    missing_tp = [t for t in range(tp) if t not in grid]
    if missing_tp:
        raise CheckpointFormatError(f"{folder}: ZeRO-3 optimizer shards for tp rank(s) {missing_tp} are missing")
    model_names = [n for n in names if n.endswith("_model_states.pt") and not is_expert_model_file(n)]
    if not model_names:
        raise CheckpointFormatError(f"can't find ZeRO Stage 3 model state files in directory '{folder}'")
    by_rank = {}
    for n in model_names:
        m = _ZERO3_MODEL_RE.match(n)
        if m:
            by_rank[(int(m.group(2)), int(m.group(1)))] = n
    for t in range(tp):
        missing = [r for r in range(dp) if (t, r) not in by_rank]
        if missing:
            raise CheckpointFormatError(f"{folder}: ZeRO-3 model-state files for dp rank(s) {missing} of tp rank {t} "
                                        f"are missing (expected zero_pp_rank_{missing[0]}_mp_rank_{t:02d}_model_states.pt)")
    opened = {os.path.basename(first.path): first}
    optim_grid = [[opened.get(grid[t][r]) or SourceFile(os.path.join(folder, grid[t][r])) for r in range(dp)]
                  for t in range(tp)]
    model_grid = [[SourceFile(os.path.join(folder, by_rank[(t, r)])) for r in range(dp)] for t in range(tp)]
    for sf in (sf for row in optim_grid for sf in row):
        check_zero3_shard(sf.path, _optim_state(sf))
    # Every model-state file is copied into the output, so every one is parsed and checked, not
    # only the ones the plan reads.
    opened = {mf.path: mf for row in model_grid for mf in row}
    model_files = [opened.get(os.path.join(folder, n)) or SourceFile(os.path.join(folder, n)) for n in model_names]
    for mf in model_files:
        _model_state(mf)
    return ZeroCheckpoint(folder, 3, dp, tp, 1, optim_grid[0], model_grid[0], model_files,
                          bf16_prefix=zero3[0].startswith("bf16_"), optim_grid=optim_grid, model_grid=model_grid)
