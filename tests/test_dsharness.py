"""Self-tests of the DeepSpeed harness (tests/dsharness).

They prove that the checkpoints the harness makes are what they claim to be (stage, dp,
dtype, file set), that DeepSpeed's own converter + universal loader give back the saved
state exactly at another world size, and that a corrupted universal file is caught by the
same comparison the pyckpt tests rely on.

The AutoEP part (models.TinyMoE, ws 4 / ep 2, ZeRO-1 D+E, ZeRO-2 bf16, ZeRO-3) rides in the same
launches, loads at (ws 4, ep 4) and (ws 2, ep 1), and pins the AutoEP file formats.

Cost: 2 save launches (ws2, ws4), 4 converter subprocesses (2 script runs, 2 batched),
3 load launches (ws3, ws2, ws4) and 1 deliberately failing launch: about 41-45 s on 2 cores
(35 s without the AutoEP part).
The fixtures are prefixed dsh_ so that they never shadow the suite's conftest fixtures; these
tests make their own checkpoints on purpose, independent of what the pyckpt tests choose.
"""

import dataclasses
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

# AutoEP (expert-parallel MoE, models.TinyMoE): saved at 4 ranks with autoep_size 2 and loaded at
# other (world size, autoep size) pairs. ZeRO-1 runs with use_data_before_expert_parallelism
# (D+E rank order), the other two with the default E+D order.
AUTOEP = {
    "moe_z2_bf16_ws4_ep2": Config(2, "bf16", 4, model="moe", ep_size=2),
    "moe_z3_fp32_ws4_ep2": Config(3, "fp32", 4, model="moe", ep_size=2),
    "moe_z1_fp32_ws4_ep2_dbe": Config(1, "fp32", 4, model="moe", ep_size=2, use_data_before_expert_parallelism=True),
}
AUTOEP_LOADS = [(4, 4), (2, 1)]  # (world size, autoep size)
# A universal copy with two experts (on different EP ranks) swapped in one fp32.pt, loaded at ws 4 / ep 4.
AUTOEP_SWAP = {"moe_z3_fp32_ws4_ep2": ("model.layers.1.mlp.experts.w2", 1, 6)}
ALL_CONFIGS = {**CONFIGS, **AUTOEP}
MOE_LAYERS = ["model.layers.0.mlp", "model.layers.1.mlp"]
EXPERT_PARAMS = [f"{layer}.experts.{w}" for layer in MOE_LAYERS for w in ("w1", "w2", "w3")]
# H=10, F=6, 8 experts (models.MoEConfig).
EXPERT_SHAPES = {"w1": (8, 6, 10), "w2": (8, 10, 6), "w3": (8, 6, 10)}
MOE_PARAM_NAMES = ["model.embed_tokens.weight"] + [
    name for i, layer in enumerate(MOE_LAYERS)
    for name in (f"model.layers.{i}.norm.weight", f"model.layers.{i}.norm.bias", f"{layer}.router.gate.weight",
                 f"{layer}.experts.w1", f"{layer}.experts.w2", f"{layer}.experts.w3")
] + ["model.norm.weight", "model.norm.bias", "lm_head.weight"]


def ep_ranks(world_size: int, ep: int, data_before_expert: bool) -> list[int]:
    """EP rank of each global rank: E+D = rank % ep; D+E = rank // (world / ep)."""
    return [r // (world_size // ep) if data_before_expert else r % ep for r in range(world_size)]


def load_key(name: str, ws: int, ep: int) -> str:
    return f"{name}@ws{ws}ep{ep}"


def ds_load(path: Path):
    # DeepSpeed's files hold its own classes (ZeroStageEnum, fragment_address, LossScaler),
    # which weights_only=True refuses.
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="session")
def dsh_checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("dsh_ckpt")
    made = h.make_checkpoints([(cfg, base / name) for name, cfg in ALL_CONFIGS.items()])
    return dict(zip(ALL_CONFIGS, made))


