"""Export to torch.distributed.checkpoint (issue 25): real DeepSpeed checkpoints exported with their Adam
state, read back by torch's own DCP readers (``dcp_to_torch_save``) and loaded by real FSDP2 jobs at
another world size (``dcp.load`` + ``set_state_dict`` into ``fully_shard``ed modules and torch Adam),
which then train on from where DeepSpeed stopped."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsharness import models

import pyckpt
from edit import copy_checkpoint, rewrite
from pyckpt.dcp.layout import chunk_tensor, narrow_bytes
from pyckpt.errors import CheckpointFormatError, UnsafePickleError
from pyckpt.formats.pickle_read import GlobalName
from pyckpt.planning.plan import Piece
from pyckpt.tensors import NewTensor

WORKER = Path(__file__).resolve().parents[1] / "workers" / "dcp_fsdp_worker.py"
TIMEOUT_S = 300

# The suite's checkpoints read back here: every stage, bf16 masters, BF16_Optimizer, tied and frozen
# parameters with buffers, ZeRO-3 sub-groups.
SUITE = ["s1_fp32_dp2", "s2_bf16_dp2", "s3_fp32_dp2_subgroups", "s3_bf16_dp3", "s2_bf16_frozen_tied",
         "s3_frozen_tied", "s1_bf16_dp2_bf16_optimizer", "s2_fp32_dp2_no_uc_info", "s3_fp32_dp3_no_uc_info",
         # AutoTP (tp 2 x dp 2): the full logical tensors; AutoEP: every expert as one [E, ...] tensor
         "tp_s2_bf16", "tp_s3_fp32", "ep_s1_fp32", "ep_s2_bf16", "ep_s3_fp32",
         # two param groups with their own hyper-parameters (conftest.GROUPED)
         "z2_groups_dp2", "z3_groups_dp3"]
# AutoEP's per-layer token counter, registered persistent=False (deepspeed/module_inject/auto_ep_layer.py)
NON_PERSISTENT = ("tokens_per_expert",)


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


def _read_back(out: Path, tmp_path: Path) -> dict:
    """The export as torch's own converter rebuilds it (every entry, nested by the metadata's paths)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    target = tmp_path / "read_back.pt"
    dcp_to_torch_save(out, target)
    return torch.load(target, weights_only=False)


def _expected_groups(ck) -> list:
    """DeepSpeed's groups in the harness: the config's Adam (lr 1e-2) and, under Config.groups, the biases
    with models.BIAS_GROUP; AutoEP's experts in a second group of the same settings."""
    base = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    names = [n for n in ck.reference["param_names"] if n not in ck.reference["frozen"]]
    if ck.config.model == "moe":  # AutoEP keeps the experts in a param group of their own
        experts = set(ck.reference["meta"]["expert_params"])
        return [(base, [n for n in names if n not in experts]), (base, [n for n in names if n in experts])]
    if not ck.config.groups:
        return [(base, names)]
    return [(base, [n for n in names if not n.endswith(".bias")]),
            ({**base, **models.BIAS_GROUP}, [n for n in names if n.endswith(".bias")])]


def _check_against_reference(ck, got: dict) -> None:
    ref = ck.reference
    model, optim = got["model"], got["optim"]
    for name, want in ref["fp32"].items():
        assert _same(model[name], want), name
    for name, want in ref["buffers"].items():
        if name.rsplit(".", 1)[-1] in NON_PERSISTENT:
            assert name not in model, name  # as in any state dict
            continue
        assert _same(model[name], want), name
    trainable = [n for n in ref["param_names"] if n not in ref["frozen"]]
    assert sorted(optim["state"]) == sorted(trainable)
    for name in trainable:
        state = optim["state"][name]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], name
        assert _same(state["exp_avg"], ref["exp_avg"][name]), name
        assert _same(state["exp_avg_sq"], ref["exp_avg_sq"][name]), name
        assert state["step"].dtype == torch.float32 and state["step"].shape == () and float(state["step"]) == ref["step"]
    groups = optim["param_groups"]
    assert len(groups) == len(_expected_groups(ck))
    for group, (hyper, names) in zip(groups, _expected_groups(ck)):
        assert group["params"] == names
        for key, value in hyper.items():
            assert group[key] == value, (key, group[key], value)
        # torch Adam's own keys, as DeepSpeed's torch Adam kept them (adam_w_mode off: L2 weight decay)
        assert group["decoupled_weight_decay"] is False and group["amsgrad"] is False


@pytest.mark.parametrize("name", SUITE)
def test_torchs_own_reader_gives_the_training_state(checkpoints, tmp_path, name):
    """torch's dcp_to_torch_save reads the export into {"model", "optim"}: every parameter (fp32 masters;
    frozen ones as saved, cast to fp32), buffer, tied alias, Adam moment and step is the DeepSpeed run's
    own at save time, bit for bit, and the param groups are DeepSpeed's."""
    ck = checkpoints[name]
    out = tmp_path / "dcp"
    report = pyckpt.export_dcp(ck.root, out)
    data = sorted(f"__{i}_0.distcp" for i in range(report.files - 2))
    assert sorted(os.listdir(out)) == [".metadata", ".pyckpt-export.json"] + data
    got = _read_back(out, tmp_path)
    assert sorted(got) == ["model", "optim"]
    _check_against_reference(ck, got)
    if name.endswith("frozen_tied"):
        assert _same(got["model"]["out.weight"], got["model"]["emb.weight"])  # the tied alias, by its own name


