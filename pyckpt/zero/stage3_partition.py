"""ZeRO-3 partitioning: where a rank's piece of each parameter sits in its flat sub-group.

Under ZeRO-3 every parameter is split on its own: with W ranks in its partition group, each rank
holds ``q = ceil(numel / W)`` elements (the last rank's tail is padding), and a sub-group's flat
buffer is those per-parameter pieces back to back. Rank r's real elements of a parameter are
``max(0, min(q, numel - r*q))`` starting at the running offset.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Tuple

from ..errors import CheckpointFormatError
from ..tensors import numel
from .model_states import ModelStates
from .shards import FlatGroup, ZeroShard


def rank_pieces(sub_shapes: Mapping, count: int, rank: int) -> Iterator[Tuple[str, tuple, int, int, int]]:
    """(name, shape, numel, offset in the flat, real elements) for each parameter of a sub-group."""
    offset = 0
    for name, shape in sub_shapes.items():
        n = numel(shape)
        q = -(-n // count)
        yield name, shape, n, offset, max(0, min(q, n - rank * q))
        offset += q


def shard_pieces(model: ModelStates, shard: ZeroShard) -> Iterator[Tuple[FlatGroup, str, tuple, int, int, int]]:
    """(sub-group, name, shape, numel, offset, real elements) of every parameter in one rank's
    shard, the sub-groups' shapes taken from the model states saved beside it."""
    if len(shard.groups) != len(model.groups):
        raise CheckpointFormatError(f"{shard.path}: {len(shard.groups)} fp32 sub-groups, but param_shapes lists "
                                    f"{len(model.groups)}")
    for group, sub_shapes in zip(shard.groups, model.groups):
        for piece in rank_pieces(sub_shapes, group.partition_count, group.partition_rank):
            yield (group, ) + piece