@pytest.fixture(scope="session")
def dsh_universal(dsh_checkpoints, tmp_path_factory):
    """name -> (universal_root, tag) to load from; corrupted copies under "<name>:corrupt",
    AutoEP copies with two experts swapped under "<name>:swap"."""
    # One conversion through the stand-alone script path (default workers), the rest batched.
    first = "z1_fp32_ws2"
    h.run_ds_to_universal(dsh_checkpoints[first].tag_dir, dsh_checkpoints[first].root / UNIVERSAL)
    plain = [n for n in ALL_CONFIGS if n != first and ALL_CONFIGS[n].uc_info]
    h.run_ds_to_universal_many([(dsh_checkpoints[n].tag_dir, dsh_checkpoints[n].root / UNIVERSAL) for n in plain])
    nouc = [n for n in CONFIGS if not CONFIGS[n].uc_info]
    h.run_ds_to_universal_many([(dsh_checkpoints[n].tag_dir, dsh_checkpoints[n].root / UNIVERSAL) for n in nouc],
                               "--inject_missing_state")
    out = {name: (dsh_checkpoints[name].root, UNIVERSAL) for name in ALL_CONFIGS}

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

    for name, (param, a, b) in AUTOEP_SWAP.items():
        root = base / name
        shutil.copytree(dsh_checkpoints[name].root / UNIVERSAL, root / UNIVERSAL)
        f = root / UNIVERSAL / "zero" / param / "fp32.pt"
        obj = torch.load(f, weights_only=True)
        t = obj["param"]
        with torch.no_grad():
            t[[a, b]] = t[[b, a]].clone()
        torch.save(obj, f)
        out[f"{name}:swap"] = (root, UNIVERSAL)
    return out


@pytest.fixture(scope="session")
def dsh_loaded(dsh_universal):
    """name (AutoEP: load_key(name, ws, ep)) -> state restored by DeepSpeed's load_universal;
    all loads in three launches (ws 3, 2, 4). Corrupted copies load at LOAD_WS, swapped AutoEP
    copies at (4, 4)."""
    keys, requests = [], []
    for key, (root, tag) in dsh_universal.items():
        name = key.split(":")[0]
        if name in AUTOEP:
            for ws, ep in (AUTOEP_LOADS if key == name else [(4, 4)]):
                keys.append(load_key(key, ws, ep))
                requests.append((dataclasses.replace(AUTOEP[name], world_size=ws, ep_size=ep), root, tag, ws))
        else:
            keys.append(key)
            requests.append((CONFIGS[name], root, tag, LOAD_WS[name]))
    return dict(zip(keys, h.load_universal_many(requests)))


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


# ----------------------------------------------------------------------------------------------
# AutoEP


def autoep_layer_entries(model_states: dict) -> list[dict]:
    entries = model_states["ds_autoep_layers"]
    # The same list is repeated inside universal_checkpoint_info, which is where ds_to_universal reads it.
    assert model_states["universal_checkpoint_info"]["ds_autoep_layers"] == entries
    return entries