@pytest.mark.parametrize("name", ["s2_bf16_frozen_tied", "z3_groups_dp3"])
def test_universal_checkpoint_exports_to_the_same_entries(checkpoints, tmp_path, name):
    """A Universal Checkpoint (pyckpt's conversion, bit-equal to ds_to_universal's) exports to what its
    ZeRO checkpoint exports to."""
    a, b = tmp_path / "zero", tmp_path / "universal"
    pyckpt.export_dcp(checkpoints[name].root, a)
    pyckpt.convert_to_universal(checkpoints[name].root, tmp_path / "u")
    pyckpt.export_dcp(tmp_path / "u", b)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    x, y = _read_back(a, tmp_path / "a"), _read_back(b, tmp_path / "b")
    _check_against_reference(checkpoints[name], y)
    assert sorted(x["model"]) == sorted(y["model"]) and sorted(x["optim"]["state"]) == sorted(y["optim"]["state"])


def _mixtral_names(state: dict) -> dict:
    """AutoEP names -> transformers' Mixtral names, built with torch (the inverse of DeepSpeed's
    moe/ep_repack.py, gate_up_first): the router is mlp.gate, gate_up_proj is each expert's w1 rows then
    its w3 rows, down_proj is w2; AutoEP's second name of the router (gate.gate) is left out."""
    out = {}
    for name, t in state.items():
        if name.endswith(".gate.gate.weight"):
            continue
        if name.endswith(".router.gate.weight"):
            out[name.replace(".router.gate.weight", ".gate.weight")] = t
        elif name.endswith(".experts.w1"):
            out[name[:-2] + "gate_up_proj"] = torch.cat([t, state[name[:-2] + "w3"]], dim=1)
        elif name.endswith(".experts.w2"):
            out[name[:-2] + "down_proj"] = t
        elif not name.endswith(".experts.w3"):
            out[name] = t
    return out


@pytest.mark.parametrize("name", ["ep_s1_fp32", "ep_s3_fp32"])
def test_hf_names_put_autoep_layers_and_their_adam_state_under_mixtrals_names(checkpoints, tmp_path, name):
    """hf_names with a Mixtral config beside the checkpoint: the routers and experts, their moments and steps
    and the experts' param group, under transformers' Mixtral names (router mlp.gate, experts gate_up_proj
    = w1 rows then w3 rows per expert, down_proj = w2), bit for bit the training state's; without a config
    (the suite's MoE has none) hf_names is refused, naming why."""
    ck = checkpoints[name]
    with pytest.raises(pyckpt.UnsupportedCheckpointError, match="no config.json beside the checkpoint"):
        pyckpt.export_dcp(ck.root, tmp_path / "refused", hf_names=True)
    assert not (tmp_path / "refused").exists()
    root = tmp_path / "ckpt"
    shutil.copytree(ck.root, root)
    (root / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    pyckpt.export_dcp(root, tmp_path / "dcp", hf_names=True)
    got = _read_back(tmp_path / "dcp", tmp_path)
    ref = ck.reference
    model, optim = got["model"], got["optim"]
    fp32 = _mixtral_names(ref["fp32"])
    buffers = {n for n in ref["buffers"] if n.rsplit(".", 1)[-1] not in NON_PERSISTENT}
    assert set(model) == set(fp32) | buffers
    for n, want in fp32.items():
        assert _same(model[n], want), n
    assert any(n.endswith(".experts.gate_up_proj") for n in model)
    assert not any(".experts.w" in n or ".router." in n for n in model)
    for key in ("exp_avg", "exp_avg_sq"):
        want = _mixtral_names(ref[key])
        assert sorted(optim["state"]) == sorted(want)
        for n, t in want.items():
            assert _same(optim["state"][n][key], t), (n, key)
    assert all(float(s["step"]) == ref["step"] for s in optim["state"].values())
    trainable = list(_mixtral_names(ref["exp_avg"]))
    experts = [n for n in trainable if ".experts." in n]
    dense = [n for n in trainable if ".experts." not in n]
    groups = optim["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(dense), sorted(experts)]
    from pyckpt.dcp.verify import verify_dcp
    assert verify_dcp(tmp_path / "dcp", against=root).ok


@pytest.mark.parametrize("config", ["outside", "proc", "model_type_list", "not_json"])
def test_hf_names_reads_a_hostile_config_beside_the_checkpoint_as_an_error(checkpoints, tmp_path, config):
    """--hf-names reads the config.json beside the checkpoint: one that links out of the checkpoint (to a
    secret, or to /proc) is refused, not followed; a model_type that is not a name, or a file that is not
    JSON, is one error naming the file or why; nothing is written and the checkpoint is unchanged."""
    from compare import digest
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoints["ep_s2_bf16"].root, root)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"model_type": "mixtral", "token": "s3cr3t"}))
    _plant_config(root / "config.json", secret, config, {"model_type": ["mixtral"]})
    before = digest(root)
    with pytest.raises(pyckpt.PyckptError) as err:
        pyckpt.export_dcp(root, tmp_path / "out", hf_names=True)
    message = str(err.value)
    assert "s3cr3t" not in message and "\n" not in message
    assert {"outside": "config.json", "proc": "config.json", "model_type_list": "has no mapping",
            "not_json": "config.json"}[config] in message, message
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["ckpt", "secret.json"]
    assert digest(root) == before


def _plant_config(target: Path, secret: Path, config: str, values: dict) -> None:
    """A config.json beside a checkpoint: a link to ``secret`` outside it ("outside"), to /proc
    ("proc"), bytes that are not JSON ("not_json"), or ``values``."""
    if config == "outside":
        target.symlink_to(secret)
    elif config == "proc":
        target.symlink_to("/proc/self/environ")
    elif config == "not_json":
        target.write_bytes(b"\x80not json")
    else:
        target.write_text(json.dumps(values))


