"""Whether a tensor's chunks tile it exactly: every element in one chunk, none in two, none left out.

The check works on the signed sum of the chunks' indicator functions minus the tensor's, which is zero
everywhere exactly when the chunks tile the tensor. A box ``[lo, hi)`` is the product over its
dimensions of "from lo on" minus "from hi on", so that sum is a signed sum of corners, and it is zero
exactly when every corner's weight cancels. Those weights are found one dimension at a time, with no
corner listed: along the first dimension, at each coordinate, the faces of the pieces that start
there minus those that end there must cancel as a sum in the remaining dimensions (the same question,
one dimension fewer). Equal faces cancel on the spot and a dimension that every piece spans alike is
passed over, so a grid (FSDP2's rows, tensor parallelism's columns, both at once) costs a sort of its
chunks in whichever dimension it is cut, O(n log n); so does any layout cut in one or two dimensions.

A layout whose faces do not cancel splits in two per dimension, so the work is bounded: any layout cut
in at most six dimensions is checked exactly; one that needs more work than that is refused as too
irregular to check (no job saves such a layout; a crafted one must not cost 2**60 steps).

Where the sum is not zero, its first nonzero corner in lexicographic order is an element of the tensor
whose coverage is wrong (every corner before it weighs nothing, so the sum there is that corner's
weight): the element covered twice, or not at all, that an error names.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)
# The work allowed, in faces split per chunk: a layout cut in d dimensions splits fewer than 2 ** d
# faces per chunk (the whole tensor's counted as one more chunk), so six dimensions always fit.
WORK_PER_CHUNK = 64


class LayoutTooIrregular(Exception):
    """The chunks' faces did not cancel within the work :data:`WORK_PER_CHUNK` allows."""


def tiling_fault(shape: Sequence[int], boxes: Sequence[Box],
                 work_per_chunk: int = WORK_PER_CHUNK) -> Optional[Tuple[Tuple[int, ...], List[int]]]:
    """None if ``boxes`` (each inside ``shape``) tile it exactly, else (an element, the indices of the
    boxes holding it): none (a gap) or several (an overlap). Empty boxes hold nothing and are allowed
    anywhere inside. :class:`LayoutTooIrregular` if the layout needs more work than allowed."""
    shape = tuple(shape)
    if any(n == 0 for n in shape):
        return None  # no element to cover; the boxes, inside it, are all empty
    faces: Dict[Tuple[tuple, tuple], int] = {}
    for offsets, sizes in boxes:
        if all(sizes):
            key = (tuple(offsets), tuple(o + s for o, s in zip(offsets, sizes)))
            faces[key] = faces.get(key, 0) + 1
    whole = ((0, ) * len(shape), shape)
    faces[whole] = faces.get(whole, 0) - 1
    faces = {k: w for k, w in faces.items() if w}
    if not faces:
        return None
    left = [work_per_chunk * (len(boxes) + 1)]
    point = _first_corner(faces, left)
    if point is None:
        return None
    holders = [i for i, (offsets, sizes) in enumerate(boxes)
               if all(o <= p < o + s for o, s, p in zip(offsets, sizes, point))]
    return point, holders


def _first_corner(faces: Dict[Tuple[tuple, tuple], int], left: List[int]) -> Optional[tuple]:
    """The lexicographically first corner of nonzero weight of the signed sum of ``faces`` ((lo, hi) ->
    weight, none zero), None if it is zero everywhere; ``left[0]``: the work still allowed."""
    (lo, hi), _ = next(iter(faces.items()))
    if not lo:
        return ()  # no dimension left: a nonzero constant
    a, b = lo[0], hi[0]
    if all(lo[0] == a and hi[0] == b for lo, hi in faces):
        # one interval in this dimension for every face: a common factor, nonzero; its first corner is at a
        found = _first_corner({(lo[1:], hi[1:]): w for (lo, hi), w in faces.items()}, left)
        return None if found is None else (a, ) + found
    # the faces split in two here (and only here): what bounds the work
    left[0] -= len(faces)
    if left[0] < 0:
        raise LayoutTooIrregular()
    net: Dict[Tuple[int, tuple, tuple], int] = {}  # (coordinate, face in the other dimensions) -> weight
    for (lo, hi), w in faces.items():
        tail = (lo[1:], hi[1:])
        start, stop = (lo[0], ) + tail, (hi[0], ) + tail
        net[start] = net.get(start, 0) + w
        net[stop] = net.get(stop, 0) - w
    uneven = sorted((key for key, w in net.items() if w), key=lambda key: key[0])
    for x, keys in itertools.groupby(uneven, key=lambda key: key[0]):
        found = _first_corner({key[1:]: net[key] for key in keys}, left)
        if found is not None:
            return (x, ) + found
    return None
