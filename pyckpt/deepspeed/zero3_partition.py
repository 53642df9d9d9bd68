"""ZeRO-3 partitioning: where a rank's piece of each parameter sits in its flat sub-group.

Under ZeRO-3 every parameter is split on its own: with W ranks in its partition group, each rank
holds ``q = ceil(numel / W)`` elements (the last rank's tail is padding), and a sub-group's flat
buffer is those per-parameter pieces back to back. Rank r's real elements of a parameter are
``max(0, min(q, numel - r*q))`` starting at the running offset.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Tuple

from ..formats.pickle_read import numel


def rank_pieces(sub_shapes: Mapping, count: int, rank: int) -> Iterator[Tuple[str, tuple, int, int, int]]:
    """(name, shape, numel, offset in the flat, real elements) for each parameter of a sub-group."""
    offset = 0
    for name, shape in sub_shapes.items():
        n = numel(shape)
        q = -(-n // count)
        yield name, shape, n, offset, max(0, min(q, n - rank * q))
        offset += q
