"""The memory tier after losing a node (issue 37): recovery at half the size, and replication.

    python benchmarks/memory_nodes.py OUT --params 200M --bucket 5e7 --rounds 2 \\
        --json benchmarks/results/memory_nodes_z2_200M.json
    python benchmarks/memory_nodes.py OUT --quick          # smoke run, tiny model

Two torchrun agents on this machine act as two nodes (c10d rendezvous on localhost, 2 ranks each, a
memory root of /dev/shm each). They train one step of the benchmarks' Linear stack (make_real_checkpoint.py's
model and DeepSpeed config) and save it to the memory tier (synchronously, ``keep=1``: each node's share,
then its replica on the other node) and, by DeepSpeed's own ``engine.save_checkpoint``, to OUT/durable.
Node 1 is then lost (its memory root deleted) and the job continues on node 0 alone, at half the
data-parallel size (2 ranks), two ways per round, in alternating order:

* ``deepspeed``: DeepSpeed's convert-then-load: ``ds_to_universal.py`` on OUT/durable's checkpoint
  (its wall time), then 2 ranks with ``"checkpoint": {"load_universal": true}`` and
  ``engine.load_checkpoint(OUT/universal)``;
* ``pyckpt``: 2 ranks under ``pyckpt.deepspeed.enable(resume_tier=tier)`` (called before the engine is built, as
  a job does) and ``engine.load_checkpoint(OUT/durable)``:
  the newest recoverable checkpoint is in memory (node 0's own share and node 1's replica), linked
  together and resharded straight from the shards.

Each load is timed from a barrier to the slowest rank's return, then one seeded training step; the
weights after it are summed on rank 0 in float64 and must be equal both ways. OUT's files are synced
and evicted from the page cache before each way (``posix_fadvise(DONTNEED)``). Engines are built before
the clock starts, as a restarted worker's are. Replication: the seconds each leader's background
sender took to have its node's share verified on the other node (from its log of sends), against
``cp -r`` of the same share between the two memory roots.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# tests/helpers: pagecache (eviction) and rendezvous (a store held for the agents)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))

GOALS = {"deepspeed_over_pyckpt": 20.0, "replication_over_cp": 1.3}
CLIENT = {"universal_checkpoint_info": {}}


# -- the workers (under torchrun) ---------------------------------------------------------------

def _engine(args, universal: bool = False):
    import deepspeed

    from make_real_checkpoint import build_model, ds_config

    model, _ = build_model(args["params"], args["width"])
    cfg = ds_config(2, "fp32")
    if args["bucket"]:
        cfg["zero_optimization"].update(reduce_bucket_size=int(args["bucket"]), allgather_bucket_size=int(args["bucket"]))
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _step(engine, width: int, seed=None) -> None:
    import torch

    g = torch.Generator().manual_seed(seed) if seed is not None else None
    x = torch.randn(1, width, generator=g)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _slowest(value: float) -> float:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return max(out)


def worker(mode: str, spec_path: str) -> int:
    import deepspeed
    import torch.distributed as dist

    from make_real_checkpoint import skip_shm_comm_op

    import pyckpt.deepspeed as pd

    with open(spec_path) as f:
        args = json.load(f)
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    tier = pd.MemoryTier(job="bench", keep=1, keep_at_exit=True)
    if mode == "train":
        from pyckpt.deepspeed.tiers import links

        engine = _engine(args)
        _step(engine, args["width"])
        # the memory checkpoint of the save dir the restart loads (a memory checkpoint belongs to its save dir);
        # nothing is written there but DeepSpeed's own save below (no persistence asked)
        pd.save_checkpoint(engine, os.path.join(args["out"], "durable"), save_tier=tier, client_state=CLIENT)
        sent = None
        for found in links._NODES.values():
            if found.sender is not None:
                found.sender.flush(600)
                sent = list(found.sender.sent), list(found.sender.failed)
        engine.save_checkpoint(os.path.join(args["out"], "durable"), client_state=CLIENT)  # DeepSpeed's own
        dist.barrier()
        with open(os.path.join(args["out"], f"ready-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "node": int(os.environ["GROUP_RANK"]), "root": os.environ["PYCKPT_MEMORY_ROOT"],
                       "sent": sent, "folder": tier.folder()}, f)
        engine.destroy()
        dist.barrier()
        return 0
    if mode == "pyckpt":
        # before the engine is built, as the manual has a job do: the node's newest memory files are read
        # for their CRC-32 while the engine is built, not in the load
        pd.enable(resume_tier=tier)
    engine = _engine(args, universal=mode == "deepspeed")
    dist.barrier()
    profile = os.environ.get("PYCKPT_BENCH_PROFILE") if rank == 0 else None  # a folder for rank 0's cProfile
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    engine.load_checkpoint(os.path.join(args["out"], "universal" if mode == "deepspeed" else "durable"))
    t1 = time.perf_counter()
    if profile:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile, f"{mode}.prof"))
    _step(engine, args["width"], seed=1234)
    t2 = time.perf_counter()
    load, load_and_step = _slowest(t1 - t0), _slowest(t2 - t0)
    from pyckpt.deepspeed.load import hooks, memory_recovery

    parts = {"recovery": _slowest(memory_recovery.last_recovery.get("seconds", 0.0)),
             "plan": _slowest(hooks.last_load.get("plan_s", 0.0)), "gather": _slowest(hooks.last_load.get("gather_s", 0.0))}
    if rank == 0:
        weights = float(sum(q.detach().double().sum() for q in engine.module.parameters()))
        with open(os.path.join(args["out"], f"{mode}.json"), "w") as f:
            json.dump({"load": load, "load_and_step": load_and_step, "weights_sum": weights,
                       "global_steps": engine.global_steps, "parts": parts}, f)
    engine.destroy()
    dist.barrier()
    return 0


# -- the orchestration ----------------------------------------------------------------------------

def _torchrun(mode: str, spec: str, nodes: list, out: str, env: dict) -> None:
    """``mode`` on len(nodes) agents (one per memory root), 2 ranks each; waits for all."""
    from rendezvous import held_rendezvous

    with held_rendezvous() as rendezvous:
        _agents(mode, spec, nodes, out, env, rendezvous)


def _agents(mode: str, spec: str, nodes: list, out: str, env: dict, rendezvous: list) -> None:
    """One agent per memory root, each started in a session of its own; the first failure kills the rest."""
    procs = []
    for i, root in enumerate(nodes):
        log = open(os.path.join(out, f"{mode}-agent{i}.log"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--nproc-per-node", "2",
             *rendezvous, "--rdzv-id", f"bench-{mode}-{os.getpid()}",
             os.path.abspath(__file__), "--worker", mode, spec],
            env={**env, "PYCKPT_MEMORY_ROOT": root}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    for i, p in enumerate(procs):
        if p.wait() != 0:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            with open(os.path.join(out, f"{mode}-agent{i}.log")) as f:
                raise RuntimeError(f"{mode} failed on agent {i}:\n{f.read()[-6000:]}")


def _evict(folder: str) -> None:
    from pagecache import evict

    os.sync()
    for base, _, files in os.walk(folder):
        for name in files:
            evict(os.path.join(base, name))


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(b, n)) for b, _, fs in os.walk(folder) for n in fs)


RECEIVER = """
import os, sys, time
from pyckpt.deepspeed.tiers.replica_receiver import ReplicaReceiver
folder, token, port_file = sys.argv[1:4]
r = ReplicaReceiver(folder, bytes.fromhex(token)).start()
with open(port_file + ".tmp", "w") as f:
    f.write(str(r.address[1]))
