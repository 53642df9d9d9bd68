"""Self-tests of the DeepSpeed harness (tests/dsharness).

They prove that the checkpoints the harness makes are what they claim to be (stage, dp,
dtype, file set), that DeepSpeed's own converter + universal loader give back the saved
state exactly at another world size, and that a corrupted universal file is caught by the
same comparison the pyckpt tests rely on.

The AutoEP part (models.TinyMoE, ws 4 / ep 2, ZeRO-1 D+E, ZeRO-2 bf16, ZeRO-3) rides in the same
launches, loads at (ws 4, ep 4) and (ws 2, ep 1), and pins the AutoEP file formats.
So does the AutoTP part (models.TinyLlama, ws 4 = tp 2 x dp 2, ZeRO-1 bf16 and ZeRO-3 fp32, plus
the 2-KV-head variant): loads at (ws 4, tp 4) and (ws 2, tp 1), DeepSpeed's universal_checkpoint_info,
both converter layouts (0.19.8's affine maps, and the pattern categories an info without
`affine_map` takes), and DeepSpeed's failure on zero-width TP shards.

Cost: 2 save launches (ws2, ws4), 5 converter subprocesses (3 script runs, 2 batched),
3 load launches (ws3, ws2, ws4) and 1 deliberately failing launch: about 41-45 s on 2 cores
without the AutoTP part (35 s without AutoEP either); with it 57-64 s while other jobs shared the
machine (load average 3-5), up to 95 s under heavier sharing.
The fixtures are prefixed dsh_ so that they never shadow the suite's conftest fixtures; these
tests make their own checkpoints on purpose, independent of what the pyckpt tests choose.
"""

import dataclasses
import math
import re
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

