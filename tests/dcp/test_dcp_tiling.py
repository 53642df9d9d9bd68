"""Whether a DCP tensor's chunks tile it (pyckpt/dcp/tiling.py, read.check_tiling): against a brute-force
oracle that counts, element by element, the chunks holding it. hypothesis draws arbitrary boxes (mostly
broken layouts), valid layouts made by random guillotine cuts and grids (in any dimension order), and
those layouts damaged by one edit; every verdict must be the oracle's, and a refusal must name an element
the oracle finds in no chunk or in several, with exactly the chunks that hold it.

The work of the check is counted in profiler events, not timed: a layout cut along the last dimension cost
one comparison per pair of chunks (20,000 chunks of a [1, 20000] tensor kept `pyckpt inspect` busy past a
minute), and the count shows the growth in the number of chunks whatever the machine's speed. The seconds
are in benchmarks/dcp_tiling.py.
"""

from __future__ import annotations

import itertools
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyckpt.dcp.read import Chunk, DcpTensor, check_tiling
from pyckpt.dcp.tiling import LayoutTooIrregular, tiling_fault
from pyckpt.errors import CheckpointFormatError, UnsupportedCheckpointError


def props(n):
    # derandomized: the same examples on every run and machine, so a failure reproduces from CI
    return settings(derandomize=True, database=None, deadline=None, max_examples=n,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def holders(shape, boxes, point) -> list:
    return [i for i, (o, s) in enumerate(boxes) if all(a <= p < a + n for a, n, p in zip(o, s, point))]


def oracle(shape, boxes) -> bool:
    """Every element of ``shape`` in exactly one box."""
    return all(len(holders(shape, boxes, p)) == 1 for p in itertools.product(*(range(n) for n in shape)))


def agrees(shape, boxes) -> None:
    """tiling_fault's verdict is the oracle's; a fault names an element inside the tensor, held by no box or
    several, and exactly the boxes holding it."""
    fault = tiling_fault(shape, boxes)
    assert (fault is None) == oracle(shape, boxes), (shape, boxes, fault)
    if fault is not None:
        point, held = fault
        assert len(point) == len(shape) and all(0 <= p < n for p, n in zip(point, shape)), fault
        assert held == holders(shape, boxes, point) and len(held) != 1, fault


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def boxes_in(draw, shape, max_boxes=7):
    out = []
    for _ in range(draw(st.integers(0, max_boxes))):
        offsets = tuple(draw(st.integers(0, n)) for n in shape)
        out.append((offsets, tuple(draw(st.integers(0, n - o)) for o, n in zip(offsets, shape))))
    return out


@st.composite
def any_layout(draw):
    shape = draw(shapes)
    return shape, draw(boxes_in(shape))


@st.composite
def guillotine(draw, max_dims=4):
    """A valid layout: the tensor cut in two along a random dimension at a random point, each part again,
    down to a random depth (not a grid: the cuts of one part need not continue into the other), with
    empty chunks sprinkled in, in a random order."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=max_dims)))

    def cut(offsets, sizes, depth):
        splittable = [d for d, s in enumerate(sizes) if s > 1]
        if depth == 0 or not splittable or not draw(st.booleans()):
            return [(offsets, sizes)]
        d = draw(st.sampled_from(splittable))
        at = draw(st.integers(1, sizes[d] - 1))
        left = sizes[:d] + (at, ) + sizes[d + 1:]
        right_off = offsets[:d] + (offsets[d] + at, ) + offsets[d + 1:]
        right = sizes[:d] + (sizes[d] - at, ) + sizes[d + 1:]
        return cut(offsets, left, depth - 1) + cut(right_off, right, depth - 1)

    boxes = cut((0, ) * len(shape), shape, draw(st.integers(0, 6)))
    for _ in range(draw(st.integers(0, 2))):  # empty chunks (FSDP2 on more ranks than rows) are allowed
        d = draw(st.integers(0, len(shape) - 1))
        offsets = tuple(draw(st.integers(0, n)) for n in shape)
        sizes = tuple(0 if i == d else draw(st.integers(0, n - o)) for i, (o, n) in enumerate(zip(offsets, shape)))
        boxes.append((offsets, sizes))
    return shape, draw(st.permutations(boxes))


@st.composite
def damaged(draw):
    """A valid layout after one edit: a chunk moved, grown, shrunk, dropped or repeated."""
    shape, boxes = draw(guillotine())
    boxes = list(boxes)
    i = draw(st.integers(0, len(boxes) - 1))
    offsets, sizes = boxes[i]
    edit = draw(st.sampled_from(["move", "grow", "shrink", "drop", "repeat"]))
    d = draw(st.integers(0, len(shape) - 1))
    if edit == "drop":
        del boxes[i]
    elif edit == "repeat":
        boxes.append(boxes[i])
    else:
        o, s = list(offsets), list(sizes)
        if edit == "move" and o[d] + s[d] < shape[d]:
            o[d] += 1
        elif edit == "move" and o[d] > 0:
            o[d] -= 1
        elif edit == "grow" and o[d] + s[d] < shape[d]:
            s[d] += 1
        elif edit == "shrink" and s[d] > 0:
            s[d] -= 1
        boxes[i] = (tuple(o), tuple(s))
    return shape, boxes


@props(300)
@given(any_layout())
def test_any_boxes_against_the_oracle(layout):
    agrees(*layout)


@props(200)
@given(guillotine())
def test_guillotine_layouts_tile(layout):
    shape, boxes = layout
    assert oracle(shape, boxes)
    assert tiling_fault(shape, boxes) is None


@props(300)
@given(damaged())
def test_a_damaged_layout_against_the_oracle(layout):
    agrees(*layout)


def _grid(shape, cuts):
    spans = []
    for d, n in enumerate(shape):
        points = [0, *cuts.get(d, []), n]
        spans.append([(a, b - a) for a, b in zip(points, points[1:])])
    return [(tuple(o for o, _ in cell), tuple(s for _, s in cell)) for cell in itertools.product(*spans)]


@pytest.mark.parametrize("shape,cuts", [
    ((7, 5), {0: [3, 6]}), ((4, 6), {1: [2, 5]}), ((6, 8), {0: [2, 4], 1: [3]}), ((3, 4, 6), {1: [2], 2: [1, 4]}),
    ((1, 9), {1: list(range(1, 9))}), ((2, 1, 1, 5), {0: [1], 3: [1, 2, 3, 4]}), ((), {}), ((0, 4), {})])
def test_grids_in_any_dimension_and_every_one_chunk_removed_or_repeated(shape, cuts):
    boxes = _grid(shape, cuts)
    assert tiling_fault(shape, boxes) is None
    for i in range(len(boxes)):
        agrees(shape, boxes[:i] + boxes[i + 1:])
        agrees(shape, boxes + [boxes[i]])


def _tensor(shape, boxes) -> DcpTensor:
    return DcpTensor("model.w", ("model", "w"), "float32", tuple(shape), [Chunk(o, s) for o, s in boxes])


def test_check_tiling_names_the_overlapping_chunks_and_the_element():
    # volumes that add up (2 + 2 + 1 + 1 = 6), an element held twice and one held by none
    boxes = [((0, 0), (1, 2)), ((0, 1), (1, 2)), ((1, 0), (1, 1)), ((1, 2), (1, 1))]
    with pytest.raises(CheckpointFormatError) as caught:
        check_tiling("/ck/.metadata", _tensor((2, 3), boxes))
    assert str(caught.value) == ("/ck/.metadata: chunks at [0, 0] and [0, 1] of 'model.w' overlap (both hold "
                                 "element [0, 1])")


def test_check_tiling_names_an_element_in_no_chunk():
    # the same volume as the tensor, but the first element is in a hole and another element twice
    boxes = [((0, 1), (1, 1)), ((1, 0), (1, 2)), ((0, 1), (1, 1))]
    with pytest.raises(CheckpointFormatError) as caught:
        check_tiling("/ck/.metadata", _tensor((2, 2), boxes))
    assert str(caught.value) == ("/ck/.metadata: element [0, 0] of 'model.w' is in none of its chunks: they do not "
                                 "tile it")


@props(150)
@given(st.lists(st.integers(1, 2), min_size=4, max_size=6).map(tuple).flatmap(
    lambda shape: st.tuples(st.just(shape), boxes_in(shape, 9))))
def test_any_boxes_cut_in_up_to_six_dimensions_are_checked_within_the_work_allowed(layout):
    agrees(*layout)  # LayoutTooIrregular would fail it


def _bricks(dims: int, variant: int = 0) -> list:
    """A valid layout of a [4] * dims tensor whose faces never line up: along dimension 0 it is cut at 2
    (variant 0) or at 1 and 3 (variant 1), and each slab is cut the same way in the next dimensions in the
    other variant from its neighbour's."""
    if dims == 0:
        return [((), ())]
    cuts = [(0, 2), (2, 2)] if variant == 0 else [(0, 1), (1, 2), (3, 1)]
    return [((o, ) + oo, (s, ) + ss) for j, (o, s) in enumerate(cuts)
            for oo, ss in _bricks(dims - 1, (variant + j) % 2)]


def test_a_layout_too_irregular_to_check_is_refused_with_one_line():
    """Faces that never cancel double the work per dimension: seven dimensions of such bricks are checked,
    eight outrun the work allowed and are refused as unsupported (not as broken) in one line naming the
    tensor, at a bounded cost."""
    seven = _bricks(7)
    assert tiling_fault((4, ) * 7, seven) is None
    check_tiling("/ck/.metadata", _tensor((4, ) * 7, seven))
    eight = _bricks(8)
    with pytest.raises(LayoutTooIrregular):
        tiling_fault((4, ) * 8, eight)
    assert tiling_fault((4, ) * 8, eight, work_per_chunk=10 ** 9) is None  # it is a tiling
    with pytest.raises(UnsupportedCheckpointError) as caught:
        check_tiling("/ck/.metadata", _tensor((4, ) * 8, eight))
    assert str(caught.value) == ("/ck/.metadata: the 1597 chunks of 'model.w' (size [4, 4, 4, 4, 4, 4, 4, 4]) form "
                                 "a layout too irregular for pyckpt to check that they tile it")


# ---------------------------------------------------------------------------------------------- the work


class _Over(Exception):
    pass


def _events(tensor: DcpTensor, cap: int):
    """Profiler events (calls and returns, Python's and builtins') of check_tiling on ``tensor``; None past
    ``cap`` (the check is stopped there)."""
    count = [0]

    def profile(frame, event, arg):
        count[0] += 1
        if count[0] > cap:
            raise _Over()

    sys.setprofile(profile)
    try:
        check_tiling("/ck/.metadata", tensor)
    except _Over:
        return None
    finally:
        sys.setprofile(None)
    return count[0]


LAYOUTS = {
    "rows": lambda n: ((n, 3), [((i, 0), (1, 3)) for i in range(n)]),
    "columns": lambda n: ((3, n), [((0, i), (3, 1)) for i in range(n)]),
    "last_of_three": lambda n: ((2, 2, n), [((a, b, i), (1, 1, 1)) for a in range(2) for b in range(2)
                                            for i in range(n)]),
    "grid": lambda n: ((n, n), [((i, j), (1, 1)) for i in range(n) for j in range(n)]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_work_grows_with_the_chunks_in_any_dimension_order(name):
    """Four times the chunks, about four times the work (a sort, done by the interpreter's own code, is
    not counted), whichever dimension the tensor is cut in; a check that compares chunks pairwise does
    sixteen times the work and passes the cap of 500 events per chunk."""
    small, big = (30, 60) if name == "grid" else (500, 2000)
    counts = []
    for n in (small, big):
        shape, boxes = LAYOUTS[name](n)
        tensor = _tensor(shape, list(reversed(boxes)))
        counts.append(_events(tensor, 500 * len(boxes)))
    assert None not in counts, counts
    assert counts[1] < 4.5 * counts[0], counts