@pytest.mark.parametrize("field,value", [("optim_layout", "sideways"), ("hf_names", "yes"), ("torchtitan", "yes"),
                                         ("initial_lr", "0.1")])
def test_verify_refuses_an_export_record_with_an_unknown_layout_or_naming(checkpoints, tmp_path, field, value):
    """The options verify plans again from are read from the folder under check: a value no export writes is
    a VerifyInputError naming the field, before anything is planned."""
    from pyckpt.dcp.verify import verify_dcp
    from pyckpt.errors import VerifyInputError
    out = tmp_path / "dcp"
    pyckpt.export_dcp(checkpoints["s1_fp32_dp2"].root, out)
    record = out / ".pyckpt-export.json"
    record.write_text(json.dumps(dict(json.loads(record.read_text()), **{field: value})))
    with pytest.raises(VerifyInputError, match=f"field {field}"):
        verify_dcp(out, against=checkpoints["s1_fp32_dp2"].root)


@pytest.mark.parametrize("edit,rule", [
    (lambda text: text.replace('"initial_lr": null', '"initial_lr": NaN'), "NaN is not a JSON number"),
    (lambda text: text.replace('"initial_lr": null', '"initial_lr": 1e999'), "beyond a float's range"),
    (lambda text: text.replace('"chunk_bytes": ', '"chunk_bytes": 1, "chunk_bytes": '), "appears twice"),
    (lambda text: text.replace('"data_files": ', '"data_files": ' + "9" * 100_000 + ', "x": '), "100000 digits"),
    (lambda text: "[" * 100_000 + text + "]" * 100_000, "nested deeper"),
    (lambda text: f"[{text}]", "must be a JSON object"),
], ids=["nan", "1e999", "duplicate", "long-integer", "deep", "array"])
def test_verify_reads_a_hostile_export_record_as_one_error_naming_it(tmp_path, edit, rule):
    """The export record lies in the folder under check, as hostile as a checkpoint: what Python's
    json would take (NaN, 1e999 as infinity, a repeated key), refuse naming no file (deep nesting) or
    stop on (a 100,000-digit integer) is a VerifyInputError naming the record and the rule."""
    import pyckpt.testing as mc
    from pyckpt.dcp.verify import verify_dcp
    from pyckpt.errors import VerifyInputError

    root = mc.make_checkpoint(tmp_path / "ck", params=20000, dp=2, stage=2).parent
    out = tmp_path / "dcp"
    pyckpt.export_dcp(root, out)
    record = out / ".pyckpt-export.json"
    text = record.read_text()
    assert edit(text) != text
    record.write_text(edit(text))
    with pytest.raises(VerifyInputError) as ei:
        verify_dcp(out, against=root)
    message = str(ei.value)
    assert message.startswith(f"{record}: ") and rule in message and "\n" not in message, message


@pytest.mark.parametrize("flags", [["--hf-names"], ["--optim-layout", "flat"], ["--torchtitan"],
                                   ["--initial-lr", "0.1"]])
