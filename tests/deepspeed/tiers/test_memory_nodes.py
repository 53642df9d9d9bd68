"""Losing a node (tests/workers/memory_nodes_worker.py, real DeepSpeed on CPU): two torchrun agents on this
machine act as two nodes (c10d rendezvous on localhost), each with its own memory root, 2 ranks each.
The job saves to memory after every step, each node's share replicated to the other node; then one
node's whole process tree is killed and its memory root deleted, the other node's too is killed (its
memory kept), and the job is restarted:
(a) on two nodes, the replacement node's memory empty: its ranks' files come from the replica;
(b) on one node: the job continues at half the data-parallel size, resharded from memory.
Both must equal DeepSpeed's own ds_to_universal + load_universal of a durable save of the same step,
bit for bit, and resume the memory step, newer than save_dir's."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsharness as h
from rendezvous import held_rendezvous

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).resolve().parents[2] / "workers" / "memory_nodes_worker.py")
TIMEOUT_S = 300
STEPS, PERSIST_EVERY = 5, 2


def _agents(tmp: Path, env: dict, phase: str, cfg: h.Config, roots: list, job: str, rendezvous: list,
            durable=None) -> list:
    """One torchrun agent per memory root (a node each), 2 ranks each, meeting at the store the test holds."""
    spec = tmp / f"{phase}-{len(roots)}.json"
    spec.write_text(json.dumps({"phase": phase, "cfg": dataclasses.asdict(cfg), "root": str(tmp), "steps": STEPS,
                                "persist_every": PERSIST_EVERY, "job": job,
                                "durable": str(durable or tmp / "durable")}))
    procs = []
    for i, root in enumerate(roots):
        log = open(tmp / f"{phase}-{len(roots)}-agent{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(roots)), "--nproc-per-node", "2",
             *rendezvous, "--rdzv-id", f"{job}-{phase}-{len(roots)}",
             "--max-restarts", "0", "--monitor-interval", "0.5", WORKER, str(spec)],
            env={**env, "PYCKPT_MEMORY_ROOT": str(root)}, stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
            start_new_session=True))
    return procs


def _tail(tmp: Path, pattern: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob(pattern)))


def _wait_all(procs: list, tmp: Path, pattern: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        try:
            rc = p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            subprocess.run(["pkill", "-USR1", "-f", str(tmp / "resume-")])  # the stacks, into the logs
            time.sleep(2)
            subprocess.run(["pkill", "-KILL", "-f", str(tmp / "resume-")])
            raise AssertionError("the job did not end:\n" + _tail(tmp, pattern))
        assert rc == 0, _tail(tmp, pattern)


def _files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _check_replicas(ready: list) -> None:
    """Once wait_for_replication returned True, each node's newest share is on the other node: the
    replica published there, every file equal to the share's own (its manifest with their CRC-32s among
    them)."""
    roots = {r["node"]: Path(r["memory_root"]) / "nodes" for r in ready}
    for node, peer in ((0, 1), (1, 0)):
        share = roots[node] / f"node{node}" / f"s{STEPS}"
        replica = roots[peer] / f"node{peer}" / f"replica-of-node{node}" / f"s{STEPS}"
        assert replica.is_dir(), sorted(os.listdir(replica.parent)) if replica.parent.exists() else replica
        own = _files(share)
        assert "pyckpt-node.json" in own and _files(replica) == own, (share, replica)


@pytest.fixture(scope="module", params=[h.Config(2, "fp32", 4), h.Config(3, "bf16", 4)], ids=["z2-fp32", "z3-bf16"])
def trained(request, tmp_path_factory, ds_environ):
    """The training phase on two nodes, then node 1 lost: its tree killed, its memory root deleted;
    node 0's tree killed too (the job's restart), its memory kept. What the restarts start from."""
    tmp = tmp_path_factory.mktemp("nodes")
    cfg = request.param
    env = {**ds_environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYCKPT_JOB_ID", None)
    roots = [tmp / "mem-a", tmp / "mem-b"]
    with held_rendezvous() as rendezvous:
        procs = _agents(tmp, env, "train", cfg, roots, "nodes", rendezvous)
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while len(list(tmp.glob("ready-*.json"))) < 4:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    subprocess.run(["pkill", "-USR1", "-f", str(tmp / "train-2.json")])  # the stacks, into the logs
                    time.sleep(2)
                    raise AssertionError("training did not reach its end:\n" + _tail(tmp, "train-*.log"))
                time.sleep(0.2)
            time.sleep(0.5)  # every ready file complete
            ready = [json.loads(p.read_text()) for p in sorted(tmp.glob("ready-*.json"))]
            assert [r["replicated"] for r in ready] == [True] * 4, ready  # wait_for_replication, on every rank
            _check_replicas(ready)
            by_root = dict(zip(map(str, roots), procs))
            lost_root = next(r["memory_root"] for r in ready if r["node"] == 1)
            kept_root = next(r["memory_root"] for r in ready if r["node"] == 0)
            # node 1 lost: its agent and its workers (torchrun starts each in a session of its own) killed at
            # once, its memory gone with the host; then node 0's, its memory kept, as a job's restart does
            for root in (lost_root, kept_root):
                for pid in [by_root[root].pid] + [r["pid"] for r in ready if r["memory_root"] == root]:
                    os.kill(pid, signal.SIGKILL)
                by_root[root].wait()
                if root == lost_root:
                    shutil.rmtree(lost_root)
        finally:
            subprocess.run(["pkill", "-KILL", "-f", str(tmp / "train-2.json")])  # whatever is left of the job
    for f in tmp.glob("ready-*.json"):
        f.unlink()
    # DeepSpeed's own route from the durable reference save of the same step
    for step in (STEPS - 1, STEPS):
        h.run_ds_to_universal(tmp / "ref" / f"s{step}", tmp / "ref_universal" / f"s{step}")
    assert (tmp / "durable" / "latest").read_text() == f"s{STEPS - STEPS % PERSIST_EVERY}"
    return {"tmp": tmp, "cfg": cfg, "env": env, "kept": Path(kept_root), "lost": Path(lost_root)}


def _resume(trained: dict, nodes: int, name: str = "", tamper=None, step: int = STEPS) -> dict:
    tmp, cfg = trained["tmp"], trained["cfg"]
    roots = [trained["kept"], trained["lost"]][:nodes]
    work = tmp / f"resume{nodes}{name}"
    # each restart from the same memory: a copy of what the loss left
    copies = []
    for i, root in enumerate(roots):
        copy = work / f"mem{i}"
        if root.exists():
            shutil.copytree(root, copy, symlinks=True)
        copies.append(copy)
    if tamper is not None:
        tamper(copies)
    # the job resumes with the save dir it trained with (its memory checkpoints are that save dir's), each
    # restart from the save dir as the loss left it; then the restart's save dir is moved into its folder
    durable, trained_durable = tmp / "durable", tmp / "durable-as-trained"
    if not trained_durable.exists():
        os.rename(durable, trained_durable)
    shutil.copytree(trained_durable, durable, symlinks=True)
    work.mkdir(parents=True, exist_ok=True)
    with held_rendezvous() as rendezvous:
        procs = _agents(work, trained["env"], "resume", cfg, copies, "nodes", rendezvous, durable)
        _wait_all(procs, work, "resume-*.log")
    os.rename(durable, work / "durable")
    import torch

    resumed = torch.load(work / f"resumed-{2 * nodes}.pt", weights_only=False)  # the test's own file
    reference = h.load_universal(cfg, tmp / "ref_universal", f"s{step}", 2 * nodes)
    return {"resumed": resumed, "reference": reference, "work": work, "copies": copies}


def test_a_replacement_node_with_empty_memory_gets_its_files_from_the_replica(trained):
    out = _resume(trained, 2)
    resumed = out["resumed"]
    assert resumed["global_steps"] == STEPS
    (line, ) = [m for m in resumed["log"] if "resuming step" in m]
    assert line.startswith(f"pyckpt: resuming step {STEPS} from memory (") and "sent to node(s)" in line, line
    assert f"newer than step {STEPS - 1} in" in line, line
    assert h.compare_states(out["reference"], resumed["state"]) == []
    # the normal end persisted the step saved after the resume, then removed both nodes' memory tiers
    assert (out["work"] / "durable" / "latest").read_text() == f"global_step{STEPS + 1}"
    assert [sorted(os.listdir(c)) for c in out["copies"]] == [[], []]


def test_one_node_continues_at_half_the_size_resharded_from_memory(trained):
    out = _resume(trained, 1)
    resumed = out["resumed"]
    assert resumed["global_steps"] == STEPS
    lines = resumed["log"]
    (line, ) = [m for m in lines if "resuming step" in m]
    assert line.startswith(f"pyckpt: resuming step {STEPS} from memory (node 1's files from the copy on node 0)"), line
    assert "world size 4 -> 2" in line and f"newer than step {STEPS - 1} in" in line, line
    assert any("resharding" in m for m in lines), lines
    assert h.compare_states(out["reference"], resumed["state"]) == []
    assert (out["work"] / "durable" / "latest").read_text() == f"global_step{STEPS + 1}"
    assert [sorted(os.listdir(c)) for c in out["copies"]] == [[]]


def test_a_step_whose_replica_never_arrived_is_passed_over_for_the_newest_complete_one(trained):
    """Node 1's replica of step 5 had not reached node 0 when node 1 was lost (its step 4 had): step 5
    is not recoverable, step 4 is (node 0's own share and node 1's replica), and two steps' shares are
    never mixed."""
    def lose_the_newest_replica(copies):
        replica = copies[0] / "nodes" / "node0" / "replica-of-node1"
        shutil.rmtree(replica / f"s{STEPS}")

    out = _resume(trained, 1, "-partial", lose_the_newest_replica, step=STEPS - 1)
    resumed = out["resumed"]
    assert resumed["global_steps"] == STEPS - 1
    (line, ) = [m for m in resumed["log"] if "resuming step" in m]
    assert line.startswith(f"pyckpt: resuming step {STEPS - 1} from memory (node 1's files from the copy on node 0)")
    assert "the same step as in" in line, line
    assert h.compare_states(out["reference"], resumed["state"]) == []