# AutoTP (tensor parallel, models.TinyLlama / "llama" preset): saved at 4 ranks = tp 2 x dp 2.
AUTOTP = {
    "tp_z1_bf16_ws4_tp2": Config(1, "bf16", 4, model="llama", tp_size=2),
    "tp_z3_fp32_ws4_tp2": Config(3, "fp32", 4, model="llama", tp_size=2),
    # 2 KV heads: the tp-4 load gives TP ranks 2 and 3 zero-width attention shards.
    "tpkv2_z2_fp32_ws4_tp2": Config(2, "fp32", 4, model="llama_kv2", tp_size=2),
}
AUTOTP_LOADS = {  # (world size, tp size)
    "tp_z1_bf16_ws4_tp2": [(4, 4), (2, 1)],
    "tp_z3_fp32_ws4_tp2": [(4, 4), (2, 1)],
    "tpkv2_z2_fp32_ws4_tp2": [(4, 4)],
}
# Saved at tp 4 with 2 KV heads (zero-width shards on TP ranks 2, 3): ds_to_universal fails on it.
AUTOTP_UNCONVERTIBLE = {"tpkv2_z1_fp32_ws4_tp4": Config(1, "fp32", 4, model="llama_kv2", tp_size=4)}
# Converted a second time with `affine_map` removed from universal_checkpoint_info (the layout
# DeepSpeed wrote before affine maps): the converter then takes the pattern categories. Not
# loaded: under AutoTP the loader reads only `param` (NOTES.md; loads of these were exact).
AUTOTP_NOAFF = ["tp_z1_bf16_ws4_tp2", "tp_z3_fp32_ws4_tp2"]
LLAMA_PARAM_NAMES = ["model.embed_tokens.weight"] + [
    f"model.layers.0.{n}" for n in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
        "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
        "self_attn.o_proj.bias", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")
] + [
    f"model.layers.1.{n}" for n in ("input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias",
                                    "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                    "mlp.gate_up_proj.weight", "mlp.down_proj.weight")
] + ["model.norm.weight", "model.norm.bias", "lm_head.weight"]
ROW_PARALLEL = [f"model.layers.{i}.{n}" for i in (0, 1) for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight")]
TP_REPLICATED = ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.bias", "model.norm.weight",
                 "model.norm.bias"] + [f"model.layers.{i}.{n}" for i in (0, 1)
                                       for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
SUB_PARAMS = {  # name -> (published shape, per-sub-parameter per-TP-rank widths at tp 2)
    "model.layers.1.self_attn.qkv_proj.weight": ([(16, 8, 8), -1], [[8, 8], [4, 4], [4, 4]]),
    "model.layers.1.self_attn.qkv_proj.bias": ([(16, 8, 8)], [[8, 8], [4, 4], [4, 4]]),
    "model.layers.1.mlp.gate_up_proj.weight": ([(24, 24), -1], [[12, 12], [12, 12]]),
}
COLUMN_PARALLEL = [n for n in LLAMA_PARAM_NAMES if n not in ROW_PARALLEL + TP_REPLICATED and n not in SUB_PARAMS]


def pat(name: str) -> str:
    """AutoTP's pattern for one parameter (layers.py collect_autotp_universal_checkpoint_info)."""
    return f"^{re.escape(name)}$"


# What AutoTP writes at tp 2 (both llama variants), `affine_map` aside.
EXPECTED_UC_INFO = {
    "universal_checkpoint_version": 0.4,
    "parameter_with_row_parallelism_patterns": sorted(pat(n) for n in ROW_PARALLEL),
    "tp_replicated_parameter_patterns": sorted(pat(n) for n in TP_REPLICATED),
    "vocabulary_parameter_patterns": [pat("lm_head.weight")],
    "parameter_with_sub_params": [{
        "patterns": [pat(n)],
        "shape": shape,
        "partition_dim": 0
    } for n, (shape, _) in SUB_PARAMS.items()],
    "autotp_unsupported_parameter_patterns": {},
    "sub_param_shard_widths": {pat(n): widths
                               for n, (_, widths) in SUB_PARAMS.items()},
    "original_vocab_size": 37,
}

ALL_CONFIGS = {**CONFIGS, **AUTOEP, **AUTOTP, **AUTOTP_UNCONVERTIBLE}
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


def tp_load_key(name: str, ws: int, tp: int) -> str:
    return f"{name}@ws{ws}tp{tp}"


def strip_affine_map(src_tag_dir: Path, dst_tag_dir: Path) -> None:
    """Copy a checkpoint tag dir with `affine_map` taken out of every universal_checkpoint_info."""
    shutil.copytree(src_tag_dir, dst_tag_dir)
    for f in dst_tag_dir.glob("*model_states.pt"):
        sd = ds_load(f)
        del sd["universal_checkpoint_info"]["affine_map"]
        torch.save(sd, f)


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
    AutoEP copies with two experts swapped under "<name>:swap", AutoTP conversions without
    affine maps under "<name>:noaff"."""
    # One conversion through the stand-alone script path (default workers), the rest batched.
    first = "z1_fp32_ws2"
    h.run_ds_to_universal(dsh_checkpoints[first].tag_dir, dsh_checkpoints[first].root / UNIVERSAL)
    plain = [n for n in ALL_CONFIGS if n != first and ALL_CONFIGS[n].uc_info and n not in AUTOTP_UNCONVERTIBLE]
    noaff_base = tmp_path_factory.mktemp("dsh_noaff")
    noaff = {}
    for name in AUTOTP_NOAFF:
        ckpt = dsh_checkpoints[name]
        strip_affine_map(ckpt.tag_dir, noaff_base / name / ckpt.tag)
        noaff[name] = noaff_base / name
    h.run_ds_to_universal_many([(dsh_checkpoints[n].tag_dir, dsh_checkpoints[n].root / UNIVERSAL) for n in plain] +
                               [(root / dsh_checkpoints[n].tag, root / UNIVERSAL) for n, root in noaff.items()])
    nouc = [n for n in CONFIGS if not CONFIGS[n].uc_info]
    h.run_ds_to_universal_many([(dsh_checkpoints[n].tag_dir, dsh_checkpoints[n].root / UNIVERSAL) for n in nouc],
                               "--inject_missing_state")
    out = {name: (dsh_checkpoints[name].root, UNIVERSAL) for name in ALL_CONFIGS if name not in AUTOTP_UNCONVERTIBLE}
    out.update({f"{name}:noaff": (root, UNIVERSAL) for name, root in noaff.items()})

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
    """name (AutoEP: load_key(name, ws, ep); AutoTP: tp_load_key(name, ws, tp)) -> state restored
    by DeepSpeed's load_universal; all loads in three launches (ws 3, 2, 4). Corrupted copies
    load at LOAD_WS, swapped AutoEP copies at (4, 4)."""
    keys, requests = [], []
    for key, (root, tag) in dsh_universal.items():
        name = key.split(":")[0]
        if key.endswith(":noaff"):
            continue
        if name in AUTOTP:
            for ws, tp in AUTOTP_LOADS[name]:
                keys.append(tp_load_key(key, ws, tp))
                requests.append((dataclasses.replace(AUTOTP[name], world_size=ws, tp_size=tp), root, tag, ws))
        elif name in AUTOEP:
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


# ----------------------------------------------------------------------------------------------
# AutoTP


def tp_shard(full: torch.Tensor, layout: dict | None, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a full tensor, from the layout AutoTP recorded (the reverse
    of the worker's gather, written out again here so that the two do not share a mistake)."""
    if layout is None or layout["replicated"] or layout["partition_dim"] is None:
        return full
    pd = layout["partition_dim"]
    view = full.reshape(layout["logical_shape"])
    widths = layout["sub_param_shard_widths"] or [layout["partition_sizes"]]
    pieces, start = [], 0
    for w in widths:
        pieces.append(view.narrow(pd, start + sum(w[:tp_rank]), w[tp_rank]))
        start += sum(w)
    return torch.cat(pieces, dim=pd)


@pytest.mark.parametrize("name", [*AUTOTP, *AUTOTP_UNCONVERTIBLE])
def test_autotp_checkpoint_layout(dsh_checkpoints, name):
    ckpt = dsh_checkpoints[name]
    cfg = ckpt.config
    tp, dp = cfg.tp_size, cfg.world_size // cfg.tp_size
    prefix = "bf16_" if cfg.dtype == "bf16" else ""
    grid = [(d, t) for d in range(dp) for t in range(tp)]
    expected = {f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d, t in grid}
    if cfg.stage == 3:
        model_files = {(d, t): f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for d, t in grid}
    else:
        model_files = {(0, t): f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)}
    assert {p.name for p in ckpt.tag_dir.iterdir()} == expected | set(model_files.values())

    for (d, t), file in model_files.items():
        model = ds_load(ckpt.tag_dir / file)
        assert model["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": tp}
        assert (model["mp_world_size"], model["dp_world_size"]) == (tp, dp)
        uc = dict(model["universal_checkpoint_info"])
        affine = uc.pop("affine_map")
        if tp == 2:
            assert uc == EXPECTED_UC_INFO
        # One map per trainable parameter, replicated ones included.
        assert affine["version"] == 1 and set(affine["params"]) == {pat(n) for n in LLAMA_PARAM_NAMES}
        shapes = {n: tuple(s) for group in model["param_shapes"] for n, s in group.items()}
        layouts = ckpt.reference["meta"]["autotp_layouts"]
        # Each TP rank's file lists its own shard shapes; a zero-width shard is left out altogether
        # (runtime/utils.py is_optimized_parameter keeps it out of the optimizer groups).
        want = {n: tuple(tp_shard(ckpt.reference["fp32"][n], layouts[n], t).shape) for n in LLAMA_PARAM_NAMES}
        assert shapes == {n: s for n, s in want.items() if math.prod(s)}
        if tp == 2:
            assert shapes["lm_head.weight"] == ((19, 16) if t == 0 else (18, 16))

    if cfg.stage < 3:
        # The ZeRO-1/2 fp32 partitions of the dp ranks of TP rank t, concatenated, are TP shard t
        # of every parameter in param_shapes order: ties the file index mp_rank_t to the
        # reference's TP gather without going through the converter.
        layouts = ckpt.reference["meta"]["autotp_layouts"]
        for t in range(tp):
            shapes = ds_load(ckpt.tag_dir / f"mp_rank_{t:02d}_model_states.pt")["param_shapes"]
            flat = torch.cat([
                ds_load(ckpt.tag_dir / f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")
                ["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] for d in range(dp)
            ])
            offset = 0
            for n, shape in shapes[0].items():
                numel = math.prod(shape)
                want = tp_shard(ckpt.reference["fp32"][n], layouts[n], t)
                assert torch.equal(flat[offset:offset + numel].view(shape), want), (n, t)
                offset += numel
            assert offset == flat.numel()


@pytest.mark.parametrize("name", list(AUTOTP))
def test_autotp_reference_state(dsh_checkpoints, name):
    cfg = dsh_checkpoints[name].config
    ref = dsh_checkpoints[name].reference
    assert ref["param_names"] == LLAMA_PARAM_NAMES
    assert ref["meta"]["tp_size"] == 2 and ref["meta"]["world_size"] == 4
    assert ref["step"] == cfg.steps
    layouts = ref["meta"]["autotp_layouts"]
    assert tuple(ref["fp32"]["lm_head.weight"].shape) == (37, 16)
    assert layouts["lm_head.weight"]["partition_sizes"] == [19, 18]
    assert layouts["model.layers.0.self_attn.q_proj.weight"]["partition_sizes"] == [8, 8]
    assert layouts["model.layers.0.self_attn.o_proj.weight"]["partition_dim"] == 1
    assert layouts["model.layers.0.self_attn.o_proj.bias"]["replicated"] is True
    assert layouts["model.norm.weight"] is None
    for n, (_, widths) in SUB_PARAMS.items():
        assert layouts[n]["sub_param_shard_widths"] == widths
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert list(ref[key]) == LLAMA_PARAM_NAMES
        for n, t in ref[key].items():
            assert t.dtype == torch.float32
            if key != "fp32":
                # Every token id occurs in the training batches. bf16 gradients of the embedding can
                # still cancel to an exact 0 here and there (seen: 1 element of 592).
                zeros = (t == 0).sum().item()
                assert zeros == 0 if cfg.dtype == "fp32" else zeros <= t.numel() // 100, f"{key}/{n}: {zeros} zeros"


@pytest.mark.parametrize("name", list(AUTOTP))
def test_autotp_universal_files(dsh_checkpoints, dsh_universal, name):
    """DeepSpeed 0.19.8 rebuilds every AutoTP parameter from its affine map and then writes only
    `param` (plus `vocab_tensor` for the vocabulary pattern): no cat_dim, no sub_param_shape."""
    ckpt = dsh_checkpoints[name]
    root, tag = dsh_universal[name]
    zero = root / tag / "zero"
    for n in LLAMA_PARAM_NAMES:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            obj = torch.load(zero / n / f"{key}.pt", weights_only=True)
            assert set(obj) == ({"param", "vocab_tensor"} if n == "lm_head.weight" else {"param"}), (n, key)
            assert torch.equal(obj["param"], ckpt.reference[key][n]), f"{key}/{n}"
        # ZeRO-3 keeps the step only in optimizer_state.pt, at tp 2 as at tp 1.
        assert (zero / n / "step.pt").exists() == (ckpt.config.stage < 3)
    assert torch.load(zero / "lm_head.weight" / "fp32.pt", weights_only=True)["vocab_tensor"] is True
    # The model-states files are copied as they are, uc info (affine maps included) untouched.
    copied = sorted(p.name for p in (root / tag).glob("*model_states.pt"))
    assert copied == sorted(p.name for p in ckpt.tag_dir.glob("*model_states.pt"))


@pytest.mark.parametrize("name", AUTOTP_NOAFF)
def test_autotp_universal_files_without_affine_map(dsh_checkpoints, dsh_universal, name):
    """Without `affine_map` the converter takes the pattern categories and writes their layout
    keys; the tensors are the same."""
    ref = dsh_checkpoints[name].reference
    root, tag = dsh_universal[f"{name}:noaff"]
    zero = root / tag / "zero"
    for n in LLAMA_PARAM_NAMES:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            # sub_param_shape is a SubparamShape dataclass, which weights_only refuses.
            obj = ds_load(zero / n / f"{key}.pt")
            param = obj.pop("param")
            assert torch.equal(param, ref[key][n]), f"{key}/{n}"
            if n in ROW_PARALLEL:
                assert obj == {"cat_dim": 1}
            elif n in TP_REPLICATED:
                assert obj == {}
            elif n in SUB_PARAMS:
                sps = obj.pop("sub_param_shape")
                assert obj == {} and type(sps).__name__ == "SubparamShape"
                assert (sps.patterns, sps.shape, sps.partition_dim) == ([pat(n)], SUB_PARAMS[n][0], 0)
            elif n == "lm_head.weight":
                assert obj == {"cat_dim": 0, "vocab_tensor": True}
            else:
                assert n in COLUMN_PARALLEL and obj == {"cat_dim": 0}, n


@pytest.mark.parametrize("name", list(AUTOTP))
def test_autotp_universal_roundtrip_exact(dsh_checkpoints, dsh_loaded, name):
    ref = dsh_checkpoints[name].reference
    for ws, tp in AUTOTP_LOADS[name]:
        got = dsh_loaded[tp_load_key(name, ws, tp)]
        assert got["meta"]["world_size"] == ws and got["meta"]["tp_size"] == tp
        assert h.compare_states(ref, got) == [], (ws, tp)
        assert math.isfinite(got["meta"]["loss_after_load"])


def test_autotp_load_into_zero_width_shards(dsh_loaded):
    # 2 KV heads over 4 TP ranks: the attention weights of TP ranks 2 and 3 are empty, and the
    # restore (and the step after it) still come out right under ZeRO-2.
    layouts = dsh_loaded[tp_load_key("tpkv2_z2_fp32_ws4_tp2", 4, 4)]["meta"]["autotp_layouts"]
    assert layouts["model.layers.0.self_attn.q_proj.weight"]["partition_sizes"] == [8, 8, 0, 0]
    assert layouts["model.layers.0.self_attn.o_proj.weight"]["partition_sizes"] == [8, 8, 0, 0]
    assert layouts["model.layers.1.self_attn.qkv_proj.weight"]["sub_param_shard_widths"] == [[8, 8, 0, 0],
                                                                                            [4, 4, 0, 0],
                                                                                            [4, 4, 0, 0]]
    assert layouts["lm_head.weight"]["partition_sizes"] == [10, 9, 9, 9]


def test_autotp_ds_to_universal_fails_on_zero_width_shards(dsh_checkpoints, tmp_path):
    # Saved at tp 4 with 2 KV heads. mp_rank_02/03 list no shape for the empty shards, so the
    # merge asks math.prod(None) for a shape to fill the gap (ds_to_universal.py _merge_zero_shards).
    ckpt = dsh_checkpoints["tpkv2_z1_fp32_ws4_tp4"]
    with pytest.raises(RuntimeError, match="'NoneType' object is not iterable"):
        h.run_ds_to_universal(ckpt.tag_dir, tmp_path / "out", "--num_extract_workers", "1", "--num_merge_workers", "1")
