"""Reading torch.distributed.checkpoint folders (issue 39): real DCP checkpoints saved by FSDP2 and
FSDP2 x tensor-parallel training jobs (torch 2.13, transformers' Llama tied and untied, Mixtral), by
torch's safetensors-backed HuggingFaceStorageWriter, and by torchtitan 0.3.0's checkpointer, exported
to Hugging Face folders: each loads into transformers with every weight the job's own at save time,
bit for bit, and equals what users make today (torch's dcp_to_torch_save + save_pretrained, or
torchtitan's own state-dict adapter).

The checkpoints come from tests/dcp/conftest.py's session fixtures (tests/helpers/dcp_sources.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_sources as sources
import pyckpt

pytestmark = pytest.mark.slow  # every test here reads checkpoints made by torchrun launches

CASES = list(sources.CASES)
# Cases whose logits a one-process model reproduces bit for bit. Under tensor parallelism the row-wise
# layers sum partial products in another order; Mixtral's experts differ by a few ulps on CPU between
# the sharded run and one process (at most ~2e-7 here). Those are compared within 1e-5.
EXACT_LOGITS = {"llama_fsdp", "llama_tied_fsdp", "llama_hf_writer"}
# transformers 5.22's save_pretrained writes Mixtral's experts back in the Hub's older per-expert layout
# (block_sparse_moe.experts.N.w1/w2/w3, its conversion mapping reversed); the export keeps the names the
# model has in memory and in the DCP folder (mlp.experts.gate_up_proj / down_proj, mlp.gate), which
# from_pretrained loads as they are. For these the files are compared with the job's own state dict.
RUNTIME_NAMES = {"mixtral_fsdp"}


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


def _safetensors(folder: Path) -> dict:
    """Every tensor of a Hugging Face folder's safetensors files (one file or shards), by name."""
    from safetensors.torch import load_file

    out = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    for f in files:
        part = load_file(f)
        assert not set(part) & set(out), f"{f.name} repeats a tensor"
        out.update(part)
    return out


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert _same(got[name], t), (name, got[name].dtype, t.dtype)


def _baseline_files(name: str, references: dict, ref: dict) -> dict:
    """The tensors the export's files must hold: the baseline folder's, or for RUNTIME_NAMES the job's."""
    return dict(ref["model"]) if name in RUNTIME_NAMES else _safetensors(references[name])


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return model.eval()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _check_loaded(model, name: str, ref: dict) -> None:
    """``model`` holds the job's weights at save time, bit for bit, and gives its logits."""
    state = model.state_dict()
    assert sorted(state) == sorted(ref["model"])
    for key, want in ref["model"].items():
        assert _same(state[key], want), key
    logits = _logits(model, ref["ids"])
    if name in EXACT_LOGITS:
        assert _same(logits, ref["logits"])
    else:
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


# -- the reference side: what the fixtures made, and what users make of it today -------------------------

@pytest.mark.parametrize("name", CASES)
def test_reference_folder_is_the_jobs_state(dcp_sources, dcp_references, name):
    """The baseline itself (no pyckpt): torch's own reader + save_pretrained gives a folder that loads with
    no missing or unexpected keys, holds the job's weights at save time and gives its logits. The folder
    has the layout its writer makes: .metadata + one .distcp per rank, or one safetensors shard per rank."""
    s = dcp_sources[name]
    ref = torch.load(s.reference, weights_only=False)
    names = sorted(p.name for p in s.dcp.iterdir())
    world = sources.CASES[name][0]
    if name == "llama_hf_writer":
        assert names == [f"shard-{r + 1:05d}-model-00001-of-00001.safetensors" for r in range(world)]
    else:
        assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]
        got = sources.load_dcp(s.dcp)
        assert sorted(got) == ["model", "optim"]
        for key, want in ref["optim"]["state"].items():
            for field, t in want.items():
                assert _same(got["optim"]["state"][key][field], t), (key, field)
    _check_loaded(_load(dcp_references[name]), name, ref)
    assert len(ref["losses"]) == 3 and all(x == x for x in ref["losses"])


def test_torchtitan_reference_is_torchtitans_model(dcp_sources):
    """The torchtitan baseline: its checkpoint's model entries are the model's state, and the adapter's
    to_hf of it, in a transformers Llama of the written config, gives torchtitan's Llama3 logits (the
    config matches the model: shape, rotary base, norm eps)."""
    from torchtitan_worker import build, stub_triton_kernels
    from transformers import AutoConfig, AutoModelForCausalLM

    stub_triton_kernels()
    s = dcp_sources["torchtitan"]
    ref = torch.load(s.reference, weights_only=False)
    got = sources.load_dcp(s.dcp)
    assert {"optimizer", "lr_scheduler", "dataloader", "train_state"} <= set(got)
    assert got["train_state"] == {"step": 2, "ntokens_seen": 64} and got["lr_scheduler"] == {"last_epoch": 2}
    for key, want in ref["tt"].items():
        assert _same(got[key], want), key
    hf_cfg = json.loads((s.config / "config.json").read_text())
    shape = {**hf_cfg, "rope_theta": hf_cfg["rope_parameters"]["rope_theta"]}
    torch.manual_seed(0)
    _, tt_model = build(shape)
    tt_model.load_state_dict(ref["tt"], strict=True)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(s.config), dtype=torch.float32)
    hf_model.load_state_dict(ref["hf"], strict=True)
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    tt_model.eval()
    hf_model.eval()
    with torch.no_grad():
        tt_logits = tt_model(ids, pos, tt_model.get_attention_masks(pos))
        hf_logits = hf_model(input_ids=ids).logits
    torch.testing.assert_close(hf_logits, tt_logits, rtol=1e-4, atol=1e-5)