@pytest.mark.parametrize("name", list(AUTOEP))
def test_autoep_checkpoint_layout(dsh_checkpoints, name):
    ckpt = dsh_checkpoints[name]
    cfg = ckpt.config
    prefix = "bf16_" if cfg.dtype == "bf16" else ""
    ranks = range(cfg.world_size)
    expected = {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks}
    if cfg.stage == 3:
        # Partition-native: the experts live only in the ZeRO shards.
        expected |= {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks}
        model_files = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks]
    else:
        expected.add("mp_rank_00_model_states.pt")
        # One file per (layer, global expert), written by the expert-DP writer of each EP rank.
        expected |= {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(2) for e in range(8)}
        model_files = ["mp_rank_00_model_states.pt"]
    assert {p.name for p in ckpt.tag_dir.iterdir()} == expected

    rank_ep = ep_ranks(cfg.world_size, cfg.ep_size, cfg.use_data_before_expert_parallelism)
    for file_rank, model_file in enumerate(model_files):
        model = ds_load(ckpt.tag_dir / model_file)
        assert model["num_experts"] == [8, 8]
        # The fused expert tensors are taken out of `module`; the router is there twice (AutoEP
        # aliases it under the source name `gate`), the experts not at all.
        assert not [k for k in model["module"] if ".experts." in k]
        assert f"{MOE_LAYERS[0]}.gate.gate.weight" in model["module"]
        assert [list(g) for g in model["param_shapes"]][1] == EXPERT_PARAMS
        uc = model["universal_checkpoint_info"]
        assert uc["universal_checkpoint_version"] == 0.4
        assert uc["expert_parameter_patterns"] == [r".*\.experts\.w[123]$"]
        entries = autoep_layer_entries(model)
        assert [e["module_path"] for e in entries] == MOE_LAYERS
        assert [e["moe_layer_id"] for e in entries] == [0, 1]
        for e in entries:
            assert set(e) == {
                "moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size", "expert_placement",
                "affine_maps", "expert_key_prefix", "checkpoint_format", "checkpoint_format_version",
                "ep_group_name", "ep_rank", "expert_data_parallel_rank", "expert_data_parallel_world_size",
                "global_expert_start", "global_expert_end"
            }
            assert (e["num_experts"], e["num_local_experts"], e["ep_size"]) == (8, 4, 2)
            assert e["expert_key_prefix"] == e["module_path"] + ".experts"
            assert e["ep_group_name"] == "ep_size_2"
            assert e["expert_data_parallel_world_size"] == 2
            assert e["checkpoint_format"] == ("zero3_partitioned" if cfg.stage == 3 else "per_expert_files")
            assert e["checkpoint_format_version"] == (1 if cfg.stage == 3 else None)
            # ZeRO-1/2: written by DP rank 0 only; ZeRO-3: each rank's own values.
            assert e["ep_rank"] == rank_ep[file_rank]
            assert (e["global_expert_start"], e["global_expert_end"]) == (4 * e["ep_rank"], 4 * e["ep_rank"] + 4)

    for r in ranks:
        optim = ds_load(ckpt.tag_dir / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        if cfg.stage == 3:
            groups = optim["ds_zero_partition_groups"]
            assert [g["families"] for g in groups] == [["replicated"], ["autoep_expert"]]
            # The expert sub-group is partitioned over the expert-DP group: the ranks sharing r's EP rank.
            assert groups[1]["partition_ranks"] == [q for q in ranks if rank_ep[q] == rank_ep[r]]
        else:
            assert optim["partition_count"] == [4, 2]


@pytest.mark.parametrize("name", list(AUTOEP))
def test_autoep_reference_state(dsh_checkpoints, name):
    cfg = dsh_checkpoints[name].config
    ref = dsh_checkpoints[name].reference
    assert ref["param_names"] == MOE_PARAM_NAMES
    assert ref["meta"]["expert_params"] == EXPERT_PARAMS
    assert ref["meta"]["ep_size"] == 2
    assert ref["meta"]["ep_rank_of_rank"] == ep_ranks(4, 2, cfg.use_data_before_expert_parallelism)
    assert ref["meta"]["param_group_names"] == ["dense-params", "ep_size_2"]
    assert ref["step"] == cfg.steps
    for n in EXPERT_PARAMS:
        assert tuple(ref["fp32"][n].shape) == EXPERT_SHAPES[n[-2:]]
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert list(ref[key]) == MOE_PARAM_NAMES
        for n, t in ref[key].items():
            assert t.dtype == torch.float32
            if key != "fp32":
                # Every expert of every layer got tokens in some step: a converter that loses
                # or reorders experts cannot hide behind zero moments.
                assert t.abs().min() > 0, f"{key}/{n} has zeros"


@pytest.mark.parametrize("name", [n for n, cfg in AUTOEP.items() if cfg.stage < 3])
def test_autoep_expert_files_match_reference(dsh_checkpoints, name):
    # DeepSpeed's own per-expert files name the global expert id; they must agree with the
    # reference's expert order (in the model dtype: they hold the module weights).
    ckpt = dsh_checkpoints[name]
    for layer, prefix in enumerate(MOE_LAYERS):
        for e in range(8):
            sd = ds_load(ckpt.tag_dir / f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt")
            assert sorted(sd) == [f"{prefix}.experts.{w}.{e}" for w in ("w1", "w2", "w3")]
            for w in ("w1", "w2", "w3"):
                t = sd[f"{prefix}.experts.{w}.{e}"]
                want = ckpt.reference["fp32"][f"{prefix}.experts.{w}"][e]
                assert t.dtype == (torch.bfloat16 if ckpt.config.dtype == "bf16" else torch.float32)
                assert torch.equal(t, want.to(t.dtype))


@pytest.mark.parametrize("name", list(AUTOEP))
def test_autoep_universal_files(dsh_checkpoints, dsh_universal, name):
    ckpt = dsh_checkpoints[name]
    root, tag = dsh_universal[name]
    out = root / tag
    zero = out / "zero"
    ref = ckpt.reference
    for n in EXPERT_PARAMS:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            obj = torch.load(zero / n / f"{key}.pt", weights_only=True)
            assert set(obj) == {"param", "cat_dim", "is_expert_param", "ep_num_experts"}
            assert obj["is_expert_param"] is True and obj["ep_num_experts"] == 8 and obj["cat_dim"] == 0
            assert torch.equal(obj["param"], ref[key][n]), f"{key}/{n}"
        # ZeRO-3 keeps the step only in optimizer_state.pt.
        assert (zero / n / "step.pt").exists() == (ckpt.config.stage < 3)
    dense = torch.load(zero / "model.norm.bias" / "fp32.pt", weights_only=True)
    assert isinstance(dense, dict) == (ckpt.config.stage < 3)
    # The per-expert files are inputs only; nothing of them is copied to the output.
    assert not list(out.glob("layer_*"))
    if ckpt.config.stage < 3:
        # The router alias gets the generic "other module key" treatment: its module value.
        assert set(torch.load(zero / f"{MOE_LAYERS[0]}.gate.gate.weight" / "fp32.pt", weights_only=True)) == {"param"}
        model = ds_load(out / "mp_rank_00_model_states.pt")
        assert model["universal_checkpoint_info"]["expert_parameter_patterns"] == [r"\.experts\.w[123]$"]
        optim = ds_load(zero / "optimizer_state.pt")
        # Rewritten to the dense dp degree for every group, although the expert group had 2.
        assert optim["partition_count"] == [4, 4]
    else:
        assert not (zero / f"{MOE_LAYERS[0]}.gate.gate.weight").exists()


@pytest.mark.parametrize("ws,ep", AUTOEP_LOADS)
@pytest.mark.parametrize("name", list(AUTOEP))
def test_autoep_universal_roundtrip_exact(dsh_checkpoints, dsh_loaded, name, ws, ep):
    ref = dsh_checkpoints[name].reference
    got = dsh_loaded[load_key(name, ws, ep)]
    cfg = AUTOEP[name]
    assert got["meta"]["world_size"] == ws and got["meta"]["ep_size"] == ep
    assert got["meta"]["ep_rank_of_rank"] == ep_ranks(ws, ep, cfg.use_data_before_expert_parallelism)
    assert h.compare_states(ref, got) == []
    assert math.isfinite(got["meta"]["loss_after_load"])
    # The loader copies the saved param-group keys over the live ones, names included: ZeRO-1/2
    # group by group (an ep-4 engine keeps "ep_size_2"), ZeRO-3 from saved group 0 into every group.
    expected_names = ["dense-params", "dense-params"] if cfg.stage == 3 else ["dense-params", "ep_size_2"]
    assert got["meta"]["param_group_names"] == expected_names


@pytest.mark.parametrize("name", list(AUTOEP_SWAP))
def test_autoep_swapped_experts_are_detected(dsh_checkpoints, dsh_loaded, name):
    param = AUTOEP_SWAP[name][0]
    problems = h.compare_states(dsh_checkpoints[name].reference, dsh_loaded[load_key(f"{name}:swap", 4, 4)])
    assert len(problems) == 1 and problems[0].startswith(f"fp32/{param}: values differ"), problems
