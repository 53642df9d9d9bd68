"""Tensor/pipeline-parallel merge rules on Megatron-style TP x PP checkpoints in DeepSpeed's format.

Each case is converted by DeepSpeed's ds_to_universal and by pyckpt; the outputs must match bit for
bit, and DeepSpeed's merged fp32 must be the whole tensor the checkpoint was cut from (so the cases
really exercise each rule).
"""

from pathlib import Path

import pytest
import torch

import dsharness
import pyckpt
from compare import diff_folders
from megatron_cases import AFFINE_INFO, H, LEGACY_INFO, affine_params, legacy_params, megatron_info, megatron_params
from tp_builder import Param, build, perturb
from pyckpt import CheckpointFormatError


@pytest.fixture(scope="session")
def tp_cases(tmp_path_factory, ds_environ):
    root = tmp_path_factory.mktemp("tp")
    params, widths = megatron_params()
    cases = {
        "affine_maps_tp2_pp1_dp2": (affine_params(), AFFINE_INFO, 2, 1, 2, 2),
        "megatron_tp2_pp2_dp2_z1": (params, megatron_info(widths), 2, 2, 2, 1),
        "megatron_tp2_pp2_dp3_z2": (params, megatron_info(widths), 2, 2, 3, 2),
        "legacy_subparams_tp2_pp1_dp2": (legacy_params(), LEGACY_INFO, 2, 1, 2, 2),
    }
    made = {}
    for name, (prm, info, tp, pp, dp, stage) in cases.items():
        made[name] = (build(root / name, prm, info, tp, pp, dp, stage), prm, info)
    jobs = [(folder, root / "ds" / name / "u") for name, (folder, _, _) in made.items()]
    dsharness.run_ds_to_universal_many(jobs, env=ds_environ)
    return {name: (folder, root / "ds" / name / "u", prm, info) for name, (folder, prm, info) in made.items()}


@pytest.mark.parametrize("name", ["megatron_tp2_pp2_dp2_z1", "megatron_tp2_pp2_dp3_z2",
                                  "legacy_subparams_tp2_pp1_dp2", "affine_maps_tp2_pp1_dp2"])
def test_tp_pp_merges_are_bit_equal_to_deepspeed(name, tp_cases, tmp_path):
    folder, theirs, params, info = tp_cases[name]
    ours = tmp_path / "u"
    report = pyckpt.convert_to_universal(folder, ours)
    assert report.tp == 2 and report.pp == (2 if "pp2" in name else 1)
    assert (ours / "zero").is_dir() and len(list((ours / "zero").iterdir())) >= len(params)
    assert diff_folders(str(theirs), str(ours)) == []
    # The cases are meaningful: DeepSpeed's merge gives back each whole tensor.
    for prm in params:
        got = torch.load(theirs / "zero" / prm.name / "fp32.pt", weights_only=False)
        expected = prm.full[:info["original_vocab_size"]] if "word_embeddings" in prm.name else prm.full
        assert prm.full.numel() > 0
        if "post_attention_layernorm" not in prm.name:  # averaged: the mean of perturbed slices
            assert torch.equal(got["param"], expected), prm.name


def test_merge_layout_keys(tp_cases):
    _, theirs, _, _ = tp_cases["megatron_tp2_pp2_dp2_z1"]
    load = lambda n: torch.load(theirs / "zero" / n / "fp32.pt", weights_only=False)  # noqa: E731
    assert load("layers.0.attention.dense.weight")["cat_dim"] == 1
    assert load("layers.0.mlp.dense_h_to_4h.weight")["param_n_sub_params"] == 2
    assert load("word_embeddings.weight")["vocab_tensor"] is True
    assert load("layers.0.attention.query_key_value.weight")["sub_param_shape"].partition_dim == 0
    assert set(load("layers.0.input_layernorm.weight")) == {"param"}


def _rebuild(tmp_path, params, info, tp=2, pp=2, dp=2):
    return build(tmp_path / "ck", params, info, tp, pp, dp, 2)


def test_unsupported_autotp_pattern_is_refused_first(tmp_path):
    params, widths = megatron_params()
    info = megatron_info(widths)
    info["autotp_unsupported_parameter_patterns"] = {r"layers\.\d+\.moe": "fused MoE gate"}
    folder = _rebuild(tmp_path, params, info)
    with pytest.raises(ValueError, match=r"not supported for layers\\\.\\d\+\\\.moe: fused MoE gate"):
        pyckpt.convert_to_universal(folder, tmp_path / "u")
    assert not (tmp_path / "u").exists()


def test_unequal_replicated_slices_are_refused(tmp_path):
    params, widths = megatron_params()
    params = [Param(p.name, p.full, perturb if p.name == "layers.0.input_layernorm.weight" else p.split, p.stages)
              for p in params]
    folder = _rebuild(tmp_path, params, megatron_info(widths))
    with pytest.raises(AssertionError, match=r"tp-replicated parameter layers\.0\.input_layernorm\.weight differs"):
        pyckpt.convert_to_universal(folder, tmp_path / "u")


