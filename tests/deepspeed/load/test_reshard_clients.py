"""Resume anywhere with one line: the Hugging Face Trainer and accelerate change world size under
``pyckpt.deepspeed.enable()`` with the DeepSpeed config they saved with.

Real libraries on CPU (tests/workers/reshard_client_worker.py under torchrun): a tiny LlamaForCausalLM with
tied embeddings, trained in bf16 under ZeRO-2 and ZeRO-3, saved by the client at 2 ranks and at 3,
then resumed at the other size two ways: with ``enable()`` and the unchanged config (pyckpt reshards
from the ZeRO shards), and DeepSpeed's own road (ds_to_universal, then ``load_universal: true``).
The losses of the steps after the resume, the gathered weights and fp32 masters at the end, the
step and the learning rate must be the same bit for bit; pyckpt says once, on rank 0, that it
resharded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsharness

HERE = Path(__file__).resolve().parents[2] / "workers"
WORKER = HERE / "reshard_client_worker.py"
CLIENTS = ("trainer", "accelerate")
STAGES = (2, 3)
MOVES = ((2, 3), (3, 2))  # saved at, resumed at


def _launch(world: int, jobs: list, root: Path, env: dict) -> str:
    spec = root / f"jobs-{world}-{len(list(root.glob('jobs-*')))}.json"
    spec.write_text(json.dumps({"tokenizer": str(root / "tokenizer"), "jobs": jobs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(WORKER), str(spec)]
    proc = subprocess.run(cmd, env=env, cwd=str(root), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-8000:]
    return proc.stdout + proc.stderr


def _saved_tag_folder(client: str, saved: Path) -> Path:
    """The DeepSpeed tag folder the client's save wrote."""
    return saved / "checkpoint-2" / "global_step2" if client == "trainer" else saved / "state" / "pytorch_model"


def _stock_copies(saved_runs: list, root: Path) -> None:
    """DeepSpeed's own road for each (client, saved folder): a copy of the saved run's folder with the
    checkpoint converted by ds_to_universal where a load_universal load of the same call finds it (the
    Trainer: global_step2_universal and latest_universal beside the tag; accelerate, which names its
    tag: in the tag folder's place). Neither client saves universal_checkpoint_info, so the converter
    needs --inject_missing_state. One converter process for all of them."""
    jobs, renames = [], []
    for client, saved in saved_runs:
        stock = root / f"{saved.name}-stock"
        shutil.copytree(saved, stock)
        tag = _saved_tag_folder(client, stock)
        if client == "trainer":
            jobs.append((tag, tag.parent / "global_step2_universal"))
        else:
            jobs.append((tag, tag.parent / "converted"))
            renames.append(tag)
    dsharness.run_ds_to_universal_many(jobs, "--inject_missing_state")
    for tag in renames:
        shutil.rmtree(tag)
        (tag.parent / "converted").rename(tag)


@pytest.fixture(scope="session")
def resumed(ds_root, ds_environ) -> dict:
    """(client, stage, saved at, resumed at) -> {"pyckpt": result, "stock": result, "log": launch output}."""
    root = ds_root / "reshard_clients"
    root.mkdir()
    saves = {(c, s, w): root / f"{c}-z{s}-saved{w}" for c in CLIENTS for s in STAGES for w in (2, 3)}

    def save_jobs(world):
        return [{"client": c, "phase": "save", "stage": s, "out": str(out)} for (c, s, w), out in saves.items()
                if w == world]

    def resume_jobs(saved_at, world):
        jobs = []
        for c in CLIENTS:
            for s in STAGES:
                saved = saves[c, s, saved_at]
                for how in ("pyckpt", "stock"):
                    source = saved if how == "pyckpt" else root / f"{saved.name}-stock"
                    jobs.append({"client": c, "phase": "resume", "stage": s, "how": how, "from": str(source),
                                 "out": str(root / f"{c}-z{s}-{saved_at}to{world}-{how}")})
        return jobs

    logs = {}
    _launch(2, save_jobs(2), root, ds_environ)
    _stock_copies([(c, saved) for (c, s, w), saved in saves.items() if w == 2], root)
    logs[2, 3] = _launch(3, save_jobs(3) + resume_jobs(2, 3), root, ds_environ)
    _stock_copies([(c, saved) for (c, s, w), saved in saves.items() if w == 3], root)
    logs[3, 2] = _launch(2, resume_jobs(3, 2), root, ds_environ)
    out = {}
    for c in CLIENTS:
        for s in STAGES:
            for saved_at, world in MOVES:
                results = {how: torch.load(root / f"{c}-z{s}-{saved_at}to{world}-{how}" / "result.pt",
                                           weights_only=True) for how in ("pyckpt", "stock")}
                out[c, s, saved_at, world] = dict(results, log=logs[saved_at, world])
    return out


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("move", MOVES, ids=lambda m: f"{m[0]}to{m[1]}")
def test_a_client_resumes_at_another_world_size_as_deepspeeds_convert_then_load(resumed, client, stage, move):
    r = resumed[(client, stage) + tuple(move)]
    ours, stock = r["pyckpt"], r["stock"]
    assert ours["global_step"] == stock["global_step"] == 4
    assert ours["lr"] == stock["lr"]
    assert len(ours["losses"]) >= 2 and ours["losses"] == stock["losses"]
    assert set(ours["state"]) == set(stock["state"])
    differ = [k for k in ours["state"] if not torch.equal(ours["state"][k], stock["state"][k])]
    assert differ == []
    assert all(v.dtype == torch.bfloat16 for v in ours["state"].values() if v.is_floating_point())
    differ = [k for k in ours["masters"] if not torch.equal(ours["masters"][k], stock["masters"][k])]
    assert differ == [] and len(ours["masters"]) > 5


@pytest.mark.parametrize("move", MOVES, ids=lambda m: f"{m[0]}to{m[1]}")
def test_the_reshard_is_said_once_per_load_on_rank_0(resumed, move):
    log = resumed[("trainer", 2) + tuple(move)]["log"]
    lines = [line for line in log.splitlines() if "pyckpt: resharding " in line]
    # one per pyckpt resume in the launch (2 clients x 2 stages), each naming both topologies
    assert len(lines) == len(CLIENTS) * len(STAGES), lines
    saved_at, world = move
    for line in lines:
        assert f"data-parallel {saved_at}, tensor-parallel 1 to ZeRO-" in line, line
        assert f"data-parallel {world}, tensor-parallel 1, straight from the ZeRO shards" in line, line
