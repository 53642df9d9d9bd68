"""Export to torch.distributed.checkpoint (issue 25): real DeepSpeed checkpoints exported with their Adam
state, read back by torch's own DCP readers (``dcp_to_torch_save``) and loaded by real FSDP2 jobs at
another world size (``dcp.load`` + ``set_state_dict`` into ``fully_shard``ed modules and torch Adam),
which then train on from where DeepSpeed stopped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsharness as h
from dsharness import models

import pyckpt
from pyckpt.dcp.layout import chunk_tensor, narrow_bytes
from pyckpt.planning.plan import Piece
from pyckpt.tensors import NewTensor

WORKER = Path(__file__).with_name("dcp_fsdp_worker.py")
TIMEOUT_S = 300

# Beside the suite's checkpoints: two param groups of their own hyper-parameters (models.BIAS_GROUP).
GROUPED = {
    "z2_groups_dp2": h.Config(2, "fp32", 2, groups=True),
    "z3_groups_dp3": h.Config(3, "fp32", 3, groups=True, sub_group_size=16),
}
# The suite's checkpoints read back here: every stage, bf16 masters, BF16_Optimizer, tied and frozen
# parameters with buffers, ZeRO-3 sub-groups.
SUITE = ["s1_fp32_dp2", "s2_bf16_dp2", "s3_fp32_dp2_subgroups", "s3_bf16_dp3", "s2_bf16_frozen_tied",
         "s3_frozen_tied", "s1_bf16_dp2_bf16_optimizer"]


@pytest.fixture(scope="module")
def grouped(ds_root, ds_environ) -> dict:
    made = h.make_checkpoints([(cfg, ds_root / "dcp_grouped" / name) for name, cfg in GROUPED.items()],
                              env=ds_environ)
    return dict(zip(GROUPED, made))


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
    with models.BIAS_GROUP."""
    base = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    names = [n for n in ck.reference["param_names"] if n not in ck.reference["frozen"]]
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
    assert sorted(os.listdir(out)) == [".metadata"] + sorted(f"__{i}_0.distcp" for i in range(report.files - 1))
    got = _read_back(out, tmp_path)
    assert sorted(got) == ["model", "optim"]
    _check_against_reference(ck, got)
    if name.endswith("frozen_tied"):
        assert _same(got["model"]["out.weight"], got["model"]["emb.weight"])  # the tied alias, by its own name


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_each_group_keeps_its_hyper_parameters_and_names(grouped, tmp_path, name):
    ck = grouped[name]
    out = tmp_path / "dcp"
    pyckpt.export_dcp(ck.root, out)
    _check_against_reference(ck, _read_back(out, tmp_path))


def test_universal_checkpoint_exports_to_the_same_entries(checkpoints, pyckpt_universal, tmp_path):
    """A Universal Checkpoint (pyckpt's conversion) exports to what its ZeRO checkpoint exports to."""
    name = "s2_bf16_frozen_tied"
    a, b = tmp_path / "zero", tmp_path / "universal"
    pyckpt.export_dcp(checkpoints[name].root, a)
    pyckpt.export_dcp(pyckpt_universal[name], b)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    x, y = _read_back(a, tmp_path / "a"), _read_back(b, tmp_path / "b")
    _check_against_reference(checkpoints[name], y)
    assert sorted(x["model"]) == sorted(y["model"]) and sorted(x["optim"]["state"]) == sorted(y["optim"]["state"])


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


def _fsdp_job(export: Path, model: str, world: int, out: Path, env: dict, groups: bool, steps: int = 3) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(WORKER),
           model, str(export), str(out), "--steps", str(steps)] + (["--groups"] if groups else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


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


@pytest.mark.slow
@pytest.mark.parametrize("source,name,world", [("grouped", "z2_groups_dp2", 3), ("grouped", "z3_groups_dp3", 2),
                                               ("suite", "s2_bf16_frozen_tied", 3)])
def test_fsdp2_job_at_another_world_size_resumes_from_the_export(checkpoints, grouped, ds_environ, tmp_path, source,
                                                                  name, world):
    """A real FSDP2 job on `world` ranks loads the export with dcp.load + set_state_dict: every full
    parameter, Adam moment and step equals the DeepSpeed run's bit for bit and the groups keep their
    hyper-parameters; its next steps' losses are those of the same training continued in one process
    from the reference state (to 1e-6 relative: FSDP averages the ranks' equal gradients, which may
    round differently from one process's gradient)."""
    ck = (grouped if source == "grouped" else checkpoints)[name]
    export = tmp_path / "dcp"
    pyckpt.export_dcp(ck.root, export)
    env = {**ds_environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    got = _fsdp_job(export, ck.config.model, world, tmp_path / "loaded.pt", env, ck.config.groups)
    ref = ck.reference
    for n, p in got["params"].items():
        assert _same(p, ref["fp32"][n]), n
    for n, b in got["buffers"].items():
        assert _same(b, ref["buffers"][n]), n
    trainable = [n for n in ref["param_names"] if n not in ref["frozen"]]
    assert sorted(got["state"]) == sorted(trainable)
    for n in trainable:
        assert _same(got["state"][n]["exp_avg"], ref["exp_avg"][n]), n
        assert _same(got["state"][n]["exp_avg_sq"], ref["exp_avg_sq"][n]), n
        assert float(got["state"][n]["step"]) == ref["step"]
    for group, (hyper, names) in zip(got["groups"], _expected_groups(ck)):
        assert {k: group[k] for k in hyper} == hyper
    assert got["group_names"] == [names for _, names in _expected_groups(ck)]
    plain = _plain_continuation(ck, len(got["losses"]))
    assert got["losses"] == pytest.approx(plain, rel=1e-6), (got["losses"], plain)


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