# -- pyckpt's export ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_export_loads_into_transformers_as_the_job_saved_it(dcp_sources, dcp_references, tmp_path, name):
    """pyckpt.export_hf of the DCP folder (config.json found beside it): transformers loads it with no
    missing or unexpected keys, every weight is the job's at save time bit for bit, the logits are the
    job's, and its safetensors hold exactly the baseline folder's tensors (names, dtypes, values; for
    RUNTIME_NAMES the job's state dict's) — a tied model without lm_head.weight, as save_pretrained leaves
    it out."""
    s = dcp_sources[name]
    ref = torch.load(s.reference, weights_only=False)
    out = tmp_path / "hf"
    pyckpt.export_hf(s.dcp, out)
    assert json.loads((out / "config.json").read_text()) == json.loads((s.config / "config.json").read_text())
    model = _load(out)
    _check_loaded(model, name, ref)
    baseline = _load(dcp_references[name])
    _assert_same_tensors(model.state_dict(), baseline.state_dict())
    assert _same(_logits(model, ref["ids"]), _logits(baseline, ref["ids"]))
    _assert_same_tensors(_safetensors(out), _baseline_files(name, dcp_references, ref))
    if name == "llama_tied_fsdp":
        assert "lm_head.weight" not in _safetensors(out)


@pytest.mark.parametrize("name", ["llama_fsdp", "llama_tied_fsdp", "mixtral_fsdp", "llama_fsdp_tp",
                                  "llama_hf_writer"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cli_export_equals_the_baseline(dcp_sources, dcp_references, tmp_path, name, dtype):
    """``python -m pyckpt export DCP OUT [--dtype bf16]`` (run from outside the source tree): the baseline
    folder's tensors (the job's for RUNTIME_NAMES), cast to bf16 under --dtype bf16 (torch's own cast),
    and a config."""
    s = dcp_sources[name]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pyckpt", "export", str(s.dcp), str(out)]
    if dtype != "fp32":
        cmd += ["--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = _baseline_files(name, dcp_references, torch.load(s.reference, weights_only=False))
    if dtype == "bf16":
        want = {k: v.to(torch.bfloat16) for k, v in want.items()}
    _assert_same_tensors(_safetensors(out), want)
    assert (out / "config.json").is_file()


def test_torchtitan_export_is_torchtitans_own_conversion(dcp_sources, tmp_path):
    """from_torchtitan with the Hugging Face config: torchtitan's checkpointer's folder (model at the top
    level under its names, next to optimizer, lr_scheduler, dataloader and train_state) exports to exactly
    what torchtitan's Llama3StateDictAdapter.to_hf makes of the model (q and k rows back in Hugging Face's
    rotary order), bit for bit, and loads into transformers with nothing missing."""
    s = dcp_sources["torchtitan"]
    ref = torch.load(s.reference, weights_only=False)
    out = tmp_path / "hf"
    pyckpt.export_hf(s.dcp, out, from_torchtitan=True, config=s.config)
    _assert_same_tensors(_safetensors(out), ref["hf"])
    model = _load(out)
    for key, want in ref["hf"].items():
        assert _same(model.state_dict()[key], want), key

    cli = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "pyckpt", "export", str(s.dcp), str(cli), "--from-torchtitan",
                           "--config", str(s.config)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_tensors(_safetensors(cli), ref["hf"])


def test_deepspeed_to_torchtitan_and_back_equals_the_direct_export(tmp_path):
    """A round trip: a DeepSpeed ZeRO-2 Llama (the synthetic generator's, 4 query and 2 key/value heads)
    exported to torchtitan's layout (``export_dcp(torchtitan=True)``), then back with from_torchtitan, is
    the direct DeepSpeed -> Hugging Face export bit for bit."""
    import pyckpt.testing as mc
    from transformers import LlamaConfig

    tag = mc.make_checkpoint(tmp_path / "ck", dp=2, stage=2, family="llama", layers=2, hidden=32, heads=4,
                             kv_heads=2, vocab=64)
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False).save_pretrained(tmp_path / "config")
    shutil.copy(tmp_path / "config" / "config.json", tag.parent / "config.json")
    direct = tmp_path / "direct"
    pyckpt.export_hf(tag.parent, direct)
    tt = tmp_path / "tt"
    pyckpt.export_dcp(tag.parent, tt, torchtitan=True, initial_lr=0.01)
    back = tmp_path / "back"
    pyckpt.export_hf(tt, back, from_torchtitan=True, config=tmp_path / "config")
    _assert_same_tensors(_safetensors(back), _safetensors(direct))
    _load(back)