def test_disagreeing_pipeline_replicas_are_refused(tmp_path):
    params, widths = megatron_params()
    folder = _rebuild(tmp_path, params, megatron_info(widths))
    # Stage 1's copy of the tied embedding claims another shape.
    from edit import rewrite

    def other_shape(state):
        state["param_shapes"][0]["word_embeddings.weight"] = torch.Size([5, H])

    rewrite(f"{folder}/mp_rank_02_model_states.pt", other_shape)
    with pytest.raises(CheckpointFormatError, match=r"Pipeline replicas of word_embeddings\.weight on tp rank 0 "
                       r"disagree on shape"):
        pyckpt.convert_to_universal(folder, tmp_path / "u")


def test_unused_pattern_fails_strict_and_warns_otherwise(tmp_path, ds_environ):
    params, widths = megatron_params()
    info = megatron_info(widths)
    info["parameter_with_row_parallelism_patterns"].append(r"nothing\.matches\.this")
    folder = _rebuild(tmp_path, params, info)
    with pytest.raises(AssertionError, match=r"Unused patterns=\['nothing\\\\.matches\\\\.this'\]"):
        pyckpt.convert_to_universal(folder, tmp_path / "u")
    assert not (tmp_path / "u").exists()
    with pytest.warns(UserWarning, match="Unused patterns"):
        pyckpt.convert_to_universal(folder, tmp_path / "u", strict=False)
    theirs = tmp_path / "ds" / "u"
    dsharness.run_ds_to_universal(folder, theirs, "--no_strict", env=ds_environ)
    assert diff_folders(str(theirs), str(tmp_path / "u")) == []


def test_legacy_topology_without_parallel_dimensions(tmp_path, ds_environ):
    # No checkpoint_parallel_dimensions: DeepSpeed takes tp = number of mp_rank files (pp = 1).
    folder = build(tmp_path / "ck", legacy_params(), LEGACY_INFO, 2, 1, 2, 1, parallel_dims=False)
    theirs = tmp_path / "ds" / "u"
    dsharness.run_ds_to_universal(folder, theirs, env=ds_environ)
    report = pyckpt.convert_to_universal(folder, tmp_path / "u")
    assert (report.tp, report.pp, report.dp) == (2, 1, 2)
    assert diff_folders(str(theirs), str(tmp_path / "u")) == []


def test_two_index_model_state_names_are_refused(tmp_path):
    # DeepSpeed names PP model states by one model-parallel rank (pp * tp_degree + tp); a Megatron-LM
    # style mp_rank_<tp>_<pp> name must not be silently ordered beside those.
    params, widths = megatron_params()
    folder = Path(_rebuild(tmp_path, params, megatron_info(widths)))
    (folder / "mp_rank_02_model_states.pt").rename(folder / "mp_rank_00_001_model_states.pt")
    with pytest.raises(pyckpt.UnsupportedCheckpointError,
                       match=r"mp_rank_00_001_model_states\.pt: model states named mp_rank_<tp>_<pp>.*"
                             r"NN = pp_rank \* tp_degree \+ tp_rank"):
        pyckpt.convert_to_universal(folder, tmp_path / "u")
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("level", ["root", "iteration"])
def test_megatron_lm_checkpoint_is_named_as_such(tmp_path, level):
    root = tmp_path / "megatron"
    for tp in range(2):
        for pp in range(2):
            rank_dir = root / "iter_0000100" / f"mp_rank_{tp:02d}_{pp:03d}"
            rank_dir.mkdir(parents=True)
            torch.save({"model": {}}, rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    path = root if level == "root" else root / "iter_0000100"
    with pytest.raises(pyckpt.UnsupportedCheckpointError, match=r"is a Megatron-LM checkpoint .*not a DeepSpeed engine"):
        pyckpt.convert_to_universal(path, tmp_path / "u")
    assert not (tmp_path / "u").exists()


def test_megatron_tp_pp_exports_to_dcp_as_its_universal_state(tp_cases, tmp_path):
    """A Megatron-style TP x PP ZeRO-2 checkpoint exported to torch.distributed.checkpoint holds, read back
    by torch's own dcp_to_torch_save, every parameter's merged fp32 master, Adam moments and step as
    DeepSpeed's ds_to_universal writes them, bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, theirs, params, _ = tp_cases["megatron_tp2_pp2_dp3_z2"]
    pyckpt.export_dcp(folder, tmp_path / "dcp")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "sd.pt")
    got = torch.load(tmp_path / "sd.pt", weights_only=False)
    names = [p.name for p in params]
    assert sorted(got["optim"]["state"]) == sorted(names)
    for name in names:
        for state, where in (("fp32", got["model"]), ("exp_avg", None), ("exp_avg_sq", None)):
            want = torch.load(theirs / "zero" / name / f"{state}.pt", weights_only=False)["param"]
            have = where[name] if where is not None else got["optim"]["state"][name][state]
            assert have.dtype == want.dtype and torch.equal(have.view(-1).view(torch.int32),
                                                            want.reshape(-1).view(torch.int32)), (name, state)
        step = torch.load(theirs / "zero" / name / "step.pt", weights_only=False)
        assert float(got["optim"]["state"][name]["step"]) == float(step)
