"""Real DeepSpeed AutoTP checkpoints (tp 2 x dp 2): DeepSpeed resumes pyckpt's output at tp 4 and tp 1.

Bit-equality with ds_to_universal for these configurations is in test_convert.py (CONFIGS). The
ZERO_WIDTH checkpoints (tp 4, 2 KV heads: ranks holding empty k/v shards) are ones DeepSpeed's own
converter crashes on; for them the proof is the training run's TP-gathered state and DeepSpeed
resuming pyckpt's output at tp 2 and tp 1.
"""

import dataclasses

import pytest
import torch

import dsharness

# (checkpoint, ranks to load at, autotp_size to load at)
TP_LOADS = [
    ("tp_s1_fp32", 4, 4),
    ("tp_s1_fp32", 2, 1),
    ("tp_s2_bf16", 4, 4),
    ("tp_s3_fp32", 4, 4),
    ("tp_s3_fp32", 2, 1),
    ("tp4_s1_fp32_kv2", 4, 2),
    ("tp4_s1_fp32_kv2", 2, 1),
    ("tp4_s2_bf16_kv2", 4, 2),
]


@pytest.fixture(scope="session")
def tp_loaded(checkpoints, pyckpt_universal, ds_environ):
    requests = []
    for name, world, tp in TP_LOADS:
        out = pyckpt_universal[name]
        cfg = dataclasses.replace(checkpoints[name].config, world_size=world, tp_size=tp)
        requests.append((cfg, out.parent, out.name, world))
    return dict(zip(TP_LOADS, dsharness.load_universal_many(requests, env=ds_environ)))


@pytest.mark.parametrize("load", TP_LOADS, ids=[f"{n}-to-tp{t}-{w}ranks" for n, w, t in TP_LOADS])
def test_deepspeed_resumes_pyckpt_autotp_output_at_another_tp_size(load, checkpoints, tp_loaded):
    reference = checkpoints[load[0]].reference
    loaded = tp_loaded[load]
    assert loaded["meta"]["tp_size"] == load[2]
    assert reference["param_names"] and any("proj" in n for n in reference["param_names"])
    assert dsharness.compare_states(reference, loaded) == []


@pytest.mark.parametrize("name", ["tp_s1_fp32", "tp_s2_bf16", "tp_s3_fp32", "tp4_s1_fp32_kv2", "tp4_s2_bf16_kv2"])
def test_universal_fp32_is_the_tp_gathered_master(name, checkpoints, pyckpt_universal):
    # AutoTP 0.19.8 describes every parameter by an affine map (row-parallel o_proj/down_proj split
    # on dim 1, fused qkv/gate_up sub-parameters, replicated norms); the merged file must equal the
    # master weights the training run held, gathered across its TP group by the harness.
    reference = checkpoints[name].reference["fp32"]
    zero = pyckpt_universal[name] / "zero"
    checked = 0
    for pname, expected in reference.items():
        obj = torch.load(zero / pname / "fp32.pt", weights_only=True)
        got = obj["param"] if isinstance(obj, dict) else obj
        assert torch.equal(got.reshape(expected.shape), expected), pname
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("name", ["tp4_s1_fp32_kv2", "tp4_s2_bf16_kv2"])
def test_zero_width_shards_are_recorded_only_by_the_affine_map(name, checkpoints):
    # What makes these checkpoints special (and DeepSpeed's converter crash): TP ranks 2 and 3 hold
    # no attention heads, list no shape for their empty q/k/v/o_proj shards, and only the affine map
    # says those shards are empty.
    from pyckpt.formats.torch_zip import SourceFile
    tag = checkpoints[name].tag_dir
    shapes = {}
    for m in range(4):
        groups = SourceFile(str(tag / f"mp_rank_{m:02d}_model_states.pt")).load()["param_shapes"]
        shapes[m] = {k for g in groups for k in g}
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert k_proj in shapes[0] and k_proj in shapes[1]
    assert k_proj not in shapes[2] and k_proj not in shapes[3]
    info = SourceFile(str(tag / "mp_rank_00_model_states.pt")).load()["universal_checkpoint_info"]
    amap = next(v for p, v in info["affine_map"]["params"].items() if __import__("re").match(p, k_proj))
    ranks = {int(r): v for r, v in amap["ranks"].items()}
    assert [list(ranks[r]["shard_shape"]) for r in range(4)] == [[4, 16], [4, 16], [0, 16], [0, 16]]


def test_the_generators_autotp_metadata_is_what_deepspeed_autotp_writes(checkpoints):
    """benchmarks/make_checkpoint.py --family llama --tp N describes its slices as AutoTP does: for
    every parameter of a real AutoTP run that is split evenly or left whole (the generator writes no
    fused or uneven ones), the generator's affine map from the slice shape and the kind the real
    pattern lists give is the real map, and its metadata has the real keys."""
    from pyckpt.formats.torch_zip import SourceFile

    import pyckpt.testing as mc
    tag = checkpoints["tp_s1_fp32"].tag_dir
    info = SourceFile(str(tag / "mp_rank_00_model_states.pt")).load()["universal_checkpoint_info"]
    fused = {p for spec in info["parameter_with_sub_params"] for p in spec["patterns"]}
    compared = set()
    for pattern, real in info["affine_map"]["params"].items():
        shards = {tuple(rank["shard_shape"]) for rank in real["ranks"].values()}
        if pattern in fused or len(shards) != 1:
            continue
        kind = ("row" if pattern in info["parameter_with_row_parallelism_patterns"] else
                "vocab" if pattern in info["vocabulary_parameter_patterns"] else
                "replicated" if pattern in info["tp_replicated_parameter_patterns"] else "column")
        assert mc.autotp_map(next(iter(shards)), kind, 2) == real, pattern
        compared.add(kind)
    assert compared == {"row", "replicated", "column"}  # lm_head is uneven here (37 rows)
    model = mc.llama_model(2, 8, vocab=12, tp=2)
    generated = model.uc_info()
    assert set(generated) == set(info) - {"sub_param_shard_widths"}  # present only with fused parameters
    assert generated["original_vocab_size"] == 12 and generated["parameter_with_sub_params"] == []