os.rename(port_file + ".tmp", port_file)
time.sleep(3600)
"""


def _replication_alone(share: str, root: str, out: str, rounds: int = 5) -> tuple:
    """Seconds of ``cp -r`` of ``share`` into a folder of ``root`` and of its replication there (a
    receiver process of its own, as on the other node), alternating, nothing else running."""
    from pyckpt.deepspeed.tiers.replica_sender import send_folder

    token = os.urandom(32)
    folder = os.path.join(root, "bench-replica")
    os.makedirs(folder, mode=0o700)
    port_file = os.path.join(out, "receiver-port")
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, folder, token.hex(), port_file], cwd="/")
    try:
        while not os.path.exists(port_file):
            time.sleep(0.05)
        address = ("127.0.0.1", int(open(port_file).read()))
        cps, sends = [], []
        for n in range(rounds):
            for way in (["cp", "send"] if n % 2 == 0 else ["send", "cp"]):
                target = os.path.join(root, "cp-test")
                os.sync()
                t0 = time.perf_counter()
                if way == "cp":
                    subprocess.run(["cp", "-r", share, target], check=True)
                    cps.append(time.perf_counter() - t0)
                    shutil.rmtree(target)
                else:
                    send_folder(share, 1, f"r{n}", address, token)
                    sends.append(time.perf_counter() - t0)
                    shutil.rmtree(os.path.join(folder, "replica-of-node1", f"r{n}"))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    return cps, sends


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="work folder (emptied at the start; removed at the end)")
    p.add_argument("--params", default="200M")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--bucket", type=float, default=None, help="ZeRO bucket sizes (elements)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: 2M parameters, width 256, 1 round")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.params, args.width, args.rounds = "2M", 256, 1
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    from measure import memory_headroom

    before = memory_headroom()
    shm = f"/dev/shm/pyckpt-bench-nodes-{os.getpid()}"
    roots = [os.path.join(shm, "a"), os.path.join(shm, "b")]
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"params": args.params, "width": args.width, "bucket": args.bucket, "out": out}, f)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYCKPT_JOB_ID": "bench"}
    env.pop("PYCKPT_MEMORY_ROOT", None)
    try:
        print("training one step on two nodes, saving to memory (replicated) and to OUT/durable ...", flush=True)
        _torchrun("train", spec, roots, out, env)
        ready = [json.load(open(os.path.join(out, f"ready-{r}.json"))) for r in range(4)]
        leaders = [r for r in ready if r["sent"] is not None]
        replication = []
        for r in leaders:
            (sent, failed) = r["sent"]
            assert sent and not failed, r
            replication.append({"node": r["node"], "seconds": sent[-1][1]})
        kept = next(r for r in ready if r["node"] == 0 and r["sent"] is not None)
        lost = next(r for r in ready if r["node"] == 1 and r["sent"] is not None)
        share = os.path.join(lost["folder"], "global_step1")
        share_bytes = _size(share)
        cps, sends = _replication_alone(share, kept["root"], out)
        cp, send = statistics.median(cps), statistics.median(sends)
        node1_replication = send
        in_job = next(x["seconds"] for x in replication if x["node"] == 1)
        print(f"replication of node 1's share ({share_bytes / 1e9:.2f} GB), alone: {send:.2f} s, cp -r {cp:.2f} s "
              f"({send / cp:.2f}x); in the job (both nodes at once, beside the ranks' own work): {in_job:.2f} s",
              flush=True)
        shutil.rmtree(lost["root"])  # node 1 is lost, and its memory with it
        durable = os.path.join(out, "durable")
        tag = open(os.path.join(durable, "latest")).read().strip()
        rounds = []
        script = os.path.join(os.path.dirname(__import__("deepspeed").__file__), "checkpoint", "ds_to_universal.py")
        for n in range(args.rounds):
            order = ["deepspeed", "pyckpt"] if n % 2 == 0 else ["pyckpt", "deepspeed"]
            row = {"round": n, "order": order}
            for way in order:
                _evict(durable)
                if way == "deepspeed":
                    universal = os.path.join(out, "universal")
                    shutil.rmtree(universal, ignore_errors=True)
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, script, "--input_folder", os.path.join(durable, tag),
                                    "--output_folder", os.path.join(universal, tag)], check=True, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    row["convert"] = time.perf_counter() - t0
                    _evict(universal)
                _torchrun(way, spec, [kept["root"]], out, env)
                row[way] = json.load(open(os.path.join(out, f"{way}.json")))
            ds = row["convert"] + row["deepspeed"]["load"]
            row["deepspeed_over_pyckpt"] = ds / row["pyckpt"]["load"]
            row["deepspeed_over_pyckpt_with_step"] = ((row["convert"] + row["deepspeed"]["load_and_step"])
                                                      / row["pyckpt"]["load_and_step"])
            row["load_only_ratio"] = row["deepspeed"]["load"] / row["pyckpt"]["load"]
            row["same_weights"] = row["deepspeed"]["weights_sum"] == row["pyckpt"]["weights_sum"]
            assert row["same_weights"], row
            rounds.append(row)
            print(f"round {n}: DeepSpeed convert {row['convert']:.2f} s + load {row['deepspeed']['load']:.2f} s; "
                  f"pyckpt from memory {row['pyckpt']['load']:.2f} s: {row['deepspeed_over_pyckpt']:.1f}x "
                  f"(with the first step {row['deepspeed_over_pyckpt_with_step']:.1f}x; the loads alone "
                  f"{row['load_only_ratio']:.2f}x); same weights after the step: {row['same_weights']}", flush=True)
        medians = {k: statistics.median(r[k] for r in rounds) for k in
                   ("deepspeed_over_pyckpt", "deepspeed_over_pyckpt_with_step", "load_only_ratio", "convert")}
        medians["replication_over_cp"] = node1_replication / cp
        goals = {k: {"goal": (">= " if k == "deepspeed_over_pyckpt" else "<= ") + str(v), "median": medians[k],
                     "met": medians[k] >= v if k == "deepspeed_over_pyckpt" else medians[k] <= v}
                 for k, v in GOALS.items()}
        result = {"replication_alone": sends, "params_arg": args.params, "width": args.width, "bucket": args.bucket, "cores": os.cpu_count(),
                  "nodes": 2, "ranks_per_node": 2, "resumed_ranks": 2, "checkpoint_tag": tag,
                  "durable_bytes": _size(os.path.join(durable, tag)), "share_bytes": share_bytes,
                  "replication": replication, "cp_seconds": cps, "rounds": rounds, "medians": medians, "goals": goals,
                  "memory_before": before}
        print(json.dumps({"medians": medians, "goals": {k: v["met"] for k, v in goals.items()}}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if not args.quick:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3]))
    sys.exit(main())
