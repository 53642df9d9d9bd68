"""A real client: models from ``transformers`` trained under DeepSpeed, exported by pyckpt, loaded back.

One torchrun launch (2 CPU ranks, tests/workers/hf_client_worker.py) trains tiny LlamaForCausalLM models
under ZeRO-2 and ZeRO-3 (fp32, bf16, tied embeddings) with ``engine.save_checkpoint``, one under
the Hugging Face ``Trainer``'s DeepSpeed integration, which writes ``checkpoint-N/``, and a
MixtralForCausalLM with AutoEP (experts split over 2 EP ranks, saved under AutoEP's own layer
names, exported under Mixtral's: the reference there is built with torch from the training ranks'
gathered experts, and the training model's own logits must match too); beside
each checkpoint lie the model config and a tokenizer built locally with ``tokenizers``. The export
must load with ``AutoModelForCausalLM.from_pretrained`` with nothing missing, unexpected or
mismatched, hold the training model's gathered weights bit for bit, and give its logits on a fixed
batch bit for bit (one thread on both sides).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyckpt

import hf_client_worker as worker  # tests/workers/, on sys.path through tests/conftest.py

HERE = Path(__file__).resolve().parents[1] / "workers"  # the worker scripts

# name -> job (the worker's fields); "export" is the dtype the test exports in.
JOBS = {
    "llama_z2_fp32": {"kind": "engine", "model": "llama", "stage": 2, "dtype": "fp32", "export": "fp32"},
    "llama_z3_fp32_tied": {"kind": "engine", "model": "llama", "stage": 3, "dtype": "fp32", "tie": True,
                           "export": "fp32"},
    "llama_z2_bf16": {"kind": "engine", "model": "llama", "stage": 2, "dtype": "bf16", "export": "bf16"},
    "llama_z3_bf16": {"kind": "engine", "model": "llama", "stage": 3, "dtype": "bf16", "export": "bf16"},
    "trainer_z2_fp32": {"kind": "trainer", "model": "llama", "stage": 2, "dtype": "fp32", "export": "fp32"},
    # The Trainer's own AdamW (decay and no-decay groups), tied embeddings: resumed by FSDP2 from a DCP export
    "trainer_z2_fp32_groups": {"kind": "trainer", "model": "llama", "stage": 2, "dtype": "fp32", "tie": True,
                               "hf_optimizer": True, "export": "fp32"},
    "trainer_z3_bf16_groups": {"kind": "trainer", "model": "llama", "stage": 3, "dtype": "bf16", "tie": True,
                               "hf_optimizer": True, "export": "bf16"},
    # AutoEP, 2 EP ranks x 2 experts: the export puts router and experts back under Mixtral's names
    "mixtral_autoep2_z2_fp32": {"kind": "engine", "model": "mixtral", "stage": 2, "dtype": "fp32", "autoep": 2,
                                "export": "fp32"},
}


@pytest.fixture(scope="session")
def hf_trained(ds_root, ds_environ) -> dict:
    """name -> folder of each trained model's save (the folder holding `latest`, or the Trainer's
    output_dir holding checkpoint-2/), with reference.pt written by the training ranks."""
    root = ds_root / "hf_client"
    root.mkdir()
    jobs = [dict(job, out=str(root / name)) for name, job in JOBS.items()]
    spec = root / "job.json"
    spec.write_text(json.dumps({"tokenizer": str(root / "tokenizer"), "jobs": jobs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "hf_client_worker.py"), str(spec)]
    proc = subprocess.run(cmd, env=ds_environ, cwd=str(root), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return {name: root / name for name in JOBS}


def _checkpoint(folder: Path, job: dict) -> Path:
    return folder / "checkpoint-2" if job["kind"] == "trainer" else folder


def _load(out: Path, caplog):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    finally:
        hf_logging.disable_propagation()
    complaints = [r.getMessage() for r in caplog.records
                  if any(w in r.getMessage().lower() for w in ("missing", "unexpected", "mismatch", "newly initialized"))]
    return model, info, complaints


@pytest.mark.parametrize("name", list(JOBS))
def test_export_loads_in_transformers_with_the_training_weights_and_logits(hf_trained, tmp_path, caplog, name):
    from transformers import AutoTokenizer

    job = JOBS[name]
    folder = hf_trained[name]
    ref = torch.load(folder / "reference.pt", weights_only=True)
    out = tmp_path / "hf"
    pyckpt.export_hf(_checkpoint(folder, job), out, dtype=job["export"])

    model, info, complaints = _load(out, caplog)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert complaints == []
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[job["export"]]
    assert model.dtype == want
    config = json.loads((out / "config.json").read_text())
    # the training config named no dtype (a float32 model to from_pretrained); a bf16 export says so
    assert config.get("dtype", "float32") == str(want).replace("torch.", "")

    state = model.state_dict()
    assert set(ref["state"]) <= set(state)
    bad = [k for k, v in ref["state"].items() if not torch.equal(v.to(want), state[k])]
    assert bad == []
    assert all(v.dtype == want for v in ref["state"].values() if v.is_floating_point())  # the training weights' dtype

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = worker.batch(tokenizer)
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits, ref["logits"])
    if "training_logits" in ref:  # AutoEP: the training model's own forward, all EP ranks together
        assert torch.equal(logits, ref["training_logits"])


def test_tied_embeddings_stay_tied_and_out_of_the_file(hf_trained, tmp_path):
    """save_pretrained leaves the tied lm_head out of safetensors; so does the export, and the
    loaded model shares one tensor between the two."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    pyckpt.export_hf(hf_trained["llama_z3_fp32_tied"], out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_command_line_export_of_the_trainers_checkpoint(hf_trained, tmp_path):
    """`python -m pyckpt.export checkpoint-2 OUT` on the Trainer's folder: weights, index-free single
    file, config, generation config and tokenizer, ready for from_pretrained."""
    folder = _checkpoint(hf_trained["trainer_z2_fp32"], JOBS["trainer_z2_fp32"])
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "pyckpt.export", str(folder), str(out)], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert proc.stderr.strip().splitlines()[-1].startswith("pyckpt: exported ")