def test_dcp_options_are_refused_without_format_dcp(tmp_path, flags):
    """--hf-names (the Hugging Face export always writes the names it knows) and --optim-layout without
    --format dcp are a usage error (exit 2), before any input is read."""
    proc = subprocess.run([sys.executable, "-m", "pyckpt.export", str(tmp_path / "absent"), str(tmp_path / "out")]
                          + flags, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2 and "are for --format dcp" in proc.stderr and flags[0] in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_model_dtype_and_layout_keys_are_the_users_choice(checkpoints, tmp_path, dtype):
    """--dtype casts the model's floating entries (Adam state stays fp32, integer buffers keep theirs);
    model_key "" puts the model at the top level; optimizer=False leaves the optimizer out."""
    ck = checkpoints["s2_bf16_frozen_tied"]
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    out = tmp_path / "flat"
    pyckpt.export_dcp(ck.root, out, dtype=dtype, model_key="", optim_key="optimizer")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got = _read_back(out, tmp_path / "a")
    assert "optimizer" in got and "emb.weight" in got and "model" not in got
    assert _same(got["emb.weight"], ck.reference["fp32"]["emb.weight"].to(want))
    assert got["counter"].dtype == torch.int64
    assert got["optimizer"]["state"]["emb.weight"]["exp_avg"].dtype == torch.float32
    pyckpt.export_dcp(ck.root, tmp_path / "model_only", optimizer=False)
    assert sorted(_read_back(tmp_path / "model_only", tmp_path / "b")) == ["model"]


def test_the_flat_optimizer_layout_keys_each_parameters_group_values_by_its_name(checkpoints, tmp_path):
    """optim_layout="flat" writes what get_state_dict(..., flatten_optimizer_state_dict=True) holds:
    param_groups.<name>.<key> for every parameter of a group (values of its group), no group indices or
    member lists; the state entries are the nested layout's; verify re-plans it."""
    from torch.distributed.checkpoint import FileSystemReader
    from pyckpt.dcp.verify import verify_dcp
    ck = checkpoints["z2_groups_dp2"]
    out = tmp_path / "dcp"
    pyckpt.export_dcp(ck.root, out, model_key="", optim_key="optimizer", optim_layout="flat")
    keys = set(FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    groups = _expected_groups(ck)
    for hyper, names in groups:
        for n in names:
            assert {f"optimizer.param_groups.{n}.{k}" for k in hyper} <= keys, n
            assert f"optimizer.state.{n}.exp_avg" in keys
    assert not any(k.startswith("optimizer.param_groups.0") or k.endswith(".params") for k in keys)
    got = _read_back(out, tmp_path)
    bias = next(n for n in groups[1][1])
    assert got["optimizer"]["param_groups"][bias]["weight_decay"] == models.BIAS_GROUP["weight_decay"]
    assert verify_dcp(out, against=ck.root).ok


def test_tensors_are_cut_into_row_chunks_that_dcp_reassembles(checkpoints, tmp_path):
    """A tiny chunk size cuts every tensor along its first dimension; the metadata lists the chunks and
    torch reassembles the same tensors from them."""
    from torch.distributed.checkpoint import FileSystemReader
    ck = checkpoints["s3_frozen_tied"]
    out = tmp_path / "dcp"
    pyckpt.export_dcp(ck.root, out, chunk_bytes=40)
    md = FileSystemReader(str(out)).read_metadata()
    chunks = md.state_dict_metadata["model.emb.weight"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (2, 0), (4, 0), (6, 0), (8, 0), (10, 0), (12, 0)]
    assert [tuple(c.sizes) for c in chunks] == [(2, 5)] * 6 + [(1, 5)]
    _check_against_reference(ck, _read_back(out, tmp_path))


def _fsdp_jobs(jobs: list, world: int, env: dict, cwd: Path) -> None:
    spec = cwd / "jobs.json"
    spec.write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(WORKER),
           str(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _plain_continuation(ck, steps: int) -> list:
    """The same training continued in one process without any checkpoint format: the harness model
    given the reference masters, torch Adam given the reference moments and step."""
    ref = ck.reference
    model = models.build_model(ck.config.model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ref["fp32"][n])
        for n, b in model.named_buffers():
            b.copy_(ref["buffers"][n])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if ck.config.groups:
        groups = [{"params": [p for n, p in named if not n.endswith(".bias")]},
                  {"params": [p for n, p in named if n.endswith(".bias")], **models.BIAS_GROUP}]
    else:
        groups = [{"params": [p for _, p in named]}]
    opt = torch.optim.Adam(groups, lr=1e-2)
    for n, p in named:
        opt.state[p] = {"step": torch.tensor(ref["step"]), "exp_avg": ref["exp_avg"][n].clone(),
                        "exp_avg_sq": ref["exp_avg_sq"][n].clone()}
    losses = []
    for k in range(steps):
        opt.zero_grad()
        parts = [models.batch(ck.config.model, r, ck.config.steps + k, torch.float32) for r in range(2)]
        loss = model(*(torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# (checkpoint, layout): "flat" is torchtitan's checkpointer's (model at the top level, "optimizer" flattened)
FSDP_CASES = [("z2_groups_dp2", "nested"), ("z3_groups_dp3", "nested"), ("s2_bf16_frozen_tied", "nested"),
              ("z3_groups_dp3", "flat")]


@pytest.mark.slow
def test_fsdp2_jobs_at_another_world_size_resume_from_the_export(checkpoints, ds_environ, tmp_path):
    """Real FSDP2 jobs on 4 ranks (the checkpoints were saved at dp 2 and 3: ZeRO-2 and ZeRO-3 with two
    param groups, bf16 masters with tied and frozen parameters and buffers) load the export with dcp.load
    + set_state_dict: every full parameter, buffer, Adam moment and step equals the DeepSpeed run's bit for
    bit and the groups keep their members and hyper-parameters; the next steps' losses are those of the
    same training continued in one process from the reference state (to 1e-6 relative: FSDP averages the
    ranks' equal gradients, which may round differently from one process's gradient). The same holds for
    torchtitan's checkpointer layout (model_key "", optim_key "optimizer", optim_layout "flat", loaded with
    flatten_optimizer_state_dict=True). One launch runs the resumes one after the other."""
    jobs = []
    for name, layout in FSDP_CASES:
        ck = checkpoints[name]
        export = tmp_path / f"{name}-{layout}"
        keys = dict(model_key="", optim_key="optimizer") if layout == "flat" else {}
        pyckpt.export_dcp(ck.root, export, optim_layout=layout, **keys)
        jobs.append({"model": ck.config.model, "export": str(export), "out": str(tmp_path / f"{name}-{layout}.pt"),
                     "groups": ck.config.groups, "flat": layout == "flat"})
    env = {**ds_environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    _fsdp_jobs(jobs, 4, env, tmp_path)
    for name, layout in FSDP_CASES:
        ck = checkpoints[name]
        got = torch.load(tmp_path / f"{name}-{layout}.pt", weights_only=False)
        ref = ck.reference
        for n, p in got["params"].items():
            assert _same(p, ref["fp32"][n]), (name, n)
        for n, b in got["buffers"].items():
            assert _same(b, ref["buffers"][n]), (name, n)
        trainable = [n for n in ref["param_names"] if n not in ref["frozen"]]
        assert sorted(got["state"]) == sorted(trainable)
        for n in trainable:
            assert _same(got["state"][n]["exp_avg"], ref["exp_avg"][n]), (name, n)
            assert _same(got["state"][n]["exp_avg_sq"], ref["exp_avg_sq"][n]), (name, n)
            assert float(got["state"][n]["step"]) == ref["step"]
        for group, (hyper, names) in zip(got["groups"], _expected_groups(ck)):
            assert {k: group[k] for k in hyper} == hyper
        assert got["group_names"] == [names for _, names in _expected_groups(ck)]
        plain = _plain_continuation(ck, len(got["losses"]))
        assert got["losses"] == pytest.approx(plain, rel=1e-6), (name, got["losses"], plain)


# -- the chunk rules (no DeepSpeed) ---------------------------------------------------------------

class _Src:
    path = "src"


def test_narrowing_a_strided_piece_keeps_whole_rows():
    """A tensor [4, 6] float32 made of two column halves (strided pieces, as a TP merge along dim 1
    makes): rows 1..3 of it are rows 1..3 of each half."""
    src = _Src()
    t = NewTensor("float32", (4, 6), [Piece(src, 0, 12, 0, 0, 4, 24), Piece(src, 1000, 12, 12, 0, 4, 24)])
    part = narrow_bytes(t, 24, 48, (2, 6))
    assert [(p.src_off, p.nbytes, p.dst_off, p.rows, p.stride) for p in part.pieces] == [
        (12, 12, 0, 2, 24), (1012, 12, 12, 2, 24)]


def test_chunks_are_near_equal_runs_of_whole_rows():
    t = NewTensor("float32", (10, 3), [Piece(_Src(), 0, 120, 0)])
    chunks = chunk_tensor(t, 40)
    assert [c.offsets for c in chunks] == [(0, 0), (4, 0), (8, 0)]
    assert [c.sizes for c in chunks] == [(4, 3), (4, 3), (2, 3)]
    assert [(p.src_off, p.nbytes, p.dst_off) for c in chunks for p in c.tensor.pieces] == [(0, 48, 0), (48, 48, 0),
                                                                                          (96, 24, 0)]
    assert len(chunk_tensor(NewTensor("float32", (), data=b"\0" * 4))) == 1


# -- hostile input: what a DCP export reads beyond the other exports --------------------------------

def _first_optim_file(tag: Path) -> Path:
    return sorted(tag.glob("*optim_states.pt"))[0]


def _groups_of(obj):
    """The torch optimizer's param groups in a ZeRO-1/2 shard."""
    return obj["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]


@pytest.mark.parametrize("value,error,problem", [
    (GlobalName("os", "system"), UnsafePickleError, "refusing to load global 'os.system'"),
    (GlobalName("torch", "float32"), CheckpointFormatError, "holds 'lr' = a torch.float32"),
    (NewTensor("float32", (1,), data=b"\0" * 4), CheckpointFormatError, "holds 'lr' = a tensor"),
    ([[[[[1.0]]]]], CheckpointFormatError, "holds 'lr' = a list nested more than 4 levels deep"),
])
def test_param_group_values_that_are_not_plain_data_are_refused(checkpoints, tmp_path, value, error, problem):
    """dcp.load unpickles each hyper-parameter with torch.load(weights_only=False): a group value that
    is not plain data (an allowlisted global such as a dtype, a tensor, a deep nest) is refused, naming
    the checkpoint, and one that pyckpt's reader does not allow is never unpickled; nothing is written
    and the input is unchanged."""
    _, tag = copy_checkpoint(checkpoints["s2_fp32_dp3"].tag_dir, tmp_path)
    path = _first_optim_file(tag)

    def edit(obj):
        _groups_of(obj)[0]["lr"] = value

    rewrite(str(path), edit)
    before = path.read_bytes()
    with pytest.raises(error, match=re.escape(problem)) as ei:
        pyckpt.export_dcp(tag, tmp_path / "out")
    assert str(tag) in str(ei.value)
    assert not (tmp_path / "out").exists() and path.read_bytes() == before


@pytest.mark.parametrize("params,problem", [([7], "holds flat partition 7"), (["0"], "no list of flat partition"),
                                            ([-1], "no list of flat partition"), (None, "no list of flat partition")])
def test_param_group_indices_out_of_range_are_refused(checkpoints, tmp_path, params, problem):
    _, tag = copy_checkpoint(checkpoints["s2_fp32_dp3"].tag_dir, tmp_path)

    def edit(obj):
        _groups_of(obj)[0]["params"] = params

    rewrite(str(_first_optim_file(tag)), edit)
    with pytest.raises(CheckpointFormatError, match=problem):
        pyckpt.export_dcp(tag, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zero3_ranks_that_disagree_on_the_step_are_refused(checkpoints, tmp_path):
    _, tag = copy_checkpoint(checkpoints["s3_fp32_dp2_subgroups"].tag_dir, tmp_path)
    path = sorted(tag.glob("*optim_states.pt"))[1]

    def edit(obj):
        state = obj["optimizer_state_dict"]["optimizer_state_dict"]["state"]
        first = state[next(iter(state))]
        first["step"] = 99.0

    rewrite(str(path), edit)
    with pytest.raises(CheckpointFormatError, match="disagree on the Adam step"):
        pyckpt.export_dcp(tag, tmp_path / "out")


def test_a_model_entry_named_like_the_optimizer_key_is_refused_at_the_top_level(checkpoints, tmp_path):
    ck = checkpoints["s2_fp32_dp3"]
    with pytest.raises(CheckpointFormatError, match="named 'l0.weight'"):
        pyckpt.export_dcp(ck.root, tmp_path / "out", model_key="", optim_key="l0.weight")
    with pytest.raises(ValueError, match="must differ"):
        pyckpt.export_dcp(ck.root, tmp_path / "out", model_key="x", optim_key="x")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [3])
def test_torchrun_export_equals_one_process(checkpoints, ds_environ, tmp_path, nproc):
    """Under torchrun the data files are dealt among the processes (at least one each); the folder holds
    the same entries as one process's, bit for bit, and its metadata names the same chunks."""
    ck = checkpoints["s3_bf16_dp3"]
    one = tmp_path / "one"
    pyckpt.export_dcp(ck.root, one, chunk_bytes=64)
    many = tmp_path / "many"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m",
           "pyckpt.export", str(ck.root), str(many), "--format", "dcp", "--chunk-mb", str(64 / 2**20), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**ds_environ, "OMP_NUM_THREADS": "1"},
                          timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(many.glob("*.distcp"))) >= nproc
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _read_back(one, tmp_path / "a"), _read_back(many, tmp_path / "b")
    _check_against_reference(ck, b)
    assert sorted(a["model"]) == sorted(b["model"])


# -- verify ------------------------------------------------------------------------------------------

def _patch_chunk(folder: Path, key: str, fix_crc: bool) -> None:
    """Flips the first byte of the first chunk of entry ``key`` in place; with ``fix_crc`` also the
    CRC-32 its archive stores (local header and central directory), so that only a comparison with the
    input can tell."""
    import struct
    import zipfile
    import zlib
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(folder)).read_metadata()
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    path = folder / info.relative_path
    data = bytearray(path.read_bytes())
    blob = bytes(data[info.offset:info.offset + info.length])
    zf = zipfile.ZipFile(io.BytesIO(blob))
    member = next(i for i in zf.infolist() if i.filename == "archive/data/0")
    name_len, extra_len = struct.unpack("<HH", blob[member.header_offset + 26:member.header_offset + 30])
    start = info.offset + member.header_offset + 30 + name_len + extra_len
    data[start] ^= 0xFF
    if fix_crc:
        crc = zlib.crc32(bytes(data[start:start + member.file_size]))
        struct.pack_into("<I", data, info.offset + member.header_offset + 14, crc)
        at = blob.find(b"PK\x01\x02")
        while at >= 0:
            n = struct.unpack("<H", blob[at + 28:at + 30])[0]
            if blob[at + 46:at + 46 + n] == b"archive/data/0":
                struct.pack_into("<I", data, info.offset + at + 16, crc)
                break
            at = blob.find(b"PK\x01\x02", at + 1)
    path.write_bytes(bytes(data))


def test_verify_accepts_the_export_and_names_each_defect(checkpoints, tmp_path):
    """`pyckpt verify DCP --against INPUT` plans the export again: a sound export passes with every
    chunk compared by CRC-32 with the input; a chunk whose bytes no longer match its CRC, one whose
    bytes (and CRC) differ from the input's, a missing or an extra file, and a changed .metadata are
    each one problem naming the file."""
    from pyckpt.dcp.verify import verify_dcp
    ck = checkpoints["s3_frozen_tied"]
    out = tmp_path / "dcp"
    pyckpt.export_dcp(ck.root, out, chunk_bytes=40)
    report = verify_dcp(out, against=ck.root)
    assert report.ok, report.problems
    assert report.content_checked > 20 and report.content_skipped == 0

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    _patch_chunk(bad, "model.emb.weight", fix_crc=False)
    problems = [str(p) for p in verify_dcp(bad, against=ck.root).problems]
    assert len(problems) == 1 and "fails its CRC-32 check" in problems[0], problems

    shutil.rmtree(bad)
    shutil.copytree(out, bad)
    _patch_chunk(bad, "optim.state.emb.weight.exp_avg", fix_crc=True)
    problems = [str(p) for p in verify_dcp(bad, against=ck.root).problems]
    assert len(problems) == 1 and "differ from the input's" in problems[0], problems

    shutil.rmtree(bad)
    shutil.copytree(out, bad)
    (bad / "__0_0.distcp").unlink()
    (bad / "stray").write_text("x")
    (bad / ".metadata").write_bytes((bad / ".metadata").read_bytes()[:-1] + b"\x00")
    problems = sorted(str(p) for p in verify_dcp(bad, against=ck.root).problems)
    assert [p.split(": ", 1)[0] for p in problems] == [str(bad / ".metadata"), str(bad / "__0_0.distcp"),
                                                      str(bad / "stray")], problems


def test_verify_command_line_checks_a_dcp_folder_alone_or_against_its_input(checkpoints, tmp_path):
    ck = checkpoints["s2_bf16_frozen_tied"]
    out = tmp_path / "dcp"
    pyckpt.export_dcp(ck.root, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([sys.executable, "-m", "pyckpt.verify", str(out), "--against", str(ck.root)],
                        capture_output=True, text=True, cwd=tmp_path, env=env)
    assert ok.returncode == 0 and ok.stdout.startswith("OK:"), ok.stdout + ok.stderr
    # alone, a DCP folder is checked on its own (every archive read, every member's CRC-32): pyckpt's export is one
    alone = subprocess.run([sys.executable, "-m", "pyckpt.verify", str(out)], capture_output=True, text=True,
                           cwd=tmp_path, env=env)
    assert alone.returncode == 0 and alone.stdout.startswith("OK:"), alone.stdout + alone.stderr
    (out / ".pyckpt-export.json").unlink()
    unknown = subprocess.run([sys.executable, "-m", "pyckpt.verify", str(out), "--against", str(ck.root)],
                             capture_output=True, text=True, cwd=tmp_path, env=env)
    assert unknown.returncode == 2 and "only a DCP folder pyckpt exported" in unknown.stderr


# -- torchtitan's names (no DeepSpeed run: the generator's Llama, whose layout DeepSpeed's converter
# accepts, tests/project/test_make_checkpoint.py) ----------------------------------------------------------

def _tt_reverse_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # torchtitan 0.3.0, models/llama3/state_dict_adapter.py, _reverse_permute (what from_hf applies)
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _tt_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # torchtitan 0.3.0, models/common/attention.py, _merge_qkv_on_load
    hd = k.shape[0] // kv_heads
    cols = q.shape[1]
    return torch.cat([q.reshape(kv_heads, -1, hd, cols), k.reshape(kv_heads, 1, hd, cols),
                      v.reshape(kv_heads, 1, hd, cols)], dim=1).reshape(-1, cols)


@pytest.mark.parametrize("stage,dp", [(2, 8), (3, 3)])
def test_torchtitan_export_is_torchtitans_conversion_of_the_universal_state(tmp_path, stage, dp):
    """--torchtitan on a Llama (4 query heads, 2 key/value heads of 8 rows; ZeRO-2 at dp 8 cuts
    parameters mid-row): the model entries under torchtitan's names with q and k rows in its rotary
    order, the optimizer flattened under "optimizer" with q, k and v's moments fused into wqkv, each
    exactly what torchtitan's own formulas (quoted above) make of the Universal Checkpoint's tensors,
    and the steps and groups (with initial_lr) under the fused name."""
    import pyckpt.testing as mc

    tag = mc.make_checkpoint(tmp_path / "ck", dp=dp, stage=stage, family="llama", layers=2, hidden=32, heads=4,
                             kv_heads=2, vocab=64)
    (tag.parent / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                                        "num_attention_heads": 4, "num_key_value_heads": 2}))
    universal = tmp_path / "universal"
    pyckpt.convert_to_universal(tag, universal)
    out = tmp_path / "tt"
    pyckpt.export_dcp(tag.parent, out, torchtitan=True, initial_lr=0.25)
    got = _read_back(out, tmp_path)

    shapes = {"q": (32, 32), "k": (16, 32), "v": (16, 32), "o": (32, 32)}

    def uni(name, state):
        t = torch.load(universal / "zero" / name / f"{state}.pt", weights_only=True)
        t = t["param"] if isinstance(t, dict) else t
        proj = re.search(r"\.([qkvo])_proj\.", name)
        return t.reshape(shapes[proj.group(1)]) if proj else t  # ZeRO-3's are flat

    names = sorted(p.name for p in (universal / "zero").iterdir() if p.is_dir())
    assert "optimizer" in got and not any(k in got for k in ("model", "optim"))
    for layer in range(2):
        hf = f"model.layers.{layer}.self_attn."
        tt = f"layers.{layer}.attention.qkv_linear."
        q, k, v = (uni(hf + f"{x}_proj.weight", "fp32") for x in "qkv")
        assert _same(got[tt + "wq.weight"], _tt_reverse_permute(q, 4))
        assert _same(got[tt + "wk.weight"], _tt_reverse_permute(k, 2))
        assert _same(got[tt + "wv.weight"], v)
        fused = f"layers.{layer}.attention.qkv_linear.wqkv.weight"
        for s in ("exp_avg", "exp_avg_sq"):
            q, k, v = (uni(hf + f"{x}_proj.weight", s) for x in "qkv")
            want = _tt_fuse(_tt_reverse_permute(q, 4), _tt_reverse_permute(k, 2), v, 2)
            assert _same(got["optimizer"]["state"][fused][s], want), (fused, s)
        assert not any(f"{tt}w{x}.weight" in got["optimizer"]["state"] for x in "qkv")
        w1 = got[f"layers.{layer}.feed_forward.w1.weight"]
        assert _same(w1, uni(f"model.layers.{layer}.mlp.gate_proj.weight", "fp32").reshape(w1.shape))
        assert _same(got[f"layers.{layer}.ffn_norm.weight"],
                     uni(f"model.layers.{layer}.post_attention_layernorm.weight", "fp32"))
        assert _same(got["optimizer"]["state"][f"layers.{layer}.attention.wo.weight"]["exp_avg"],
                     uni(hf + "o_proj.weight", "exp_avg"))
    emb = got["tok_embeddings.weight"]
    assert _same(emb, uni("model.embed_tokens.weight", "fp32").reshape(emb.shape))
    state = got["optimizer"]["state"]
    assert len(state) == len(names) - 4  # per layer, k and v live in the fused wqkv
    groups = got["optimizer"]["param_groups"]
    assert set(groups) == set(state)
    assert all(g["initial_lr"] == 0.25 and g["lr"] == 0.01 for g in groups.values())


def test_torchtitan_names_refuse_what_torchtitan_has_no_place_for(checkpoints, tmp_path):
    """Without a Llama config beside the checkpoint, or with a parameter torchtitan's Llama3 has no
    name for, the export is refused naming why, before anything is written; the layout options cannot
    be mixed with it."""
    root, _ = copy_checkpoint(checkpoints["z2_groups_dp2"].tag_dir, tmp_path)
    out = tmp_path / "tt"
    with pytest.raises(pyckpt.UnsupportedCheckpointError, match="no config.json beside it"):
        pyckpt.export_dcp(root, out, torchtitan=True, initial_lr=1.0)
    (root / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(pyckpt.UnsupportedCheckpointError, match="model_type 'gpt2'"):
        pyckpt.export_dcp(root, out, torchtitan=True, initial_lr=1.0)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2}))
    with pytest.raises(pyckpt.UnsupportedCheckpointError, match="has no torchtitan Llama3 name"):
        pyckpt.export_dcp(root, out, torchtitan=True, initial_lr=1.0)
    assert not out.exists()
    with pytest.raises(ValueError, match="fixes the names and the layout.*: hf_names names the parameters another way"):
        pyckpt.export_dcp(root, out, torchtitan=True, hf_names=True)
    with pytest.raises(ValueError, match="fixes the names and the layout.*: leave model_key, optim_key and optim_layout"):
        pyckpt.export_dcp(root, out, torchtitan=True, optim_layout="flat", model_key="m")


@pytest.mark.parametrize("flags,error", [(["--torchtitan", "--optim-layout", "flat"],
                                          "leave --model-key, --optim-key and --optim-layout unset"),
                                         (["--torchtitan", "--hf-names"], "--hf-names names the parameters another way"),
                                         (["--initial-lr", "-1"], "non-negative")])
def test_torchtitan_flags_that_contradict_it_are_usage_errors(tmp_path, flags, error):
    proc = subprocess.run([sys.executable, "-m", "pyckpt.export", str(tmp_path / "absent"), str(tmp_path / "out"),
                           "--format", "dcp"] + flags, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2 and error in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


# config.json bytes Python's json takes (Infinity, 1e999, a 100,000-digit integer) or fails on
# naming no file (100,000 nested lists: RecursionError), and values json.dumps cannot write
RAW_CONFIGS = {
    "heads_infinity": b'{"model_type": "llama", "hidden_size": 32, "num_attention_heads": Infinity}',
    "heads_nan": b'{"model_type": "llama", "hidden_size": 32, "num_attention_heads": NaN}',
    "hidden_1e999": b'{"model_type": "llama", "hidden_size": 1e999, "num_attention_heads": 4}',
    "deep_lists": (b'{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "x": '
                   + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "heads_100000_digits": b'{"model_type": "llama", "hidden_size": 32, "num_attention_heads": ' + b"4" * 100_000
                           + b"}",
    "duplicate_heads": (b'{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, '
                        b'"num_attention_heads": 2}'),
    "top_level_list": b'[{"model_type": "llama"}]',
}


@pytest.mark.parametrize("config", ["outside", "proc", "heads_text", "heads_zero", "heads_not_dividing",
                                    "kv_not_dividing", "odd_head_dim", "heads_huge", "not_json", "heads_float",
                                    "heads_bool", "heads_negative", "hidden_missing", "head_dim_huge",
                                    *RAW_CONFIGS])
def test_torchtitan_reads_a_hostile_config_beside_the_checkpoint_as_one_error(tmp_path, config):
    """--torchtitan takes the attention shape from the config.json beside the checkpoint: one that
    links out of it (a secret, /proc) is refused, not followed; heads that are not a positive JSON
    integer of sane size, a shape that does not divide the q/k rows, or an odd head size are one error
    naming why, before anything is written; so are NaN, infinities, deep nesting, a 100,000-digit
    integer, a duplicate key or a top level that is not an object (issue 36, item 8), naming
    config.json; the checkpoint is unchanged."""
    import pyckpt.testing as mc
    from compare import digest

    tag = mc.make_checkpoint(tmp_path / "ck", dp=2, stage=2, family="llama", layers=1, hidden=32, heads=4,
                             kv_heads=2, vocab=64)
    root = tag.parent
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
                                  "token": "s3cr3t"}))
    base = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    bad = {"heads_text": {"num_attention_heads": "four"}, "heads_zero": {"num_attention_heads": 0},
           "heads_not_dividing": {"num_attention_heads": 3, "num_key_value_heads": 1},
           "kv_not_dividing": {"num_key_value_heads": 3}, "odd_head_dim": {"head_dim": 7},
           "heads_huge": {"num_attention_heads": 10 ** 18, "num_key_value_heads": 1},
           "heads_float": {"num_attention_heads": 4.0}, "heads_bool": {"num_key_value_heads": True},
           "heads_negative": {"num_attention_heads": -4}, "hidden_missing": {"hidden_size": None},
           "head_dim_huge": {"head_dim": 2 ** 40}}
    if config in RAW_CONFIGS:
        (root / "config.json").write_bytes(RAW_CONFIGS[config])
    else:
        _plant_config(root / "config.json", secret, config, dict(base, **bad.get(config, {})))
    before = digest(root)
    with pytest.raises(pyckpt.PyckptError) as err:
        pyckpt.export_dcp(root, tmp_path / "out", torchtitan=True, initial_lr=0.1)
    message = str(err.value)
    assert "s3cr3t" not in message and "\n" not in message
    expected = {"outside": "config.json", "proc": "config.json", "not_json": "config.json",
                "heads_text": "attention shape", "heads_zero": "attention shape",
                "heads_not_dividing": "not 3 heads", "kv_not_dividing": "attention shape",
                "odd_head_dim": "attention shape", "heads_huge": "attention shape",
                "heads_float": "num_attention_heads is 4.0", "heads_bool": "num_key_value_heads is True",
                "heads_negative": "num_attention_heads is -4", "hidden_missing": "hidden_size is None",
                "head_dim_huge": "head_dim is 1099511627776", "heads_infinity": "Infinity is not a JSON number",
                "heads_nan": "NaN is not a JSON number", "hidden_1e999": "beyond a float's range",
                "deep_lists": "nested deeper than 64 levels", "heads_100000_digits": "an integer of 100000 digits",
                "duplicate_heads": "the key 'num_attention_heads' appears twice",
                "top_level_list": "must be a JSON object"}[config]
    assert expected in message, message
    if config != "heads_not_dividing":  # that one is the q/k rows against the config, named by tensor
        assert message.startswith(f"{root / 'config.json'}: "), message  # the file and the rule
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["ck", "secret.json"]
    assert digest(root) == before
