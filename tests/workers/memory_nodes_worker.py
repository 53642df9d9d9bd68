"""A training job on two "nodes" (two torchrun agents on this machine, c10d rendezvous on localhost,
each with its own memory root in $PYCKPT_MEMORY_ROOT) that saves to the memory tier after every step,
replicated to the other node; tests/deepspeed/tiers/test_memory_nodes.py kills one node and resumes (tests/
test_memory_nodes.py).

    torchrun --nnodes N --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \
        memory_nodes_worker.py JOB.json

JOB.json: {"phase": "train" | "resume", "cfg": a dsharness Config as a dict, "root": folder, "durable":
the save dir (default root/durable),
"steps": N, "persist_every": P, "job": the memory tier's job id}.

train: steps 1..N, each saved asynchronously to memory as s<step> (every P-th persisted to
root/durable); after the last, pyckpt.deepspeed.wait_for_replication (durable reference saves of
the last two steps went to root/ref), and each rank writes root/ready-<rank>.json (its node, its root,
what the wait returned) and waits to be killed.
resume: engine.load_checkpoint(root/durable) under enable(resume_tier=...); rank 0 writes
root/resumed-<world size>.pt (the gathered state, global_steps, what pyckpt logged); then one more
step is trained and saved to memory, and the job ends normally.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the harness (dsharness/), the helpers (helpers/) and the other workers
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]

from logged import pyckpt_warnings  # noqa: E402  (tests/helpers/logged.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import worker as W  # noqa: E402

import pyckpt.deepspeed as pd  # noqa: E402


# what ds_to_universal asks of a checkpoint it converts (tests/dsharness/worker.py:run_save)
UC_INFO = {"universal_checkpoint_info": {}}


def main() -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a hung worker is, when the test asks
    with open(sys.argv[1]) as f:
        job = json.load(f)
    W.skip_shm_comm_op()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    cfg, root = job["cfg"], job["root"]
    rank, ws = dist.get_rank(), dist.get_world_size()
    # the save dir: the one the job trained with on a resume too (its memory checkpoints are that save dir's)
    durable = job.get("durable") or os.path.join(root, "durable")
    # kept at exit in training (the test kills it anyway); at a normal end after the resume the leaders
    # persist the newest memory checkpoint together and remove the tier
    tier = pd.MemoryTier(job=job["job"], keep=2, persist_every=job["persist_every"],
                         keep_at_exit=job["phase"] == "train")
    lines = pyckpt_warnings()
    pd.enable(resume_tier=tier)
    engine = W.make_engine(cfg, ws)
    if job["phase"] == "resume":
        state, _, _ = W.resume(engine, durable)
        if rank == 0:
            torch.save({"state": state, "global_steps": engine.global_steps, "log": list(lines)},
                       os.path.join(root, f"resumed-{ws}.pt"))
        W.train_step(engine, cfg, rank, engine.global_steps + 1)  # and training goes on
        # on the new topology, and the job ends normally
        pd.save_checkpoint(engine, durable, save_tier=tier, client_state=UC_INFO)
        engine.destroy()
        dist.barrier()
        return 0
    for step in range(1, job["steps"] + 1):
        W.train_step(engine, cfg, rank, step)
        pd.save_checkpoint(engine, durable, tag=f"s{engine.global_steps}", save_tier=tier, async_save=True,
                           client_state=UC_INFO)
        if step >= job["steps"] - 1:  # durable references of the last two steps, for the test's comparisons
            pd.save_checkpoint(engine, os.path.join(root, "ref"), tag=f"s{engine.global_steps}", client_state=UC_INFO)
    # every node's newest share (s<N>) verified on its peer, agreed by every rank (the test then compares
    # the peers' replica folders with the shares)
    replicated = pd.wait_for_replication(timeout=120)
    dist.barrier()
    with open(os.path.join(root, f"ready-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": int(os.environ["GROUP_RANK"]), "memory_root": os.environ["PYCKPT_MEMORY_ROOT"],
                   "replicated": replicated, "pid": os.getpid()}, f)
    time.sleep(600)  # killed by the test
    return 1


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    # a normal end runs pyckpt's exit duties (the memory tier persists and clears) before leaving
    leave_and_exit(main(), exit_handlers=True)
