"""Finding a DeepSpeed checkpoint's files and its topology (ZeRO stage, dp/tp/pp degrees).

Mirrors how DeepSpeed 0.19.8 names and discovers files (engine.py save helpers, ds_to_universal.py,
checkpoint/reshape_utils.py), but checks what DeepSpeed leaves to chance: a missing rank file or a
partition count that disagrees with the files present is an error naming the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .archive import SourceFile
from .errors import CheckpointFormatError, UnsupportedCheckpointError
from .safe_pickle import Opaque

ZERO_PREFIXES = ("zero_pp_rank_", "fp16_zero_pp_rank_", "bf16_zero_pp_rank_")
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
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        tag_dir = os.path.join(path, tag)
        if not os.path.isdir(tag_dir):
            raise CheckpointFormatError(f"{latest} names tag {tag!r}, but {tag_dir} does not exist")
        return tag_dir
    raise CheckpointFormatError(f"{path}: no *_optim_states.pt files and no 'latest' file: not a DeepSpeed ZeRO "
                                "checkpoint folder (pass the tag folder, e.g. .../global_step100, or its parent)")


def zero_stage_of(value) -> int:
    """ZeroStageEnum comes back as an inert record; DeepSpeed's BF16_Optimizer writes none (stage 1)."""
    if value is None:
        return 1
    if isinstance(value, Opaque):
        return int(value.value)
    return int(value)


@dataclass
class ZeroCheckpoint:
    """The files of one tag folder and the topology they imply."""

    folder: str
    stage: int
    dp: int
    tp: int = 1
    pp: int = 1
    # ZeRO-1/2: optim[dp] (tp = pp = 1 here); ZeRO-3: optim[dp] (tp = 1 here)
    optim: List[SourceFile] = field(default_factory=list)
    # ZeRO-1/2: the mp_rank_* files; ZeRO-3: zero_pp_rank_*_model_states.pt by dp rank
    model: List[SourceFile] = field(default_factory=list)
    # every non-expert *_model_states.pt path, copied to the universal folder
    model_paths: List[str] = field(default_factory=list)
    bf16_prefix: bool = False

    @property
    def optim_state(self):
        return [sf.load()["optimizer_state_dict"] for sf in self.optim]


def _optim_state(sf: SourceFile):
    obj = sf.load()
    if not isinstance(obj, dict) or "optimizer_state_dict" not in obj:
        raise CheckpointFormatError(f"{sf.path}: no 'optimizer_state_dict' key: not a DeepSpeed ZeRO optimizer "
                                    "shard")
    return obj["optimizer_state_dict"]


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
    stage = zero_stage_of(_optim_state(first).get("zero_stage"))
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
    if not mp_names:
        raise CheckpointFormatError(f"{folder} seems a bogus DeepSpeed checkpoint folder: no mp_rank_* model-state "
                                    "files")
    grid = _rank_table(folder, zero_names)
    dp = _check_complete(folder, grid, "ZeRO optimizer shards")
    model = [SourceFile(os.path.join(folder, n)) for n in mp_names]
    if not isinstance(model[0].load(), dict):
        raise CheckpointFormatError(f"{model[0].path}: model-state file does not hold a dict")
    dims = model[0].load().get("checkpoint_parallel_dimensions")
    tp = pp = 1
    if isinstance(dims, dict):
        pp, tp = int(dims.get("pp_degree", 1)), int(dims.get("tp_degree", 1))
    if tp * pp != 1 or len(mp_names) != 1 or len(grid) != 1:
        raise UnsupportedCheckpointError(f"{folder}: tensor/pipeline-parallel checkpoints (tp={tp}, pp={pp}, "
                                  f"{len(mp_names)} model-state files) are not supported by this version of pyckpt")
    optim = [first if grid[0][r] == os.path.basename(first.path) else SourceFile(os.path.join(folder, grid[0][r]))
             for r in range(dp)]
    for r, sf in enumerate(optim):
        osd = _optim_state(sf)
        counts = osd.get("partition_count")
        # Dense groups are partitioned over all dp ranks; expert groups over their expert-data-parallel
        # group, a divisor of dp. A missing top rank file shows up as a largest count != files present.
        if isinstance(counts, list) and counts and (max(int(c) for c in counts) != dp
                                                    or any(dp % int(c) for c in counts)):
            raise CheckpointFormatError(f"{sf.path}: partition_count {counts} disagrees with the {dp} optimizer "
                                        "shards present in the folder (a rank file is missing or foreign)")
        if not isinstance(osd.get("base_optimizer_state"), dict):
            raise CheckpointFormatError(f"{sf.path}: base_optimizer_state is not a dict: elastic checkpoints "
                                        "(zero_optimization.elastic_checkpoint=true) cannot be converted")
    return ZeroCheckpoint(folder, stage, dp, tp, pp, optim, model, [m.path for m in model],
                          bf16_prefix=zero_names[0].startswith("bf16_"))


def _discover_zero3(folder, names, zero_names, first) -> ZeroCheckpoint:
    zero3 = [n for n in zero_names if not n.startswith("fp16_")]
    grid = _rank_table(folder, zero3)
    dp = _check_complete(folder, grid, "ZeRO-3 optimizer shards")
    if len(grid) != 1:
        raise UnsupportedCheckpointError(
            f"{folder}: ZeRO-3 with tensor parallelism ({len(grid)} mp ranks) is not supported by this version of "
            "pyckpt (nor is AutoEP combined with AutoTP, which DeepSpeed's converter refuses too)")
    model_names = [n for n in names if n.endswith("_model_states.pt") and not is_expert_model_file(n)]
    if not model_names:
        raise CheckpointFormatError(f"can't find ZeRO Stage 3 model state files in directory '{folder}'")
    by_rank = {}
    for n in model_names:
        m = _ZERO3_MODEL_RE.match(n)
        if m:
            by_rank[int(m.group(1))] = n
    missing = [r for r in range(dp) if r not in by_rank]
    if missing:
        raise CheckpointFormatError(f"{folder}: ZeRO-3 model-state files for dp rank(s) {missing} are missing "
                                    f"(expected zero_pp_rank_{missing[0]}_mp_rank_00_model_states.pt)")
    optim = [first if grid[0][r] == os.path.basename(first.path) else SourceFile(os.path.join(folder, grid[0][r]))
             for r in range(dp)]
    model = [SourceFile(os.path.join(folder, by_rank[r])) for r in range(dp)]
    return ZeroCheckpoint(folder, 3, dp, 1, 1, optim, model, [os.path.join(folder, n) for n in model_names],
                          bf16_prefix=zero3[0].startswith("bf16_"))
