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
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsharness
import pyckpt.testing as mc
import pyckpt
from compare import diff_folders
from dsharness import Config
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.zero.describe import describe

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "make_checkpoint.py"

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
    # realistic layouts (Hugging Face names), kept small by 11 vocabulary rows and tiny widths; hidden 9
    # (3 heads of 3, 1 KV head) makes the dense group's size odd, so partitions carry padding
    "llama_z1_fp32_dp2": dict(dp=2, stage=1, family="llama", layers=2, hidden=9, vocab=11),
    "llama_z2_bf16_dp2": dict(dp=2, stage=2, dtype="bf16", family="llama", layers=2, hidden=9, vocab=11),
    "llama_z3_fp32_dp2": dict(dp=2, stage=3, family="llama", layers=2, hidden=9, vocab=11),
    # AutoTP (DeepSpeed 0.19.8's metadata: exact-name patterns and an affine map of every parameter)
    "llama_autotp2_z2_fp32_dp3": dict(dp=3, stage=2, tp=2, family="llama", layers=2, hidden=8, vocab=12),
    "llama_autotp4_z1_bf16_dp5": dict(dp=5, stage=1, dtype="bf16", tp=4, family="llama", layers=2, hidden=8,
                                      vocab=12),
    "mixtral_z2_fp32": dict(dp=4, stage=2, family="mixtral", experts=4, ep=2, layers=2, hidden=9, vocab=11),
    "deepseek_z2_fp32": dict(dp=4, stage=2, family="deepseek", experts=4, ep=2, layers=3, dense_layers=1,
                             hidden=8, vocab=11),
    "deepseek_z3_bf16": dict(dp=4, stage=3, dtype="bf16", family="deepseek", experts=4, ep=2, layers=3,
                             dense_layers=1, hidden=8, vocab=11),
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
    proc = subprocess.run([sys.executable, "-m", "pyckpt.describe", "--json", str(item["tag_dir"])], capture_output=True,
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


@pytest.mark.parametrize("case", ["z2_fp32_dp4", "z3_fp32_dp3_subgroups", "ep_z1_fp32", "mixtral_z2_fp32",
                                  "deepseek_z2_fp32"])
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
        states = torch.load(item["tag_dir"] / "mp_rank_00_model_states.pt", weights_only=True)
        module, buffers = states["module"], set(states["buffer_names"])
        for name, value in module.items():
            if name in buffers:  # DeepSeek's router bias: float32 whatever the training dtype, varied
                assert value.dtype == torch.float32 and torch.isfinite(value).all(), name
                assert len(torch.unique(value)) > value.numel() // 2, name
                continue
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
    monkeypatch.setattr(mc.records, "GLOBAL_STEPS", made[0].config.steps)
    monkeypatch.setattr(mc.records, "MICRO_BATCH", 2)
    plain = mc.ZeroWriter.ds_config

    def harness_config(self):
        config = plain(self)
        if "expert_parallel" in config:
            config["expert_parallel"].update(use_grouped_mm=False, disable_triton_grouped_mm=True)
        return config

    monkeypatch.setattr(mc.ZeroWriter, "ds_config", harness_config)
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


# ----------------------------------------------------------------------------------------------
# Realistic layouts (--family)
# ----------------------------------------------------------------------------------------------


def test_family_layouts_have_the_real_names_and_counts():
    llama = mc.size_model(0, 80, 8, family="llama")
    names = [n for n, _ in llama.params]
    assert len(names) == 723 and len(set(names)) == 723
    assert names[:2] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    shapes = dict(llama.params)
    q, k = shapes["model.layers.79.self_attn.q_proj.weight"], shapes["model.layers.79.self_attn.k_proj.weight"]
    assert k[0] < q[0] and k[1] == q[1] == 8  # grouped-query attention
    assert [n.split(".", 3)[3] for n in names[1:10]] == [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight"]

    mixtral = mc.size_model(0, 32, 8, 8, 2, family="mixtral")
    assert len(mixtral.params) == 32 * 10 + 3 and len(mixtral.layers) == 32
    assert mixtral.layers[5].module_path == "model.layers.5.mlp"  # the mixtral preset's moe_layer_pattern
    assert mixtral.aliases["model.layers.5.mlp.gate.gate.weight"] == "model.layers.5.mlp.router.gate.weight"
    assert dict(mixtral.params)["model.layers.5.mlp.experts.w2"] == (4, 8, 28)

    ds = mc.size_model(0, 61, 8, 256, 64, family="deepseek")
    assert len(ds.layers) == 58 and ds.layers[0].module_path == "model.layers.3.mlp" and not ds.aliases
    assert sum(layer.num_experts for layer in ds.layers) == 14_848
    assert len(ds.expert_layer) == 58 * 3 and all(".experts.w" in n for n in ds.expert_layer)
    names = [n for n, _ in ds.params]
    assert len(names) == 3 * 12 + 58 * 16 + 3
    assert "model.layers.2.mlp.down_proj.weight" in names and "model.layers.3.mlp.down_proj.weight" not in names
    layer3 = [n.split(".", 3)[3] for n in names if n.startswith("model.layers.3.")]
    assert layer3 == ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
                      "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                      "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.router.gate.weight",
                      "mlp.experts.w1", "mlp.experts.w2", "mlp.experts.w3", "mlp.shared_experts.gate_proj.weight",
                      "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
                      "input_layernorm.weight", "post_attention_layernorm.weight"]
    # at the real widths, the real models' parameter counts
    assert mc.llama_model(80, 8192).numel() == 70_553_706_496  # Llama 3 70B
    assert mc.mixtral_model(32, 4096, 8, 1).numel() == 46_702_792_704  # Mixtral 8x7B
    assert mc.deepseek_model(61, 7168, 256, 1).numel() == 671_026_404_352  # DeepSeek-V3


@pytest.mark.parametrize("family, target", [("llama", 8 * 10**9), ("mixtral", 10**9), ("deepseek", 2 * 10**9)])
def test_family_models_are_sized_to_the_target(family, target):
    model = mc.size_model(target, None, None, ep=2 if family != "llama" else 1, family=family)
    assert abs(model.numel() - target) / target < 0.05
    assert model.family == family and model.params[0][1][1] % 64 == 0


def test_family_llama_autotp_slices(generated):
    """AutoTP's maps put each slice back where it came from: whole tensors, and only lm_head (a
    vocabulary parameter) marked; the merge rules of the pattern lists are not what is used."""
    item = generated["llama_autotp2_z2_fp32_dp3"]
    expect = {"lm_head.weight": ((12, 8), {"vocab_tensor": True}),
              "model.embed_tokens.weight": ((12, 8), {}),
              "model.layers.1.self_attn.k_proj.weight": ((4, 8), {}),
              "model.layers.1.self_attn.o_proj.weight": ((8, 8), {}),
              "model.layers.1.mlp.down_proj.weight": ((8, 28), {}),
              "model.layers.1.input_layernorm.weight": ((8, ), {})}
    for pname, (shape, extra) in expect.items():
        obj = torch.load(item["pyckpt"] / "zero" / pname / "fp32.pt", weights_only=False)
        assert tuple(obj["param"].shape) == shape, pname
        assert {key: v for key, v in obj.items() if key != "param"} == extra, pname
    state = torch.load(item["tag_dir"] / "mp_rank_01_model_states.pt", weights_only=False)
    info = state["universal_checkpoint_info"]
    assert state["ds_config"]["tensor_parallel"] == {"autotp_size": 2, "preset_model": "llama"}
    assert info["vocabulary_parameter_patterns"] == [r"^lm_head\.weight$"]
    assert r"^model\.embed_tokens\.weight$" in info["tp_replicated_parameter_patterns"]
    assert len(info["affine_map"]["params"]) == len(item["info"]["model"].params)


@pytest.mark.parametrize("name", ["mixtral_z2_fp32", "deepseek_z3_bf16"])
def test_family_autoep_metadata(generated, name):
    item = generated[name]
    files = sorted(os.listdir(item["tag_dir"]))
    state = torch.load(item["tag_dir"] / [f for f in files if f.endswith("model_states.pt") and "expert" not in f][0],
                       weights_only=False)
    preset = {"mixtral": "mixtral", "deepseek": "deepseek_v3"}[CASES[name]["family"]]
    assert state["ds_config"]["expert_parallel"]["preset_model"] == preset
    first = 0 if preset == "mixtral" else 1
    assert [e["module_path"] for e in state["ds_autoep_layers"]] == [f"model.layers.{i}.mlp" for i in range(first, 3 if first else 2)]
    assert state["ds_autoep_layers"][0]["expert_key_prefix"] == f"model.layers.{first}.mlp.experts"
    module = state["module"]
    assert (f"model.layers.{first}.mlp.gate.gate.weight" in module) == (preset == "mixtral")
    # DeepSeek's e_score_correction_bias, copied by AutoEP onto the router, a float32 buffer of one value per
    # expert (whole in every ZeRO-3 rank's file: buffers are not partitioned); the router's own buffer comes
    # before its gate child's weight in state_dict order
    bias = [f"model.layers.{i}.mlp.router.e_score_correction_bias" for i in range(first, 3 if first else 2)]
    assert state["buffer_names"] == (bias if preset == "deepseek_v3" else [])
    keys = list(module)
    for b in state["buffer_names"]:
        assert module[b].dtype == torch.float32 and tuple(module[b].shape) == (CASES[name]["experts"], )
        assert keys.index(b) + 1 == keys.index(b.replace("e_score_correction_bias", "gate.weight"))
    if CASES[name]["stage"] < 3:
        assert not [k for k in module if ".experts." in k]
        experts = [f for f in files if f.startswith("layer_")]
        assert len(experts) == len(state["ds_autoep_layers"]) * CASES[name]["experts"]


def test_family_refusals():
    with pytest.raises(ValueError, match="dense"):
        mc.make_checkpoint("/nonexistent", params=0, dp=2, stage=2, family="llama", experts=4, layers=2, hidden=8)
    with pytest.raises(ValueError, match="refuses AutoEP"):
        mc.size_model(0, 2, 8, 4, 2, tp=2, family="mixtral")
    with pytest.raises(ValueError, match="need --family"):
        mc.size_model(0, 2, 8, heads=2)
    with pytest.raises(ValueError, match="must divide the query heads"):
        mc.size_model(0, 2, 8, tp=2, family="llama", heads=1)
    with pytest.raises(ValueError, match="--dense-layers"):
        mc.size_model(0, 3, 8, 4, 2, family="deepseek", dense_layers=3)


def test_family_command_line(tmp_path):
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--family", "deepseek", "--layers", "4", "--hidden", "8",
                           "--vocab", "11", "--experts", "4", "--ep", "2", "--dp", "2", "--stage", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "deepseek (55 params)" in proc.stdout and "1 MoE layers x 4 experts" in proc.stdout
    names = set(os.listdir(out / "global_step1"))
    assert "layer_0_expert_3_mp_rank_00_model_states.pt" in names and "layer_1_expert_0_mp_rank_00_model_states.pt" not in names
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x"), "--family", "llama", "--experts", "4", "--dp",
                          "2", "--stage", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "is dense" in bad.stderr
