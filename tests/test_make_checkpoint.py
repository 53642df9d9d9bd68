"""benchmarks/make_checkpoint.py writes checkpoints DeepSpeed itself would write.

Three kinds of evidence, at small sizes:
* DeepSpeed 0.19.8's ds_to_universal.py accepts every generated configuration and its output is
  bit-equal to pyckpt's (so the generated partition arithmetic is what both converters expect);
* for the harness's own models, the generated files have exactly the pickled structure of real
  DeepSpeed saves (key order, types, tensor dtype/shape/stride/storage sharing, DeepSpeed
  objects), everything but the tensor values and the ds_id counter's origin;
* the values are varied, finite and consistent between files (module weights = fp32 masters).
"""

from __future__ import annotations

import enum
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsharness
import pyckpt
from compare import diff_folders
from dsharness import Config
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.inspect import describe

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "make_checkpoint.py"


def _load_generator():
    # benchmarks/ is not a package; dataclasses need the module registered while it executes.
    spec = importlib.util.spec_from_file_location("benchmarks_make_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


mc = _load_generator()

# name -> make_checkpoint arguments; ~50k parameters, so every flat group carries padding.
CASES = {
    "z1_fp32_dp2": dict(dp=2, stage=1),
    "z1_bf16_dp3": dict(dp=3, stage=1, dtype="bf16"),
    "z2_fp32_dp4": dict(dp=4, stage=2),
    "z2_bf16_dp3": dict(dp=3, stage=2, dtype="bf16"),
    # more ranks than some partitions have elements: empty fp32 partitions, all-padding moments
    "z2_fp32_dp64_tiny": dict(dp=64, stage=2, params=500),
    "z3_fp32_dp2": dict(dp=2, stage=3),
    "z3_fp32_dp3_subgroups": dict(dp=3, stage=3, sub_group_size=3000),
    "z3_bf16_dp4_subgroups": dict(dp=4, stage=3, dtype="bf16", sub_group_size=5000),
    "ep_z1_fp32": dict(dp=4, stage=1, experts=8, ep=2, moe_layers=2, layers=3),
    "ep_z2_bf16": dict(dp=4, stage=2, dtype="bf16", experts=4, ep=4, moe_layers=1, layers=2),
    "ep_z2_fp32_data_before_expert": dict(dp=6, stage=2, experts=6, ep=3, moe_layers=2, layers=3,
                                          data_before_expert=True),
    "ep_z3_fp32": dict(dp=4, stage=3, experts=8, ep=2, moe_layers=2, layers=3),
    "ep_z3_bf16_subgroups": dict(dp=4, stage=3, dtype="bf16", experts=8, ep=4, moe_layers=2, layers=3,
                                 sub_group_size=2000),
    "ep_z3_fp32_data_before_expert": dict(dp=4, stage=3, experts=4, ep=2, moe_layers=1, layers=2,
                                          data_before_expert=True),
    # Megatron-style tensor parallel: column, row, fused two-half, vocabulary, replicated, averaged
    "tp2_z1_fp32_dp2": dict(dp=2, stage=1, tp=2),
    "tp4_z2_bf16_dp3": dict(dp=3, stage=2, dtype="bf16", tp=4),
    "tp8_z2_fp32_dp2": dict(dp=2, stage=2, tp=8),
    "tp2_z3_fp32_dp3": dict(dp=3, stage=3, tp=2),
}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Every case generated, then converted by DeepSpeed (one batched run) and by pyckpt."""
    root = tmp_path_factory.mktemp("make_checkpoint")
    out = {}
    jobs = []
    for name, kw in CASES.items():
        info = {}
        tag_dir = mc.make_checkpoint(root / name / "ckpt", report=info, **{"params": 50_000, **kw})
        ds_out = root / name / "ds" / f"{tag_dir.name}_universal"
        py_out = root / name / "pyckpt" / f"{tag_dir.name}_universal"
        jobs.append((tag_dir, ds_out))
        out[name] = dict(tag_dir=tag_dir, ds=ds_out, pyckpt=py_out, info=info)
    dsharness.run_ds_to_universal_many(jobs, "--num_extract_workers", "1", "--num_merge_workers", "1")
    for name, item in out.items():
        pyckpt.convert_to_universal(item["tag_dir"], item["pyckpt"])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_deepspeed_converter_accepts_it_and_agrees_with_pyckpt(generated, name):
    item = generated[name]
    assert diff_folders(str(item["ds"]), str(item["pyckpt"])) == []
    assert (item["ds"] / "zero" / "optimizer_state.pt").is_file()


@pytest.mark.parametrize("name", list(CASES))
def test_inspect_sees_stage_dp_and_numel(generated, name):
    kw, item = CASES[name], generated[name]
    model = item["info"]["model"]
    info = describe(item["tag_dir"].parent)  # the save dir: found through `latest`
    assert (info["zero_stage"], info["dp"], info["tp"], info["pp"]) == (kw["stage"], kw["dp"], kw.get("tp", 1), 1)
    # param_shapes hold each EP rank's local experts, so AutoEP counts them once, not ep times
    assert info["trainable_numel"] == sum(math.prod(s) for _, s in model.params)
    assert info["trainable_params"] == len(model.params)
    assert info["bf16_optimizer_files"] == (kw.get("dtype") == "bf16")
    assert info["master_dtype"] == "float32"
    groups = 1 + bool(model.layers)
    if "subgroups" in name:
        assert info["zero_sub_groups"] > groups
    else:
        assert info["zero_sub_groups"] == groups
    if kw["stage"] < 3:
        assert set(info["model_dtypes"]) == {"bfloat16" if kw.get("dtype") == "bf16" else "float32"}
        # the last rank's partition of the dense group carries alignment padding
        last = SourceFile(next(item["tag_dir"].glob(f"*zero_pp_rank_{kw['dp'] - 1}_mp_rank_00_optim_states.pt")))
        assert last.load()["optimizer_state_dict"]["group_paddings"][0] > 0
    assert item["info"]["numel"] == model.numel()


def test_inspect_command_line(generated):
    item = generated["z2_bf16_dp3"]
    proc = subprocess.run([sys.executable, "-m", "pyckpt.inspect", "--json", str(item["tag_dir"])], capture_output=True,
                          text=True, check=True, cwd=item["tag_dir"].parent)
    info = json.loads(proc.stdout)
    assert (info["zero_stage"], info["dp"]) == (2, 3)
    assert info["trainable_numel"] == item["info"]["numel"]
    assert sorted(info["file_sizes"]) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                          "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                          "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]


def _universal(item, name, state):
    t = torch.load(item["pyckpt"] / "zero" / name / f"{state}.pt", weights_only=True)
    return t["param"] if isinstance(t, dict) else t


@pytest.mark.parametrize("case", ["z2_fp32_dp4", "z3_fp32_dp3_subgroups", "ep_z1_fp32"])
def test_values_are_varied_finite_and_consistent(generated, case):
    item = generated[case]
    params = item["info"]["model"].params
    seen = {}
    for name, _ in params:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            t = _universal(item, name, state)
            assert torch.isfinite(t).all(), f"{state}/{name}"
            assert t.numel() < 4 or len(torch.unique(t)) > t.numel() // 2, f"{state}/{name} is not varied"
            if state == "exp_avg_sq":
                assert (t >= 0).all()
            seen[(name, state)] = t
        assert not torch.equal(seen[(name, "fp32")], seen[(name, "exp_avg")])
    (a, _), (b, _) = params[0], params[1]
    n = min(seen[(a, "fp32")].numel(), seen[(b, "fp32")].numel())
    assert not torch.equal(seen[(a, "fp32")].reshape(-1)[:n], seen[(b, "fp32")].reshape(-1)[:n])
    if CASES[case]["stage"] == 3:  # DeepSpeed keeps the ZeRO-3 step only in optimizer_state.pt
        common = torch.load(item["pyckpt"] / "zero" / "optimizer_state.pt", weights_only=False)
        assert common["optimizer_state_dict"]["state"][0]["step"].item() == 1.0
    else:
        assert torch.load(item["pyckpt"] / "zero" / params[0][0] / "step.pt", weights_only=True).item() == 1.0
    if CASES[case]["stage"] < 3:
        # fp32 model: the module's weights are the fp32 masters, as after a real optimizer step
        module = torch.load(item["tag_dir"] / "mp_rank_00_model_states.pt", weights_only=True)["module"]
        for name, value in module.items():
            ref = name.replace("mlp.gate.gate.", "mlp.router.gate.")  # AutoEP's module-only alias
            assert torch.equal(value, seen[(ref, "fp32")]), name
    model = item["info"]["model"]
    for layer in model.layers:
        # per-expert files hold each global expert's rows of the fp32 masters (fp32 model dtype)
        for eid in (0, layer.num_experts - 1):
            obj = torch.load(item["tag_dir"] / f"layer_{layer.moe_layer_id}_expert_{eid}_mp_rank_00_model_states.pt",
                             weights_only=True)
            for w in mc.WEIGHTS:
                assert torch.equal(obj[f"{layer.prefix}.{w}.{eid}"], seen[(f"{layer.prefix}.{w}", "fp32")][eid])


# ----------------------------------------------------------------------------------------------
# Structure: generated vs real DeepSpeed saves of the harness's models
# ----------------------------------------------------------------------------------------------


def _signature(obj):
    if torch.is_tensor(obj):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.stride(), obj.storage_offset(),
                obj.untyped_storage().nbytes(), obj.requires_grad, tuple(sorted(k for k in obj.__dict__)))
    if isinstance(obj, dict):
        return (type(obj).__name__, tuple((k, _signature(v)) for k, v in obj.items()))
    if isinstance(obj, torch.Size):
        return ("Size", tuple(obj))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_signature(v) for v in obj))
    if isinstance(obj, enum.Enum):
        return ("enum", type(obj).__module__, type(obj).__qualname__, obj.value)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return ("object", type(obj).__module__, type(obj).__qualname__, _signature(vars(obj)))
    return (type(obj).__name__, obj)


def _tensors(obj, out):
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def _file_signature(path):
    obj = torch.load(path, weights_only=False)
    tensors = _tensors(obj, [])
    # which tensors share a storage record (module views of a flat group, stripped fp32 partitions)
    ids = {}
    sharing = [ids.setdefault(t.untyped_storage().data_ptr(), len(ids)) if t.untyped_storage().nbytes() else None
               for t in tensors]
    # ds_id counts parameters per process; the harness saves several models in one process.
    ds_ids = [tuple(int(x) for x in t.ds_id.split("_")) for t in tensors if hasattr(t, "ds_id")]
    base = min((a for a, _ in ds_ids), default=0)
    return _signature(obj), sharing, [(a - base, b - base) for a, b in ds_ids]


def _first_difference(a, b, where):
    if type(a) is not type(b) or (not isinstance(a, tuple) and a != b):
        return f"{where}: {a!r:.300} vs {b!r:.300}"
    if isinstance(a, tuple):
        if len(a) != len(b):
            return f"{where}: {a!r:.300} vs {b!r:.300}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{where}/{a[0] if i and isinstance(a[0], str) else i}")
            if found:
                return found
    return None


# (generated case, harness config, generator arguments); the ZeRO-3 dense one goes first in the
# launch, so its ds_ids start at 0 as in a fresh process.
REAL = [
    ("tiny_z3_subgroups", Config(3, "fp32", 2, sub_group_size=16), dict(dp=2, stage=3, sub_group_size=16)),
    ("tiny_z1_fp32", Config(1, "fp32", 2), dict(dp=2, stage=1)),
    ("tiny_z2_bf16", Config(2, "bf16", 2), dict(dp=2, stage=2, dtype="bf16")),
    ("moe_z2_bf16", Config(2, "bf16", 2, model="moe", ep_size=2), dict(dp=2, stage=2, dtype="bf16", ep=2)),
    ("moe_z1_fp32_ep1", Config(1, "fp32", 2, model="moe", ep_size=1), dict(dp=2, stage=1, ep=1)),
    ("moe_z3_fp32", Config(3, "fp32", 2, model="moe", ep_size=2), dict(dp=2, stage=3, ep=2)),
]


def _harness_model(cfg):
    if cfg.model == "tiny":  # dsharness.models.Tiny
        return mc.Model([("l0.weight", (7, 4)), ("l0.bias", (7, )), ("l1.weight", (3, 7)), ("l1.bias", (3, ))])
    # dsharness.models.TinyMoE after AutoEP: H=10, F=6, 8 experts, two MoE layers, no attention
    return mc.autoep_model(2, 10, dsharness.MOE_NUM_EXPERTS, cfg.ep_size, 2, ffn=6, attention=False,
                           final_norm_bias=True)


def test_structure_matches_real_deepspeed_saves(tmp_path, monkeypatch):
    made = dsharness.make_checkpoints([(cfg, tmp_path / "real" / name) for name, cfg, _ in REAL])
    # The harness trains 3 steps at micro-batch 2 with a few extra AutoEP switches; mirror that.
    monkeypatch.setattr(mc, "GLOBAL_STEPS", made[0].config.steps)
    monkeypatch.setattr(mc, "MICRO_BATCH", 2)
    plain = mc._Writer.ds_config

    def harness_config(self):
        config = plain(self)
        if "expert_parallel" in config:
            config["expert_parallel"].update(use_grouped_mm=False, disable_triton_grouped_mm=True)
        return config

    monkeypatch.setattr(mc._Writer, "ds_config", harness_config)
    problems = []
    for (name, cfg, kw), real in zip(REAL, made):
        tag_dir = mc.make_checkpoint(tmp_path / "generated" / name, params=0, model=_harness_model(cfg), **kw)
        assert tag_dir.name == real.tag
        real_files, files = sorted(os.listdir(real.tag_dir)), sorted(os.listdir(tag_dir))
        if real_files != files:
            problems.append(f"{name}: files {real_files} vs {files}")
            continue
        for f in files:
            (sig_a, share_a, ids_a), (sig_b, share_b, ids_b) = (_file_signature(real.tag_dir / f),
                                                                _file_signature(tag_dir / f))
            found = _first_difference(sig_a, sig_b, f"{name}/{f}")
            if found:
                problems.append(found)
            if share_a != share_b:
                problems.append(f"{name}/{f}: storage sharing {share_a} vs {share_b}")
            if ids_a != ids_b:
                problems.append(f"{name}/{f}: ds_id {ids_a} vs {ids_b}")
        if cfg.stage == 3:
            osd = torch.load(next(tag_dir.glob("*zero_pp_rank_0_*optim_states.pt")), weights_only=False)
            assert osd["optimizer_state_dict"]["fp32_flat_groups"][0].ds_id.startswith("0_")
    assert problems == []


# ----------------------------------------------------------------------------------------------
# Sizing and the command line
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(layers=24), dict(hidden=4095), dict(experts=64, ep=8, moe_layers=2),
                                dict(tp=8)])
def test_models_are_sized_to_the_target_with_odd_shapes(kw):
    target = 10**9
    model = mc.size_model(target, kw.get("layers"), kw.get("hidden"), kw.get("experts", 0), kw.get("ep", 1),
                          kw.get("moe_layers", 0), kw.get("tp", 1))
    assert abs(model.numel() - target) / target < 0.01
    hidden = model.params[0][1][-1]
    if kw.get("tp"):
        # Hidden is an odd multiple of tp; each rank holds 1/tp of the split parameters.
        assert hidden % 8 == 0 and (hidden // 8) % 2 == 1
        assert model.params[[n for n, _ in model.params].index("layers.0.qkv.weight")][1] == (3 * hidden // 8, hidden)
        return
    assert hidden % 2 == 1 or kw.get("hidden")
    if kw.get("layers"):
        assert sum(name.endswith(".bias") and "norm" not in name for name, _ in model.params) == kw["layers"]
    if kw.get("experts"):
        assert len(model.layers) == 2 and all(layer.num_local == 8 for layer in model.layers)
        w1 = model.params[[n for n, _ in model.params].index("model.layers.0.mlp.experts.w1")][1]
        assert w1[0] == 8 and w1[2] == hidden


def test_parse_count():
    assert [mc.parse_count(s) for s in ("1B", "350M", "50k", "2e9", 123)] == [10**9, 350 * 10**6, 50_000, 2 * 10**9, 123]


def test_command_line(tmp_path):
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--params", "20k", "--dp", "2", "--stage", "2",
                           "--dtype", "bf16", "--experts", "4", "--ep", "2", "--moe-layers", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ZeRO-2 bf16 dp 2" in proc.stdout and "GB/s" in proc.stdout
    assert (out / "latest").read_text() == "global_step1"
    names = set(os.listdir(out / "global_step1"))
    assert {"mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "layer_0_expert_3_mp_rank_00_model_states.pt"} <= names
    assert not [n for n in os.listdir(out) if "noise" in n]  # the value source is removed
    # a second run does not silently replace the checkpoint
    again = subprocess.run([sys.executable, str(SCRIPT), str(out), "--params", "20k", "--dp", "2", "--stage", "1"],
                           capture_output=True, text=True)
    assert again.returncode != 0 and "exists" in again.stderr


@pytest.mark.parametrize("name", ["tp4_z2_bf16_dp3", "tp2_z3_fp32_dp3"])
def test_tp_cases_exercise_every_merge_rule(generated, name):
    # The universal tensors are the whole logical ones: tp slices put back on the right dim, the
    # fused halves interleaved back, the padded vocabulary rows stripped, replicated ones taken once.
    item, tp = generated[name], CASES[name]["tp"]
    model = item["info"]["model"]
    shapes = dict(model.params)
    k = shapes["layers.0.qkv.weight"][0] // 3
    h = k * tp
    expect = {
        "embed.weight": ((mc.VOCAB_TP - 3, h), {"cat_dim": 0, "vocab_tensor": True}),
        "layers.0.qkv.weight": ((3 * h, h), {"cat_dim": 0}),
        "layers.0.attn_out.weight": ((h, h), {"cat_dim": 1}),
        "layers.0.gate_up.weight": ((4 * h, h), {"cat_dim": 0, "param_n_sub_params": 2}),
        "layers.0.down.weight": ((h, 2 * h), {"cat_dim": 1}),
        "layers.0.input_norm.weight": ((h, ), {}),
        "layers.0.post_norm.weight": ((h, ), {}),
    }
    for pname, (shape, extra) in expect.items():
        obj = torch.load(item["pyckpt"] / "zero" / pname / "fp32.pt", weights_only=False)
        assert tuple(obj["param"].shape) == shape, pname
        assert {key: v for key, v in obj.items() if key != "param"} == extra, pname
    # Averaged slices differ per tp rank (so the mean is a real computation), replicated ones do not.
    if CASES[name]["stage"] < 3:
        mods = [torch.load(item["tag_dir"] / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)["module"]
                for t in range(tp)]
        averaged = [m["layers.0.post_norm.weight"] for m in mods]
        assert not any(torch.equal(averaged[0], a) for a in averaged[1:])
        assert all(torch.equal(mods[0]["layers.0.input_norm.weight"], m["layers.0.input_norm.weight"]) for m in mods)


def test_bad_topologies_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must divide --dp"):
        mc.make_checkpoint(tmp_path / "a", params=10_000, dp=6, stage=2, experts=8, ep=4)
    with pytest.raises(ValueError, match="not divisible by --ep"):
        mc.make_checkpoint(tmp_path / "b", params=10_000, dp=6, stage=2, experts=8, ep=3)
    with pytest.raises(ValueError, match="ZeRO-3 setting"):
        mc.make_checkpoint(tmp_path / "c", params=10_000, dp=2, stage=2, sub_group_size=100)
    with pytest.raises(ValueError, match="DeepSpeed refuses AutoEP combined with tensor parallelism"):
        mc.make_checkpoint(tmp_path / "d", params=10_000, dp=2, stage=2, experts=4, ep=2, tp=2)
    with pytest.raises(ValueError, match="not divisible by --tp 4"):
        mc.make_checkpoint(tmp_path / "e", params=10_000, dp=2, stage=2, hidden=30, tp=4)
