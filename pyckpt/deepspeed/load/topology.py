"""The topology a ZeRO checkpoint was saved at and the one an engine runs at.

Under ``enable()`` a plain ``engine.load_checkpoint(dir, tag)`` stays DeepSpeed's own where the two
agree; where they differ DeepSpeed's own load cannot serve it (ZeRO-1/2 refuses another
data-parallel size with ``ZeRORuntimeException``, and every shard is cut for the saved sizes), so the
load reshards straight from the ZeRO shards (:mod:`.resume`). The saved topology is read from the
first model-state file's metadata (``dp_world_size``, ``mp_world_size``, ``ds_config``, AutoEP's
layers), as DeepSpeed 0.19.8's ``_save_checkpoint`` writes it; the engine's from the same fields
DeepSpeed compares (``seq_dp_world_size``, ``mp_world_size``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ...errors import CheckpointFormatError, quoted
from ...formats.confined import inside
from ...formats.torch_zip import SourceFile
from ...zero.discovery import zero_shard_grid
from ...zero.model_states import ModelStates, read_model_states
from ...zero.shards import read_zero_shard

# The model-state file of model-parallel rank 0: ZeRO-1/2, then ZeRO-3 (data-parallel rank 0).
FIRST_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


@dataclass(frozen=True)
class Topology:
    stage: Optional[int]  # ZeRO stage (None where the checkpoint does not say)
    dp: int  # data-parallel size (the sequence-data-parallel group DeepSpeed partitions over)
    tp: int  # model-parallel size (AutoTP or Megatron tensor parallelism)
    ep: Optional[int] = None  # AutoEP size; None without AutoEP

    def __str__(self) -> str:
        parts = [f"ZeRO-{self.stage}" if self.stage is not None else "ZeRO", f"data-parallel {self.dp}",
                 f"tensor-parallel {self.tp}"]
        if self.ep is not None:
            parts.append(f"expert-parallel {self.ep}")
        return ", ".join(parts)

    def partitioned_like(self, other: "Topology") -> bool:
        """Whether a checkpoint saved at ``self`` is cut as ``other`` cuts it: same sizes, and stages
        that partition alike (ZeRO-1 and ZeRO-2 shards are the same files)."""
        same_stage = self.stage is None or other.stage is None or (self.stage == 3) == (other.stage == 3)
        return same_stage and (self.dp, self.tp, self.ep) == (other.dp, other.tp, other.ep)


def first_model_states(folder: str) -> ModelStates:
    names = set(os.listdir(folder))
    for name in FIRST_MODEL_STATES:
        if name in names:
            return read_model_states(SourceFile(inside(folder, name)))  # a link out of the folder is refused
    raise CheckpointFormatError(f"{folder}: no {' or '.join(FIRST_MODEL_STATES)}")


def saved(folder: str) -> Topology:
    """The topology of the ZeRO checkpoint in ``folder`` (a tag folder), from its metadata."""
    ms = first_model_states(folder)
    where = ms.path
    dp, tp = ms.dp_world_size, ms.mp_world_size
    for key, value in (("dp_world_size", dp), ("mp_world_size", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointFormatError(f"{where}: {key} is {quoted(value)}, not a positive integer")
    zero = ms.ds_config.get("zero_optimization") if isinstance(ms.ds_config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        stage = 3 if os.path.basename(where).startswith("zero_pp_rank_") else None
    ep = None
    layers = ms.autoep_layers
    if isinstance(layers, (list, tuple)) and layers:
        sizes = {layer.get("ep_size") if isinstance(layer, dict) else None for layer in layers}
        if len(sizes) != 1 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
            raise CheckpointFormatError(f"{where}: ds_autoep_layers name ep sizes {sorted(map(repr, sizes))}, "
                                        "not one positive size")
        ep = sizes.pop()
    _check_against_shards(folder, where, dp, tp, stage)
    return Topology(stage, dp, tp, ep)


def _check_against_shards(folder: str, where: str, dp: int, tp: int, stage: Optional[int]) -> None:
    """The sizes a model-state file records are only what it says: who loads what is decided from
    them, so they must be the shards' own. The shards of every model-parallel rank must be complete,
    as many per rank as ``dp`` says, and the partition counts dp rank 0's shard records must agree;
    a file that lies (a checkpoint saved at dp 3 whose metadata says 2) would otherwise load the
    wrong slices without a word."""
    grid = zero_shard_grid(folder, os.listdir(folder), zero3=stage == 3)
    files = len(grid[min(grid)])
    if len(grid) % tp:
        raise CheckpointFormatError(f"{where}: mp_world_size is {tp}, but {folder} holds ZeRO shards of "
                                    f"{len(grid)} model-parallel ranks, not a multiple of it")
    first = read_zero_shard(SourceFile(inside(folder, grid[min(grid)][0])), 0, files)
    counts = list(first.partition_counts) or [g.partition_count for g in first.groups]
    # dense groups span every dp rank, expert groups a divisor of them (as the converter's reader checks)
    if counts and (max(counts) != files or any(files % c for c in counts)):
        raise CheckpointFormatError(f"{first.path}: partition_count {counts} disagrees with the {files} optimizer "
                                    "shards of its model-parallel rank in the folder (a rank file is missing or "
                                    "foreign)")
    if dp != files:
        raise CheckpointFormatError(f"{where}: dp_world_size is {dp}, but the checkpoint's shards are cut for "
                                    f"{files} data-parallel ranks ({files} optimizer shards per model-parallel "
                                    f"rank, partition_count {counts}): the recorded topology is not the shards'; "
                                    "nothing was loaded")


def current(engine) -> Topology:
    """The topology ``engine`` runs at, in the terms :func:`saved` reads."""
    config = getattr(engine._config, "expert_parallel_config", None)
    ep = config.autoep_size if config is not None and getattr(config, "enabled", False) else None
    return Topology(int(engine.zero_optimization_stage()), engine.seq_dp_world_size, engine.mp_world_size, ep)