def test_autoep_names_stay_without_a_config(hf_trained, tmp_path):
    """With no config.json beside the checkpoint the model type is unknown: the AutoEP layers keep
    their own names, and the dry run says so."""
    import shutil
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_trained["mixtral_autoep2_z2_fp32"], folder)
    os.remove(folder / "config.json")
    report = pyckpt.export_hf(folder, tmp_path / "hf", dry_run=True)
    assert "AutoEP layers kept under their AutoEP names" in report.plan_text
    from safetensors import safe_open
    pyckpt.export_hf(folder, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.w1" in keys and "model.layers.0.mlp.experts.gate_up_proj" not in keys


def _universal_state(folder: Path, name: str, state: str, shape) -> torch.Tensor:
    """A state of ``name`` from pyckpt's Universal Checkpoint (bit-equal to ds_to_universal's, tested
    elsewhere), in the parameter's shape."""
    obj = torch.load(folder / "zero" / name / f"{state}.pt", weights_only=True)
    t = obj["param"] if isinstance(obj, dict) else obj
    return t.reshape(shape)


def _universal_step(folder: Path, name: str) -> torch.Tensor:
    """The Adam step of ``name``: its step.pt, or where a ZeRO-3 universal folder keeps none (DeepSpeed
    writes none there), the 2 steps every harness Trainer run takes."""
    path = folder / "zero" / name / "step.pt"
    return torch.load(path, weights_only=True).float() if path.exists() else torch.tensor(2.0)


def _one_process_losses(model, opt, ids: torch.Tensor, steps: int) -> list:
    """The losses of ``steps`` more steps of the same training in this one process, on the same batch."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", ["trainer_z2_fp32_groups", "trainer_z3_bf16_groups"])
def test_fsdp2_resumes_the_trainers_run_from_its_dcp_export(hf_trained, ds_environ, tmp_path, name):
    """The Trainer's checkpoint-2/ (ZeRO-2 fp32 or ZeRO-3 bf16, tied embeddings, the Trainer's own AdamW
    with its decay and no-decay groups) exported with --format dcp, then loaded by a real FSDP2 job on 3
    ranks (the same LlamaForCausalLM from the config beside it, each decoder layer and the whole model
    fully_shard()ed, torch AdamW with the Trainer's groups; dcp.load + set_state_dict): every full
    parameter and AdamW state equals the Universal Checkpoint's fp32/exp_avg/exp_avg_sq/step bit for bit,
    the embeddings stay tied, the groups keep the Trainer's members and hyper-parameters, and three more
    steps give the losses of the same training continued in one process from the universal state (to
    1e-6 relative: FSDP averages the ranks' equal gradients, which may round differently)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer

    ckpt = hf_trained[name] / "checkpoint-2"
    export, universal = tmp_path / "dcp", tmp_path / "universal"
    pyckpt.export_dcp(ckpt, export)
    pyckpt.convert_to_universal(ckpt, universal, inject_missing_state=True)  # the Trainer saves without it
    ids = worker.batch(AutoTokenizer.from_pretrained(str(ckpt)))
    torch.save(ids, tmp_path / "batch.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           str(HERE / "dcp_hf_fsdp_worker.py"), str(ckpt), str(export), str(tmp_path / "batch.pt"),
           str(tmp_path / "loaded.pt")]
    proc = subprocess.run(cmd, env={**ds_environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert got["tied"]
    for n, p in got["params"].items():
        assert _bits_equal(p, _universal_state(universal, n, "fp32", p.shape)), n
    assert sorted(got["state"]) == sorted(got["params"])
    for n, state in got["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _bits_equal(state[key], _universal_state(universal, n, key, state[key].shape)), (n, key)
        assert _bits_equal(state["step"], _universal_step(universal, n)), n

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(ckpt)), dtype=torch.float32)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters()]
    assert got["group_names"] == [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]
    for group, wd in zip(got["groups"], (0.1, 0.0)):
        assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (1e-2, wd, (0.9, 0.999), 1e-8)
        assert group["decoupled_weight_decay"] is True  # torch AdamW, as the Trainer made it

    with torch.no_grad():
        for n, p in named:
            p.copy_(_universal_state(universal, n, "fp32", p.shape))
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                             {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=1e-2)
    for n, p in named:
        opt.state[p] = {"step": _universal_step(universal, n).clone(),
                        "exp_avg": _universal_state(universal, n, "exp_avg", p.shape).clone(),
                        "exp_avg_sq": _universal_state(universal, n, "exp_avg_sq", p.shape).clone()}
    plain = _one_process_losses(model, opt, ids, len(got["losses"]))
    assert got["losses"] == pytest.approx(plain, rel=1e-6), (got["losses"], plain)


def test_fsdp2_resumes_the_autoep_mixtral_from_its_dcp_export_under_its_own_names(hf_trained, ds_environ, tmp_path):
    """The AutoEP Mixtral (experts over 2 EP ranks, ZeRO-2) exported with --format dcp --hf-names, then
    loaded by a real FSDP2 job on 3 ranks building transformers' MixtralForCausalLM from the config beside
    it, with torch AdamW in DeepSpeed's two groups (dense, experts): every full parameter and AdamW state
    equals the Universal Checkpoint's, renamed as transformers names them (router mlp.gate; gate_up_proj =
    each expert's w1 rows then w3 rows; down_proj = w2), bit for bit; the groups keep DeepSpeed's members
    and hyper-parameters; three more steps give the losses of the same training continued in one process
    (to 1e-6 relative, as above). A Universal Checkpoint input exports to the same entries."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = hf_trained["mixtral_autoep2_z2_fp32"]
    export, universal = tmp_path / "dcp", tmp_path / "universal"
    pyckpt.export_dcp(folder, export, hf_names=True)
    pyckpt.convert_to_universal(folder, universal)
    ids = worker.batch(AutoTokenizer.from_pretrained(str(folder)))
    torch.save(ids, tmp_path / "batch.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           str(HERE / "dcp_hf_fsdp_worker.py"), str(folder), str(export), str(tmp_path / "batch.pt"),
           str(tmp_path / "loaded.pt"), "--groups", "experts"]
    proc = subprocess.run(cmd, env={**ds_environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "loaded.pt", weights_only=False)

    def universal_states(key: str) -> dict:
        held = {}
        for d in sorted((universal / "zero").iterdir()):
            if (d / "exp_avg.pt").exists():  # a trainable parameter (AutoEP's second router name has fp32 only)
                obj = torch.load(d / f"{key}.pt", weights_only=True)
                held[d.name] = obj["param"] if isinstance(obj, dict) else obj
        if key == "step":  # one number per parameter: gate_up_proj's is w1's, which must be w3's
            for n in [n for n in held if n.endswith(".experts.w1")]:
                assert torch.equal(held[n], held[n[:-2] + "w3"]), n
            held = {n: t.reshape(1, 1) for n, t in held.items()}
            return {n: t[0, 0] for n, t in worker.mixtral_names(held).items()}
        return worker.mixtral_names(held)

    fp32 = universal_states("fp32")
    assert sorted(got["params"]) == sorted(fp32)
    assert any(n.endswith(".experts.gate_up_proj") for n in fp32)
    for n, p in got["params"].items():
        assert _bits_equal(p, fp32[n].reshape(p.shape)), n
    moments = {key: universal_states(key) for key in ("exp_avg", "exp_avg_sq")}
    steps = {n: t.float() for n, t in universal_states("step").items()}
    assert sorted(got["state"]) == sorted(fp32)
    for n, state in got["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert _bits_equal(state[key], moments[key][n].reshape(state[key].shape)), (n, key)
        assert _bits_equal(state["step"], steps[n]), n
    assert got["group_names"][1] == [n for n in got["params"] if ".experts." in n]
    assert got["group_names"][0] == [n for n in got["params"] if ".experts." not in n]
    for group in got["groups"]:
        # DeepSpeed's torch AdamW (Adam with adam_w_mode, its default): torch's default weight decay
        assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (1e-2, 1e-2, (0.9, 0.999), 1e-8)
        assert group["decoupled_weight_decay"] is True

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.float32)
    named = list(model.named_parameters())
    with torch.no_grad():
        for n, p in named:
            p.copy_(fp32[n].reshape(p.shape))
    opt = torch.optim.AdamW([{"params": [p for n, p in named if ".experts." not in n]},
                             {"params": [p for n, p in named if ".experts." in n]}], lr=1e-2, weight_decay=1e-2)
    for n, p in named:
        opt.state[p] = {"step": steps[n].clone(), "exp_avg": moments["exp_avg"][n].reshape(p.shape).clone(),
                        "exp_avg_sq": moments["exp_avg_sq"][n].reshape(p.shape).clone()}
    plain = _one_process_losses(model, opt, ids, len(got["losses"]))
    assert got["losses"] == pytest.approx(plain, rel=1e-6), (got["losses"], plain)

    again = tmp_path / "from_universal"
    shutil.copy(folder / "config.json", universal / "config.json")  # the config the names come from
    pyckpt.export_dcp(universal, again, hf_names=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(export, tmp_path / "a.pt")
    dcp_to_torch_save(again, tmp_path / "b.pt")
    a, b = torch.load(tmp_path / "a.pt", weights_only=False), torch.load(tmp_path / "b.pt", weights_only=False)
    assert sorted(a["model"]) == sorted(b["model"]) and sorted(a["optim"]["state"]) == sorted(b["optim"]["state"])
    for n in a["model"]:
        assert _bits_equal(a["model"][n], b["model"][n]), n
    for n, state in a["optim"]["state"].items():
        for key, t in state.items():
            assert _bits_equal(t, b["optim"]["state"][n][key]), (n, key)


@pytest.mark.parametrize("name", ["trainer_z2_fp32_groups", "trainer_z3_bf16_groups"])
def test_torchtitans_llama3_resumes_the_trainers_run_from_its_torchtitan_export(hf_trained, ds_environ, tmp_path,
                                                                              name):
    """The Trainer's checkpoint-2/ (ZeRO-2 fp32 / ZeRO-3 bf16, tied embeddings, its decay and no-decay
    groups) exported with --torchtitan, loaded as torchtitan's checkpointer loads into torchtitan 0.3.0's
    own Llama3 model (its names, fused wqkv) and torch AdamW in the same two groups with torchtitan's
    LambdaLR made first (tests/workers/torchtitan_worker.py): every parameter and Adam moment is bit-equal to
    torchtitan's own conversion (its state-dict adapter's from_hf) of the Universal Checkpoint's, the
    steps are DeepSpeed's, the groups keep the Trainer's hyper-parameters and its scheduler's initial_lr
    (or the one given), the
    logits equal the Hugging Face model's with the same weights (to 1e-5: torchtitan's attention and
    rotary code round differently), and an AdamW step runs on the loaded state (its gradients set by
    hand: torch 2.13 has no CPU backward for FlexAttention, the attention torchtitan's Llama3 builds)."""
    ckpt = hf_trained[name] / "checkpoint-2"
    export, universal = tmp_path / "dcp", tmp_path / "universal"
    # The Trainer's LR scheduler left initial_lr in its groups; a given one replaces it.
    initial_lr = {"trainer_z2_fp32_groups": None, "trainer_z3_bf16_groups": 3e-3}[name]
    pyckpt.export_dcp(ckpt, export, torchtitan=True, initial_lr=initial_lr)
    pyckpt.convert_to_universal(ckpt, universal, inject_missing_state=True)
    from transformers import AutoTokenizer
    torch.save(worker.batch(AutoTokenizer.from_pretrained(str(ckpt))), tmp_path / "batch.pt")
    cmd = [sys.executable, str(HERE / "torchtitan_worker.py"), str(ckpt), str(export), str(universal),
           str(tmp_path / "batch.pt"), str(tmp_path / "loaded.pt")]
    proc = subprocess.run(cmd, env={**ds_environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert got["ok"] and all(got["ok"].values()), [k for k, v in got["ok"].items() if not v]
    assert any(k.endswith("qkv_linear.wqkv.weight") for k in got["ok"])
    some = next(p for p in (universal / "zero").iterdir())
    assert set(got["steps"].values()) == {float(_universal_step(universal, some.name))}
    assert got["group_sizes"][0] == got["decay_count"] and got["group_sizes"][1] > 0
    for group, wd in zip(got["groups"], (0.1, 0.0)):
        assert (group["lr"], group["weight_decay"], group["betas"], group["eps"], group["initial_lr"]) == \
            (1e-2, wd, (0.9, 0.999), 1e-8, initial_lr or 1e-2)
    assert torch.allclose(got["tt_logits"], got["hf_logits"], atol=1e-5, rtol=0), \
        (got["tt_logits"] - got["hf_logits"]).abs().max()
    assert got["moved"] and set(got["steps_after"].values()) == {float(_universal_step(universal, some.name)) + 1}


def test_torchtitan_export_asks_for_initial_lr_where_the_groups_lack_it(hf_trained, tmp_path):
    """torchtitan's load asks every param group for initial_lr (its LR scheduler put one in before the
    load): a DeepSpeed run without a torch LR scheduler saved none, so the export asks for it, before
    anything is written; given, every group has it."""
    root = hf_trained["llama_z2_fp32"]
    out = tmp_path / "dcp"
    with pytest.raises(pyckpt.UnsupportedCheckpointError, match="pass initial_lr"):
        pyckpt.export_dcp(root, out, torchtitan=True)
    assert not out.exists()
    pyckpt.export_dcp(root, out, torchtitan=True, initial_lr=0.5)
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    lrs = [k for k in meta if k.startswith("optimizer.param_groups.") and k.endswith(".initial_lr")]
    assert lrs and "optimizer.param_groups.layers.0.attention.qkv_linear.wqkv.weight.initial_lr" in lrs
    assert "layers.0.attention.qkv_linear.wq.weight" in meta and "tok_embeddings.weight" in meta
    assert not any(k.startswith(("model.", "optim.")) or "q_proj" in k for k in meta)
    from pyckpt.dcp.verify import verify_dcp
    report = verify_dcp(out, against=root)
    assert report.ok, report.problems
