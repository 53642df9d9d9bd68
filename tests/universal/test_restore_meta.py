"""The element runs of pyckpt/universal/restore_meta.py against DeepSpeed 0.19.8's own slicing.

DeepSpeed's affine maps and AutoTP resolver are applied to an index tensor (element i holds i), so
what they return is the list of file elements they pick, in order; pyckpt's runs must list exactly
those. Fast: no training, only DeepSpeed's pure functions.
"""

from __future__ import annotations

import deepspeed.checkpoint.affine as affine
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from deepspeed.checkpoint.universal_checkpoint import _resolve_autotp_partition

from pyckpt.universal.restore_meta import NotACopy, affine_runs, autotp_runs


def _elements(runs) -> torch.Tensor:
    parts = [torch.arange(s, s + n) if s is not None else torch.full((n, ), -1) for s, n in runs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _index(shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel()).view(shape)


MAPS = {
    "column, uneven": (affine.contiguous_split_map((37, 16), [10, 9, 9, 9], 0), (37, 16)),
    "row (dim 1)": (affine.contiguous_split_map((16, 24), [12, 12], 1), (16, 24)),
    "dim 2 of 3-d": (affine.contiguous_split_map((4, 6, 10), [3, 3, 4], 2), (4, 6, 10)),
    "replicated": (affine.replicated_map((16, ), 2), (16, )),
    "fused qkv, uneven": (affine.sub_param_map((32, 16), [16, 8, 8], [[10, 6], [4, 4], [5, 3]], 0), (32, 16)),
    "fused along dim 1": (affine.sub_param_map((6, 48), [24, 24], [[12, 12], [12, 12]], 1), (6, 48)),
    "segmented": (affine.segmented_map((20, 8), [(8, False), (4, True), (8, False)], 0, 2, [[4, 4], [4, 4]]),
                  (20, 8)),
    "block gather": (affine.block_gather_map((24, 4), {0: [0, 2, 3], 1: [1, 4, 5]}, 4, 0), (24, 4)),
}


@pytest.mark.parametrize("name", list(MAPS))
def test_affine_runs_pick_what_deepspeeds_extract_picks(name):
    m, shape = MAPS[name]
    for rank in m.pieces_by_rank:
        expected = m.extract(_index(shape), rank).flatten()
        assert torch.equal(_elements(affine_runs(m.to_dict(), rank)), expected), (name, rank)
    assert affine_runs(m.to_dict(), max(m.pieces_by_rank) + 1) is None


def test_a_scaled_piece_is_not_a_copy():
    m = affine.replicated_map((16, ), 2, scale=0.5)
    with pytest.raises(NotACopy, match="scale 0.5"):
        affine_runs(m.to_dict(), 0)


class _Param:
    def __init__(self, meta):
        self.ds_autotp_universal_checkpoint_meta = meta


def _meta(**fields):
    base = {"universal_checkpoint_version": 0.4, "partition_dim": 0, "logical_shape": None, "sub_param_shape": None,
            "sub_param_sizes": None, "sub_param_shard_widths": None, "partition_sizes": None, "replicated": False,
            "conversion": {}}
    base.update(fields)
    return base


AUTOTP = {
    "affine map": (_meta(logical_shape=(16, 24), partition_dim=1,
                         conversion={"affine_map": affine.contiguous_split_map((16, 24), [12, 12], 1).to_dict()}),
                   (16, 24), 2),
    "partition_sizes": (_meta(logical_shape=(37, 16), partition_sizes=(10, 9, 9, 9)), (37, 16), 4),
    "sub-parameter widths": (_meta(logical_shape=(32, 16), sub_param_sizes=(16, 8, 8),
                                   sub_param_shard_widths=[[10, 6], [4, 4], [5, 3]]), (32, 16), 2),
    "sub_param_shape before 0.4": (_meta(universal_checkpoint_version=0.3, logical_shape=(48, 16),
                                         sub_param_shape=((24, 24), -1)), (48, 16), 4),
    "even split, dim 1": (_meta(logical_shape=(16, 24), partition_dim=1), (16, 24), 4),
    "replicated": (_meta(partition_dim=None, replicated=True, logical_shape=(16, )), (16, ), 2),
    "flat file, logical view": (_meta(logical_shape=(16, 24), partition_dim=1), (384, ), 2),
}


@pytest.mark.parametrize("name", list(AUTOTP))
def test_autotp_runs_pick_what_deepspeeds_resolver_picks(name):
    meta, shape, tp = AUTOTP[name]
    full = _index(shape)
    base = [(0, full.numel())]
    for rank in range(tp):
        expected = _resolve_autotp_partition(_Param(meta), {}, full, rank, tp)
        got = autotp_runs(meta, shape, base, rank, tp, "fp32")
        assert torch.equal(_elements(got), expected.flatten()), (name, rank)


@pytest.mark.parametrize("meta,shape,tp", [
    (_meta(logical_shape=(10, 4)), (10, 4), 4),  # uneven without partition_sizes
    (_meta(logical_shape=(32, 16), sub_param_sizes=(16, 8, 8), sub_param_shard_widths=[[10, 6], [4, 4]]), (32, 16), 2),
    (_meta(logical_shape=(8, 8), conversion={"unsupported_reason": "fused layout of an unknown kind"}), (8, 8), 2),
    (_meta(logical_shape=(9, 4)), (8, 4), 2),  # the metadata describes another parameter
])
def test_autotp_errors_are_deepspeeds(meta, shape, tp):
    full = _index(shape)
    with pytest.raises(Exception) as theirs:
        _resolve_autotp_partition(_Param(meta), {}, full, 1, tp)
    with pytest.raises(type(theirs.value)) as ours:
        autotp_runs(meta, shape, [(0, full.numel())], 1, tp, "fp32")
    assert str(ours.value) == str(theirs.value)


def test_no_metadata_or_no_partition_dim_falls_back_to_the_generic_cut():
    assert autotp_runs(None, (4, 4), [(0, 16)], 0, 2, "fp32") is None
    assert autotp_runs(_meta(partition_dim=None, logical_shape=(4, 4)), (4, 4), [(0, 16)], 0, 2, "fp32") is None


@st.composite
def _split_maps(draw):
    """A random DeepSpeed affine map: a contiguous or fused-sub-parameter split of a random 1- to 3-d
    tensor along a random dimension, with random (uneven, possibly zero) per-rank widths."""
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 7)) for _ in range(ndim)]
    dim = draw(st.integers(0, ndim - 1))
    tp = draw(st.integers(1, 4))
    n_sub = draw(st.integers(1, 3))
    subs = []
    for _ in range(n_sub):
        widths = [draw(st.integers(0, 4)) for _ in range(tp)]
        if sum(widths) == 0:
            widths[0] = 1
        subs.append(widths)
    shape[dim] = sum(sum(w) for w in subs)
    if n_sub == 1:
        return affine.contiguous_split_map(tuple(shape), subs[0], dim), tuple(shape)
    return affine.sub_param_map(tuple(shape), [sum(w) for w in subs], subs, dim), tuple(shape)


@settings(max_examples=200, deadline=None)
@given(_split_maps())
def test_affine_runs_match_deepspeed_on_random_splits(case):
    m, shape = case
    for rank in m.pieces_by_rank:
        expected = m.extract(_index(shape), rank).flatten()
        assert torch.equal(_elements(affine_runs(m.to_dict(), rank)), expected), (shape, rank)
