"""One model-parallel rank's ZeRO-1/2 optimizer shards, in dp order, read when they are walked.

A 70B-class job at dp 4,096 has 4,096 shard files per model-parallel rank. Kept as records
(tensor and storage references, state dicts, slice mappings), they were 2 KB a rank and most of
a plan's memory, though a planner looks at each one once: it takes the byte ranges it needs and
moves on. A row keeps dp rank 0's whole record (``zero/optimizer_state.pt``, the hyper-parameters
and the topology come from it) and only the file names of the others; walking it reads the files
in order (their heads on native threads, as :func:`~pyckpt.formats.torch_zip.iter_sources` does)
and checks each one on the way, so a foreign or damaged shard is refused by the walk that meets
it, naming the file. A walk that stops early reads no further. Walking twice reads twice: the
planners walk once (:mod:`pyckpt.zero.stage12`).
"""

from __future__ import annotations

import os
from typing import Iterator, List

from ..errors import CheckpointFormatError
from ..formats.torch_zip import SourceFile, iter_sources
from .shards import ZeroShard, read_zero_shard


class ShardRow:
    """The shards ``names`` (dp rank order) of one mp rank; ``first`` is dp rank 0's record."""

    __slots__ = ("folder", "names", "first", "dp", "stage")

    def __init__(self, folder: str, names: List[str], first: ZeroShard, stage: int):
        self.folder = folder
        self.names = names
        self.dp = len(names)
        self.stage = stage
        self.first = first
        self._checked(first)

    def __len__(self) -> int:
        return self.dp

    def __iter__(self) -> Iterator[ZeroShard]:
        yield self.first
        for r, sf in enumerate(iter_sources(self.names[1:], folder=self.folder), start=1):
            yield self._read(sf, r)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[r] for r in range(*index.indices(self.dp))]
        r = index + self.dp if index < 0 else index
        if not 0 <= r < self.dp:
            raise IndexError(f"dp rank {index} of {self.dp}")
        if r == 0:
            return self.first
        return self._read(SourceFile(os.path.join(self.folder, self.names[r])), r)

    def _read(self, sf: SourceFile, r: int) -> ZeroShard:
        shard = self._checked(read_zero_shard(sf, r, self.dp))
        # Only dp rank 0's whole optimizer state is written out (zero/optimizer_state.pt); the
        # others' torch param_groups list every parameter's index (dp x params if kept), and their
        # parsed files are let go: a plan keeps the byte ranges it took, not the records.
        shard.saved = shard.param_groups = None
        sf.release()
        return shard

    def _checked(self, shard: ZeroShard) -> ZeroShard:
        if shard.stage != self.stage:
            raise CheckpointFormatError(f"{shard.path}: a ZeRO stage {shard.stage} shard beside stage {self.stage} "
                                        f"ones ({self.first.path})")
        counts = shard.partition_counts
        # Dense groups are partitioned over all dp ranks; expert groups over their expert-data-parallel
        # group, a divisor of dp. A missing top rank file shows up as a largest count != files present.
        if counts and (max(counts) != self.dp or any(self.dp % c for c in counts)):
            raise CheckpointFormatError(f"{shard.path}: partition_count {list(counts)} disagrees with the {self.dp} "
                                        "optimizer shards present in the folder (a rank file is missing or foreign)")
        return shard
