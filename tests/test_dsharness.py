"""Self-tests of the DeepSpeed harness (tests/dsharness).

They prove that the checkpoints the harness makes are what they claim to be (stage, dp,
dtype, file set), that DeepSpeed's own converter + universal loader give back the saved
state exactly at another world size, and that a corrupted universal file is caught by the
same comparison the pyckpt tests rely on.

Cost: 2 save launches (ws2, ws4), 4 converter subprocesses (2 script runs, 2 batched),
2 load launches (ws3, ws2) and 1 deliberately failing launch: about 35-40 s on 2 cores.
The fixtures are prefixed dsh_ so that they never shadow the suite's conftest fixtures; these
tests make their own checkpoints on purpose, independent of what the pyckpt tests choose.
"""

import math
import shutil
import time
from pathlib import Path

import pytest
import torch

import dsharness as h
from dsharness import Config

UNIVERSAL = "global_step3_universal"

# name -> config. Every stage appears at ws2 (loaded at ws3: 2->3, uneven) and at ws4
# (loaded at ws2: 4->2); the tied/frozen model and bf16 are spread over both.
CONFIGS = {
    "z1_fp32_ws2": Config(1, "fp32", 2),
    "z2_bf16_ws2_ft": Config(2, "bf16", 2, model="frozen_tied"),
    "z3_fp32_ws2_sg": Config(3, "fp32", 2, sub_group_size=16),
    "z2_fp32_ws2_nouc": Config(2, "fp32", 2, uc_info=False),
    "z1_fp32_ws4_ft": Config(1, "fp32", 4, model="frozen_tied"),
    "z2_fp32_ws4": Config(2, "fp32", 4),
    "z3_fp32_ws4_ft": Config(3, "fp32", 4, model="frozen_tied"),
    "z3_bf16_ws4": Config(3, "bf16", 4),
}
LOAD_WS = {name: (3 if cfg.world_size == 2 else 2) for name, cfg in CONFIGS.items()}
# Checkpoints whose universal copy gets one element of one fp32.pt changed before loading.
CORRUPT = {"z1_fp32_ws2": "l1.weight", "z3_fp32_ws2_sg": "l1.weight"}

PARAM_NAMES = {
    "tiny": ["l0.weight", "l0.bias", "l1.weight", "l1.bias"],
    # out.weight is tied to emb.weight and so appears once; proj.weight is frozen.
    "frozen_tied": ["emb.weight", "proj.weight", "proj.bias"],
}
FROZEN = {"tiny": [], "frozen_tied": ["proj.weight"]}


def ds_load(path: Path):
    # DeepSpeed's files hold its own classes (ZeroStageEnum, fragment_address, LossScaler),
    # which weights_only=True refuses.
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="session")
def dsh_checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("dsh_ckpt")
    made = h.make_checkpoints([(cfg, base / name) for name, cfg in CONFIGS.items()])
    return dict(zip(CONFIGS, made))


@pytest.fixture(scope="session")
def dsh_universal(dsh_checkpoints, tmp_path_factory):
    """name -> (universal_root, tag) to load from; corrupted copies under "<name>:corrupt"."""
    # One conversion through the stand-alone script path (default workers), the rest batched.
    first = "z1_fp32_ws2"
    h.run_ds_to_universal(dsh_checkpoints[first].tag_dir, dsh_checkpoints[first].root / UNIVERSAL)
    plain = [n for n in CONFIGS if n != first and CONFIGS[n].uc_info]
    h.run_ds_to_universal_many([(dsh_checkpoints[n].tag_dir, dsh_checkpoints[n].root / UNIVERSAL) for n in plain])
    nouc = [n for n in CONFIGS if not CONFIGS[n].uc_info]
    h.run_ds_to_universal_many([(dsh_checkpoints[n].tag_dir, dsh_checkpoints[n].root / UNIVERSAL) for n in nouc],
                               "--inject_missing_state")
    out = {name: (dsh_checkpoints[name].root, UNIVERSAL) for name in CONFIGS}

    base = tmp_path_factory.mktemp("dsh_corrupt")
    for name, param in CORRUPT.items():
        root = base / name
        shutil.copytree(dsh_checkpoints[name].root / UNIVERSAL, root / UNIVERSAL)
        f = root / UNIVERSAL / "zero" / param / "fp32.pt"
        obj = torch.load(f, weights_only=True)
        # ZeRO-1/2 write {"param": tensor, "cat_dim": ...}; ZeRO-3 (tp=1) a bare flat tensor.
        t = obj["param"] if isinstance(obj, dict) else obj
        # The ZeRO-3 files are saved with requires_grad=True (sliced from the optimizer's
        # flat fp32 parameter), so the edit has to bypass autograd.
        with torch.no_grad():
            t.view(-1)[0] += 1.0
        torch.save(obj, f)
        out[f"{name}:corrupt"] = (root, UNIVERSAL)
    return out


