"""AutoEP conversion rules on real DeepSpeed AutoEP checkpoints, each error case on an edited copy."""

import os
import shutil

import pytest
import torch

import dsharness
import pyckpt
from compare import diff_folders
from edit import copy_checkpoint, rewrite
from pyckpt import CheckpointFormatError
from pyckpt.universal.expert_slice import read_expert_slice


def _out(tmp_path):
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    return out


def _assert_no_output(out):
    assert not out.exists() and not (out.parent / "latest_universal").exists()
    assert not [n for n in os.listdir(out.parent) if "pyckpt-tmp" in n]


def test_missing_per_expert_file_is_file_not_found(checkpoints, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s1_fp32"].tag_dir, tmp_path)
    os.remove(tag_dir / "layer_1_expert_5_mp_rank_00_model_states.pt")
    out = _out(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"layer_1 expert_5 in .*global_step3") as err:
        pyckpt.convert_to_universal(root, out)
    assert isinstance(err.value, CheckpointFormatError) and "8 experts" in str(err.value)
    _assert_no_output(out)


def test_two_mp_rank_files_for_one_expert_are_refused(checkpoints, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s2_bf16"].tag_dir, tmp_path)
    shutil.copy(tag_dir / "layer_0_expert_3_mp_rank_00_model_states.pt",
                tag_dir / "layer_0_expert_3_mp_rank_01_model_states.pt")
    out = _out(tmp_path)
    with pytest.raises(NotImplementedError, match=r"Multiple expert checkpoint files.*layer_0 expert_3.*mp_rank_01"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def _strip_autoep_metadata(state):
    state.pop("ds_autoep_layers", None)
    state.pop("autoep_layers", None)
    info = state.get("universal_checkpoint_info")
    if isinstance(info, dict):
        info.pop("ds_autoep_layers", None)


def test_expert_files_without_metadata_need_a_migration(checkpoints, deepspeed_universal, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s1_fp32"].tag_dir, tmp_path)
    rewrite(tag_dir / "mp_rank_00_model_states.pt", _strip_autoep_metadata)
    out = _out(tmp_path)
    with pytest.raises(RuntimeError, match=r"native DeepSpeed-MoE.*migration.*--dense-only") as err:
        pyckpt.convert_to_universal(root, out)
    assert "layer_0_expert_0_mp_rank_00_model_states.pt" in str(err.value)
    _assert_no_output(out)

    # --dense-only: the dense parameters, exactly as DeepSpeed converts them; no expert files.
    report = pyckpt.convert_to_universal(root, out, dense_only=True)
    assert report.params > 0
    expected = deepspeed_universal["ep_s1_fp32"] / "zero"
    dense = sorted(p.name for p in expected.iterdir() if ".experts.w" not in p.name)
    assert sorted(p.name for p in (out / "zero").iterdir()) == dense
    for name in dense:
        assert diff_folders(str(expected / name), str(out / "zero" / name)) == [], name


def test_zero3_autoep_must_be_partition_native(checkpoints, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s3_fp32"].tag_dir, tmp_path)

    def older_format(state):
        for entry in state["ds_autoep_layers"]:
            entry["checkpoint_format"] = "per_expert_files"

    for f in tag_dir.glob("zero_pp_rank_*_model_states.pt"):
        rewrite(f, older_format)
    out = _out(tmp_path)
    with pytest.raises(NotImplementedError, match=r"ZeRO stage 1 or 2, or the partition-native ZeRO-3 format"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_autoep_with_tensor_parallel_files_is_refused(checkpoints, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s3_fp32"].tag_dir, tmp_path)
    for f in list(tag_dir.glob("zero_pp_rank_*_mp_rank_00_*_states.pt")):
        shutil.copy(f, f.with_name(f.name.replace("_mp_rank_00_", "_mp_rank_01_")))
    out = _out(tmp_path)
    with pytest.raises(NotImplementedError, match=r"AutoEP \+ AutoTP \(tensor parallel\)"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s["ds_autoep_layers"][0].update(num_experts=6), r"expert count mismatch for .*layers\.0.*num_experts=6"),
    (lambda s: s["ds_autoep_layers"].__setitem__(0, "oops"), r"must contain dictionaries in .*mp_rank_00"),
    (lambda s: s.__setitem__("ds_autoep_layers", {"a": 1}), r"AutoEP metadata must be a list in .*mp_rank_00"),
    (lambda s: s["ds_autoep_layers"][1].update(expert_key_prefix=s["ds_autoep_layers"][0]["expert_key_prefix"]),
     r"Conflicting AutoEP metadata for expert_key_prefix"),
    (lambda s: s["ds_autoep_layers"][0].update(ep_size=True), r"ep_size must be a positive integer, got True"),
    (lambda s: s["ds_autoep_layers"][0].pop("num_local_experts"), r"missing fields: \['num_local_experts'\]"),
    (lambda s: s["ds_config"].update(use_data_before_expert_parallelism="yes"), r"must be a boolean in"),
],
                         ids=["count", "entry-type", "list-type", "conflict", "bool-size", "missing-field", "ordering"])
def test_zero12_metadata_rules(checkpoints, tmp_path, edit, message):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s2_bf16"].tag_dir, tmp_path)
    rewrite(tag_dir / "mp_rank_00_model_states.pt", edit)
    out = _out(tmp_path)
    with pytest.raises(RuntimeError, match=message):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s["ds_autoep_layers"][0].update(num_local_experts=3), r"does not match num_local_experts: 4 != 3"),
    (lambda s: s["ds_autoep_layers"][0].update(checkpoint_format_version=2), r"format version: 2"),
    (lambda s: s["ds_autoep_layers"][1].update(moe_layer_id=s["ds_autoep_layers"][0]["moe_layer_id"]),
     r"duplicate moe_layer_id"),
],
                         ids=["local-count", "version", "duplicate-layer"])
def test_zero3_metadata_rules(checkpoints, tmp_path, edit, message):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s3_fp32"].tag_dir, tmp_path)
    rewrite(tag_dir / "zero_pp_rank_2_mp_rank_00_model_states.pt", edit)
    out = _out(tmp_path)
    with pytest.raises(RuntimeError, match=r"zero_pp_rank_2.*" + message):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_legacy_metadata_key_converts_like_deepspeed(checkpoints, ds_environ, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s2_bf16"].tag_dir, tmp_path)

    def legacy(state):
        state["autoep_layers"] = state.pop("ds_autoep_layers")

    rewrite(tag_dir / "mp_rank_00_model_states.pt", legacy)
    theirs = tmp_path / "ds" / "u"
    dsharness.run_ds_to_universal(tag_dir, theirs, env=ds_environ)
    ours = _out(tmp_path)
    pyckpt.convert_to_universal(root, ours)
    assert any(".experts.w1" in p.name for p in (ours / "zero").iterdir())
    assert diff_folders(str(theirs), str(ours)) == []


def test_expert_optimizer_state_is_best_effort(checkpoints, deepspeed_universal, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s2_bf16"].tag_dir, tmp_path)
    victim = next(tag_dir.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))

    def drop_expert_moment(obj):
        osd = obj["optimizer_state_dict"]
        (group, ) = [g for g, c in enumerate(osd["partition_count"]) if c != 4]  # the expert (moe) group
        del osd["base_optimizer_state"]["state"][group]["exp_avg"]

    rewrite(victim, drop_expert_moment)
    out = _out(tmp_path)
    with pytest.warns(UserWarning, match=r"skipped exp_avg of .*experts\.w\d: no exp_avg in .*zero_pp_rank_1"):
        pyckpt.convert_to_universal(root, out)
    expected = deepspeed_universal["ep_s2_bf16"] / "zero"
    experts = [p.name for p in expected.iterdir() if ".experts.w" in p.name]
    assert len(experts) == 6
    skipped = [name for name in experts if not (out / "zero" / name / "exp_avg.pt").exists()]
    assert skipped, "rank 1 holds a fragment of some expert parameter, so some exp_avg must be skipped"
    for name in experts:
        # Whatever was written is exactly DeepSpeed's; only the moments rank 1 lacks are missing.
        for kept in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"):
            if kept == "exp_avg.pt" and name in skipped:
                continue
            a = torch.load(expected / name / kept, weights_only=False)
            b = torch.load(out / "zero" / name / kept, weights_only=False)
            a, b = (x["param"] if isinstance(x, dict) else x for x in (a, b))
            assert torch.equal(a, b), (name, kept)


@pytest.mark.parametrize("name", ["ep_s2_bf16", "ep_s3_fp32"])
def test_read_expert_slice_on_converted_experts(pyckpt_universal, name):
    zero = pyckpt_universal[name] / "zero"
    files = sorted(zero.glob("*.experts.w*/fp32.pt"))
    assert len(files) == 6
    for f in files:
        full = torch.load(f, weights_only=True)["param"]
        assert full.shape[0] == 8
        for ep in (1, 2, 4, 8):
            rows = 8 // ep
            for rank in range(ep):
                assert torch.equal(read_expert_slice(f, rank, ep), full[rank * rows:(rank + 1) * rows])


# (checkpoint saved at 4 ranks with autoep_size 2, world size to load at, autoep_size to load at)
EP_LOADS = [
    ("ep_s1_fp32", 4, 4),
    ("ep_s2_bf16", 4, 4),
    ("ep_s2_bf16", 2, 1),
    ("ep_s2_fp32_data_before_expert", 2, 1),
    ("ep_s3_fp32", 4, 4),
    ("ep_s3_fp32", 2, 1),
    ("ep_s3_bf16", 2, 1),
]


@pytest.fixture(scope="session")
def ep_loaded(checkpoints, pyckpt_universal, ds_environ):
    import dataclasses
    requests = []
    for name, world, ep in EP_LOADS:
        out = pyckpt_universal[name]
        cfg = dataclasses.replace(checkpoints[name].config, world_size=world, ep_size=ep)
        requests.append((cfg, out.parent, out.name, world))
    states = dsharness.load_universal_many(requests, env=ds_environ)
    return dict(zip(EP_LOADS, states))


@pytest.mark.parametrize("load", EP_LOADS, ids=[f"{n}-to-{w}ranks-ep{e}" for n, w, e in EP_LOADS])
def test_deepspeed_resumes_pyckpt_autoep_output_at_another_ep_size(load, checkpoints, ep_loaded):
    reference = checkpoints[load[0]].reference
    loaded = ep_loaded[load]
    experts = [n for n in reference["fp32"] if ".experts.w" in n]
    assert len(experts) == 6 and all(reference["fp32"][n].shape[0] == 8 for n in experts)
    assert loaded["meta"]["ep_size"] == load[2]
    assert dsharness.compare_states(reference, loaded) == []


def test_zero3_expert_partitions_must_each_be_present_once(checkpoints, tmp_path):
    root, tag_dir = copy_checkpoint(checkpoints["ep_s3_fp32"].tag_dir, tmp_path)
    seen = {}

    def duplicate_partition_rank(obj):
        for group in obj["optimizer_state_dict"]["ds_zero_partition_groups"]:
            if "autoep_expert" in group["families"]:
                seen["from"] = group["partition_rank"]
                group["partition_rank"] = 1 - group["partition_rank"]  # the other EDP rank's slot, twice

    # Ranks 0 and 2 form one expert-data-parallel group (EP rank 0) under the default rank order.
    rewrite(next(tag_dir.glob("*zero_pp_rank_2_mp_rank_00_optim_states.pt")), duplicate_partition_rank)
    assert "from" in seen
    out = _out(tmp_path)
    with pytest.raises(RuntimeError, match=r"Duplicate AutoEP expert-DP partition ranks for .*experts\.w1/"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)
