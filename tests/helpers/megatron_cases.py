"""The Megatron-style TP x PP cases (test helper): the parameters and the universal-checkpoint info of
each, built by :mod:`tp_builder`. tests/zero/test_megatron_tp_pp.py proves them against DeepSpeed's
converter; tests/deepspeed/load/test_zero_view.py reads them through the direct resume's view."""

import torch
from tp_builder import Param, perturb, replicate, split_dim, sub_params, two_sub_params

H = 6


def _t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def megatron_params():
    """Two pipeline stages, tp 2: every merge rule once, a tied vocabulary on both end stages."""
    qkv0 = [[3, 1], [1, 1], [2, 0]]  # uneven: tp rank 1 holds no v rows
    qkv1 = [[4, 0], [2, 0], [2, 0]]  # tp rank 1 holds nothing at all
    return [
        Param("word_embeddings.weight", _t(12, H, seed=1), split_dim(0), stages=(0, 1)),
        Param("layers.0.input_layernorm.weight", _t(H, seed=2), replicate),
        Param("layers.0.attention.query_key_value.weight", _t(8, H, seed=3), sub_params([4, 2, 2], qkv0, 0)),
        Param("layers.0.attention.dense.weight", _t(H, 8, seed=4), split_dim(1)),
        Param("layers.0.post_attention_layernorm.weight", _t(H, seed=5), perturb),
        Param("layers.0.mlp.dense_h_to_4h.weight", _t(16, H, seed=6), two_sub_params),
        Param("layers.0.mlp.dense_4h_to_h.weight", _t(H, 8, seed=7), split_dim(1, [5, 3])),
        Param("layers.1.input_layernorm.weight", _t(H, seed=8), replicate, stages=(1, )),
        Param("layers.1.attention.query_key_value.weight", _t(8, H, seed=9), sub_params([4, 2, 2], qkv1, 0),
              stages=(1, )),
        Param("layers.1.attention.dense.weight", _t(H, 8, seed=10), split_dim(1), stages=(1, )),
        Param("layers.1.mlp.dense_h_to_4h.weight", _t(16, H, seed=11), two_sub_params, stages=(1, )),
        Param("layers.1.mlp.dense_4h_to_h.bias", _t(H, seed=12), replicate, stages=(1, )),
        Param("final_layernorm.weight", _t(H, seed=13), replicate, stages=(1, )),
    ], {"layers\\.0\\.attention\\.query_key_value\\.weight": qkv0,
        "layers\\.1\\.attention\\.query_key_value\\.weight": qkv1}


def megatron_info(widths):
    return {
        "universal_checkpoint_version": 0.4,
        "tp_replicated_parameter_patterns": [r"layers\.\d+\.input_layernorm\.weight", r"final_layernorm\.weight",
                                             r"layers\.\d+\.mlp\.dense_4h_to_h\.bias"],
        "parameter_to_average_patterns": [r"layers\.\d+\.post_attention_layernorm\.weight"],
        "parameter_with_row_parallelism_patterns": [r"layers\.\d+\.attention\.dense\.weight",
                                                    r"layers\.\d+\.mlp\.dense_4h_to_h\.weight"],
        "vocabulary_parameter_patterns": [r"word_embeddings\.weight"],
        "pipeline_replicated_parameter_patterns": [r"word_embeddings\.weight"],
        "parameter_with_2_sub_params_cat_dim_0": [r"layers\.\d+\.mlp\.dense_h_to_4h\.weight"],
        "parameter_with_sub_params": [{"patterns": list(widths), "shape": ((4, 2, 2), H), "partition_dim": 0}],
        "sub_param_shard_widths": widths,
        "original_vocab_size": 10,
    }


def legacy_params():
    """uc version 0.3: sub-parameters given as a count (shape (3, -1)), even split only."""
    return [
        Param("qkv.weight", _t(12, H, seed=20), sub_params([4, 4, 4], [[2, 2]] * 3, 0)),
        Param("out.weight", _t(H, 12, seed=21), split_dim(1)),
        Param("head.weight", _t(12, H, seed=22), split_dim(0)),
    ]


LEGACY_INFO = {
    "universal_checkpoint_version": 0.3,
    "parameter_with_sub_params": [{"patterns": [r"qkv\.weight"], "shape": (3, -1), "partition_dim": 0}],
    "parameter_with_row_parallelism_patterns": [r"out\.weight"],
}


def affine_params():
    """Layouts described only by 0.19.8 affine maps (no category pattern): a column split along dim 1
    with uneven widths, a replicated tensor, and a map on a parameter that also matches a pattern."""
    return [
        Param("geo.weight", _t(4, 10, seed=30), split_dim(1, [7, 3])),
        Param("norm.weight", _t(5, seed=31), replicate),
        Param("proj.weight", _t(8, 6, seed=32), split_dim(0, [5, 3])),
    ]


def _column_map(rows, cols, widths):
    ranks, off = {}, 0
    for r, w in enumerate(widths):
        ranks[r] = {"shard_shape": [rows, w], "pieces": [{"shape": [rows, w], "source": [off, [cols, 1]],
                                                           "dest": [0, [w, 1]], "locations": [r]}]}
        off += w
    return {"logical_shape": [rows, cols], "ranks": ranks}


def _replicated_map(n, tp):
    return {"logical_shape": [n], "ranks": {r: {"shard_shape": [n], "pieces": [
        {"shape": [n], "source": [0, [1]], "dest": [0, [1]], "locations": list(range(tp))}]} for r in range(tp)}}


AFFINE_INFO = {
    "universal_checkpoint_version": 0.4,
    "parameter_with_row_parallelism_patterns": [r"proj\.weight"],  # superseded by the map below
    "affine_map": {"version": 1, "params": {
        r"geo\.weight": _column_map(4, 10, [7, 3]),
        r"norm\.weight": _replicated_map(5, 2),
        r"proj\.weight": {"logical_shape": [8, 6], "ranks": {
            0: {"shard_shape": [5, 6], "pieces": [{"shape": [5, 6], "source": [0, [6, 1]], "dest": [0, [6, 1]],
                                                   "locations": [0]}]},
            1: {"shard_shape": [3, 6], "pieces": [{"shape": [3, 6], "source": [30, [6, 1]], "dest": [0, [6, 1]],
                                                   "locations": [1]}]}}},
    }},
}