@pytest.fixture(scope="session")
def dsh_loaded(dsh_universal):
    """name -> state restored by DeepSpeed's load_universal; all loads in two launches."""
    names = list(dsh_universal)
    requests = []
    for key in names:
        name = key.split(":")[0]
        root, tag = dsh_universal[key]
        requests.append((CONFIGS[name], root, tag, LOAD_WS[name]))
    return dict(zip(names, h.load_universal_many(requests)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoint_layout(dsh_checkpoints, name):
    ckpt = dsh_checkpoints[name]
    cfg = ckpt.config
    assert ckpt.tag == f"global_step{cfg.steps}"
    assert ckpt.tag_dir == ckpt.root / ckpt.tag
    assert (ckpt.root / "latest").read_text() == ckpt.tag

    prefix = "bf16_" if cfg.dtype == "bf16" else ""
    ranks = range(cfg.world_size)
    expected = {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks}
    if cfg.stage == 3:
        expected |= {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks}
    else:
        expected.add("mp_rank_00_model_states.pt")
    assert {p.name for p in ckpt.tag_dir.iterdir()} == expected

    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if cfg.stage == 3 else "mp_rank_00_model_states.pt"
    model = ds_load(ckpt.tag_dir / model_file)
    assert model["ds_config"]["zero_optimization"]["stage"] == cfg.stage
    assert model["dp_world_size"] == cfg.world_size
    assert model["global_steps"] == cfg.steps
    assert ("universal_checkpoint_info" in model) == cfg.uc_info
    trainable = [n for n in PARAM_NAMES[cfg.model] if n not in FROZEN[cfg.model]]
    assert [n for group in model["param_shapes"] for n in group] == trainable
    if cfg.model == "frozen_tied":
        assert model["shared_params"] == {"out.weight": "emb.weight"}
        assert model["buffer_names"] == ["scale", "counter"]
        if cfg.stage >= 2:
            assert list(model["frozen_param_shapes"]) == ["proj.weight"]

    for r in ranks:
        optim = ds_load(ckpt.tag_dir / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert int(optim["zero_stage"]) == cfg.stage
        if cfg.stage == 3:
            assert optim["partition_count"] == cfg.world_size
            # sub_group_size is what splits the ZeRO-3 flat buffer into several sub-groups.
            assert (len(optim["fp32_flat_groups"]) >= 2) == bool(cfg.sub_group_size)
            assert len(optim["fp32_flat_groups"]) == len(model["param_shapes"])
        else:
            assert optim["partition_count"] == [cfg.world_size]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_state(dsh_checkpoints, name):
    cfg = dsh_checkpoints[name].config
    ref = dsh_checkpoints[name].reference
    names = PARAM_NAMES[cfg.model]
    trainable = [n for n in names if n not in FROZEN[cfg.model]]
    assert ref["param_names"] == names
    assert ref["frozen"] == FROZEN[cfg.model]
    assert list(ref["fp32"]) == names
    assert ref["step"] == cfg.steps
    assert ref["meta"]["world_size"] == cfg.world_size
    for key in ("exp_avg", "exp_avg_sq"):
        assert list(ref[key]) == trainable
        for n in trainable:
            t = ref[key][n]
            assert t.dtype == torch.float32 and t.shape == ref["fp32"][n].shape
            # After a few steps every moment entry has seen a gradient: no silent zeros that
            # a broken conversion could "match".
            assert t.abs().min() > 0, f"{key}/{n} has zeros"
    for t in ref["fp32"].values():
        assert t.dtype == torch.float32
    if cfg.model == "frozen_tied":
        assert ref["buffers"]["counter"].item() == cfg.steps


@pytest.mark.parametrize("name", list(CONFIGS))
def test_universal_roundtrip_exact(dsh_checkpoints, dsh_loaded, name):
    ref = dsh_checkpoints[name].reference
    got = dsh_loaded[name]
    assert got["meta"]["world_size"] == LOAD_WS[name] != dsh_checkpoints[name].config.world_size
    assert h.compare_states(ref, got) == []
    assert math.isfinite(got["meta"]["loss_after_load"])


@pytest.mark.parametrize("name", list(CORRUPT))
def test_corrupted_universal_fp32_is_detected(dsh_checkpoints, dsh_loaded, name):
    param = CORRUPT[name]
    problems = h.compare_states(dsh_checkpoints[name].reference, dsh_loaded[f"{name}:corrupt"])
    assert len(problems) == 1 and problems[0].startswith(f"fp32/{param}: values differ"), problems


def test_loader_does_not_restore_buffers(dsh_checkpoints, dsh_loaded):
    # DeepSpeed's universal load never loads `module`: buffers keep their init values. Pinned
    # here so that a DeepSpeed change in this respect is noticed (see NOTES.md).
    for name in ("z2_bf16_ws2_ft", "z1_fp32_ws4_ft", "z3_fp32_ws4_ft"):
        ref, got = dsh_checkpoints[name].reference, dsh_loaded[name]
        assert ref["buffers"]["counter"].item() == 3
        assert got["buffers"]["counter"].item() == 0
        assert torch.equal(ref["buffers"]["scale"], got["buffers"]["scale"])


def test_universal_files_cover_trainable_params(dsh_checkpoints, dsh_universal):
    for name, cfg in CONFIGS.items():
        root, tag = dsh_universal[name]
        zero = root / tag / "zero"
        present = {p.parent.name for p in zero.glob("*/fp32.pt")}
        trainable = {n for n in PARAM_NAMES[cfg.model] if n not in FROZEN[cfg.model]}
        assert trainable <= present, name
        assert (zero / "optimizer_state.pt").is_file()
        assert (root / "latest_universal").read_text() == tag


def test_ds_to_universal_without_uc_info_fails(dsh_checkpoints, tmp_path):
    ckpt = dsh_checkpoints["z2_fp32_ws2_nouc"]
    with pytest.raises(RuntimeError, match="universal_checkpoint_info"):
        h.run_ds_to_universal(ckpt.tag_dir, tmp_path / "out", "--num_extract_workers", "1", "--num_merge_workers", "1")


def test_failing_rank_fails_the_launch_fast():
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="deliberate failure on rank 1"):
        h._launch(2, [{"kind": "fail", "rank": 1}], None, "self-test failure", timeout_s=120)
    # Rank 0 sits in a barrier that only the supervisor's kill ends; the gloo timeout is far longer.
    assert time.perf_counter() - t0 < 60
