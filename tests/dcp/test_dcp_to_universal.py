"""An FSDP2 job moves to DeepSpeed: its DCP checkpoint (torch AdamW, two param groups) converted by
``pyckpt convert DCP OUT`` into a Universal Checkpoint that DeepSpeed 0.19.8's ``load_universal`` resumes at
another world size and ZeRO stage. At load every fp32 master, Adam moment and group hyper-parameter equals
the FSDP2 job's bit for bit; the losses of the next steps follow the FSDP2 job's own continuation to the spread
two Adam implementations show between themselves (measured here against plain single-process torch AdamW
continuing from the same state)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = "ds_from_dcp_worker.py"


def _convert(src, out):
    proc = subprocess.run([sys.executable, "-m", "pyckpt", "convert", str(src.dcp), str(out)], cwd=out.parent.parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "converted the DCP checkpoint" in proc.stdout + proc.stderr


def _plain_losses(src, ref) -> list:
    """Three steps of single-process torch AdamW from the FSDP2 job's saved state: one more Adam
    implementation's continuation, to size the spread the comparison allows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_from_dcp_worker import groups

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src.config), dtype=torch.float32)
    model.load_state_dict(ref["model"], strict=False)  # a tied lm_head is the embedding
    opt = torch.optim.AdamW(groups(model, 1e-2))
    index = {n: i for i, (n, p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad)}
    saved = ref["optim"]
    opt.load_state_dict({"state": {index[n]: s for n, s in saved["state"].items()},
                         "param_groups": [dict(g, params=[index[n] for n in g["params"]])
                                          for g in saved["param_groups"]]})
    model.train()
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(input_ids=ref["ids"], labels=ref["ids"]).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("case,world,stage,dtype,loader", [
    ("llama_fsdp", 3, 2, "fp32", "deepspeed"),        # FSDP2 on 2 ranks -> ZeRO-2 on 3
    # 3 -> ZeRO-3 on 2, tied embeddings, through pyckpt's load backend: DeepSpeed 0.19.8's own ZeRO-3 universal
    # load gives every param group group 0's hyper-parameters (checked below where it is the loader)
    ("llama_tied_fsdp", 2, 3, "fp32", "pyckpt"),
    ("llama_tied_fsdp", 2, 1, "bf16", "deepspeed"),   # 3 -> ZeRO-1 bf16 on 2 (fp32 masters)
])
def test_fsdp2_job_resumes_in_deepspeed(dcp_sources, tmp_path, case, world, stage, dtype, loader):
    import dcp_sources as sources

    src = dcp_sources[case]
    out = tmp_path / "ckpt" / "step2_universal"
    out.parent.mkdir(parents=True)
    _convert(src, out)
    assert (out.parent / "latest_universal").read_text() == "step2_universal"
    result = tmp_path / "loaded.pt"
    sources.torchrun(sources.WORKERS / WORKER, world,
                     [out.parent, src.reference, src.config, result, "--stage", stage, "--dtype", dtype,
                      "--loader", loader],
                     cwd=tmp_path / "run")
    got = torch.load(result, weights_only=False)
    ref = torch.load(src.reference, weights_only=False)
    state = ref["optim"]["state"]
    names = list(got["loaded"]["fp32"])
    assert names and set(names) <= set(ref["model"])
    for name in names:
        assert torch.equal(got["loaded"]["fp32"][name], ref["model"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["loaded"][key][name], state[name][key]), (name, key)
    saved_groups = ref["optim"]["param_groups"]
    assert len(got["groups"]) == len(saved_groups) == 2
    zero3_rule = stage == 3 and loader == "deepspeed"
    for mine, theirs in zip(got["groups"], saved_groups):
        # DeepSpeed 0.19.8's own ZeRO-3 universal load gives every group group 0's hyper-parameters
        # (stage3.py _load_universal_checkpoint); pyckpt's backend gives each its own
        theirs = saved_groups[0] if zero3_rule else theirs
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert mine[key] == theirs[key], key
    fsdp, ds = ref["losses"], got["losses"]
    if zero3_rule:
        assert ds[0] == fsdp[0]  # the loaded weights; the later steps decay the norms, as that rule says
        return
    plain = _plain_losses(src, ref)
    if dtype == "fp32":
        # the same weights through the same fp32 forward: the first loss is the FSDP2 job's exactly
        assert ds[0] == fsdp[0] == plain[0]
    else:
        assert abs(ds[0] - fsdp[0]) < 0.05 * abs(fsdp[0])  # a bf16 forward of the same weights
    spread = max(abs(f - p) for f, p in zip(fsdp, plain))
    for d, f in zip(ds[1:], fsdp[1:]):
        assert abs(d - f) <= 2 * spread + 1e-3 * abs(f), (ds, fsdp, plain)


def test_convert_refuses_non_adam_state(dcp_sources, tmp_path):
    """A DCP checkpoint whose optimizer is not Adam-shaped: one error, nothing written."""
    import shutil

    import dcp_sources as sources  # noqa: F401  (the fixture's module)
    from pyckpt.dcp.to_universal import convert_dcp_to_universal
    from pyckpt.errors import UnsupportedCheckpointError

    src = dcp_sources["llama_hf_writer"]  # model entries only: no optimizer state at all
    out = tmp_path / "u" / "x_universal"
    out.parent.mkdir()
    with pytest.raises(UnsupportedCheckpointError, match="no optimizer state"):
        convert_dcp_to_universal(src.dcp, out)
    assert not out.exists() and sorted(p.name for p in out.parent.iterdir()) == []
    shutil.rmtree(out.parent)
