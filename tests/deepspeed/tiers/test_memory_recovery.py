"""Recovery across two "nodes" with real processes and sockets, without DeepSpeed
(tests/workers/memory_recovery_worker.py): which checkpoint is taken, the shares a node lacks sent to it and
verified, each node's folder put together from links, and a checkpoint that cannot be put together
(its sending fails) passed over for the next newest, on every rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from memory_shares import claim, describe, model_states

WORKER = str(Path(__file__).resolve().parents[2] / "workers" / "memory_recovery_worker.py")
MODEL = "ef" * 32


def _share(folder: Path, tag: str, step: int, node: int, save: str, save_dir: Path) -> dict:
    path = folder / tag
    path.mkdir(parents=True)
    files = {f"zero_pp_rank_{node}_mp_rank_00_optim_states.pt": os.urandom(3000 + node)}
    for name, data in files.items():
        (path / name).write_bytes(data)
    if node == 0:
        model_states(path / "mp_rank_00_model_states.pt", step)
        files["mp_rank_00_model_states.pt"] = (path / "mp_rank_00_model_states.pt").read_bytes()
    describe(path, save=save, job="job", step=step, node=node, nodes=2, world=2, model=MODEL, save_dir=save_dir)
    return files


@pytest.fixture
def layout(tmp_path):
    """Node 0's memory holds its own shares of steps 4 and 5 and node 1's replicas of them, its job
    folder recorded as the run's of save_dir; node 1's memory is empty (a replacement node)."""
    roots = [tmp_path / "root0", tmp_path / "root1"]
    durable = tmp_path / "durable"
    durable.mkdir()
    claim(roots[0], "job", durable)
    node0 = roots[0] / "job" / "node0"
    roots[1].mkdir(mode=0o700)
    files = {}
    for step in (4, 5):
        save = f"save-{step}"
        files[step] = {**_share(node0, f"s{step}", step, 0, save, durable),
                       **_share(node0 / "replica-of-node1", f"s{step}", step, 1, save, durable)}
    return roots, files


def _run(tmp_path, roots, fail_tags=()):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"save_dir": str(tmp_path / "durable"), "out": str(out), "fail_tags": list(fail_tags)}))
    procs = []
    for rank, root in enumerate(roots):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "GROUP_RANK": str(rank), "LOCAL_WORLD_SIZE": "1",
               "PYCKPT_MEMORY_ROOT": str(root)}
        env.pop("PYCKPT_JOB_ID", None)
        procs.append(subprocess.Popen([sys.executable, WORKER, str(spec)], env=env, cwd="/",
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_replacement_node_gets_every_share_sent_and_both_nodes_load_the_same_files(tmp_path, layout):
    roots, files = layout
    results = _run(tmp_path, roots)
    expected = {name: data.hex() for name, data in files[5].items()}
    for rank, res in enumerate(results):
        folder, tag = res["found"]
        assert tag == "s5" and folder == str(roots[rank] / "job" / f"node{rank}" / "restore")
        assert res["files"] == expected  # DeepSpeed's files only: no manifest among them
    (line, ) = results[0]["log"]
    assert line.startswith("pyckpt: resuming step 5 from memory (node 1's files from the copy on node 0; sent to "
                           "node(s) 1)") and "holds none" in line, line
    assert results[1]["log"] == [] and results[0]["sent"] == 2
    # node 1 now keeps what it was sent as replicas, verified, and its restore folder links them
    assert sorted(os.listdir(roots[1] / "job" / "node1")) == ["replica-of-node0", "replica-of-node1", "restore"]
    restored = roots[1] / "job" / "node1" / "restore" / "s5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    kept = roots[1] / "job" / "node1" / "replica-of-node1" / "s5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert os.stat(restored).st_ino == os.stat(kept).st_ino  # a link, not a second copy


def test_a_checkpoint_whose_shares_cannot_be_sent_is_passed_over_for_the_next_newest(tmp_path, layout):
    roots, files = layout
    results = _run(tmp_path, roots, fail_tags=["s5"])
    for res in results:
        assert res["found"][1] == "s4" and res["files"] == {n: d.hex() for n, d in files[4].items()}
    (line, ) = results[0]["log"]
    assert line.startswith("pyckpt: resuming step 4 from memory (") and "step 5 (s5) could not be put together" in line
    assert "injected: the link to the other node dropped" in line and line.endswith("passed over"), line


def test_when_no_memory_checkpoint_can_be_put_together_save_dir_is_loaded_saying_why(tmp_path, layout):
    roots, _ = layout
    results = _run(tmp_path, roots, fail_tags=["s4", "s5"])
    assert [r["found"] for r in results] == [None, None]
    (line, ) = results[0]["log"]
    assert line.startswith("pyckpt: resuming from ") and "not from memory: step 5 (s5) could not be put" in line
    assert "step 4 (s4) could not be put together" in line, line
