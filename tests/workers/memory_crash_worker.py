"""A training job under torchrun that saves to the memory tier after every step and loses a rank to
SIGKILL mid-run (tests/deepspeed/tiers/test_memory_tier.py); torchrun's elastic restart re-creates the workers, which
resume from memory.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 memory_crash_worker.py JOB.json

JOB.json: {"cfg": a dsharness Config as a dict, "root": folder, "steps": N, "kill_at": K (or None: the
job ends normally), "persist_every": P, "kill_mid_write": whether rank 1 dies while step K's memory
save is being written rather than after it is published, "job": the tier's job id (default "crash";
null: none of its own), "other_job": {"save_dir": name under root, "step": S} or absent: before it
starts, another job naming no id either saves step S of the same model to the same memory root and
leaves it there as a crashed job does; this job then loads its own save dir under enable(resume_tier=...)
first and writes what that found to root/first_load.json}. The first run trains, saving s<global_steps> to the memory tier asynchronously
after every step (every P-th persisted to root/durable); once the save after step K is published,
rank 1 kills itself and rank 0 is left in a collective. The restarted run (TORCHELASTIC_RESTART_COUNT
1) calls engine.load_checkpoint(root/durable) under enable(resume_tier=...), and rank 0 writes what it
resumed to root/resumed.pt: the gathered state, global_steps and the lines pyckpt logged.
"""

from __future__ import annotations

import json
import os
import signal
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


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    W.skip_shm_comm_op()

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # DeepSpeed's init_distributed with the group keyed by torchrun's attempt: the restarted workers would
    # otherwise read the killed rank's old address from the agent's store (pyckpt/deepspeed/elastic_group.py)
    pd.init_distributed(dist_backend="gloo")
    cfg, root = job["cfg"], job["root"]
    rank, ws = dist.get_rank(), dist.get_world_size()
    durable = os.path.join(root, "durable")
    # kept at the end when the test compares it with DeepSpeed's own load afterwards
    tier = pd.MemoryTier(root=os.path.join(root, "mem"), job=job.get("job", "crash"), keep=2,
                         persist_every=job["persist_every"],
                         # the killed attempt leaves its memory for the restart; the restart ends normally
                         keep_at_exit=job["kill_at"] is not None and restart == 0)
    lines = pyckpt_warnings()
    other = job.get("other_job")
    if other:
        _other_job(cfg, ws, rank, root, other)
    pd.enable(resume_tier=tier)
    engine = W.make_engine(cfg, ws)
    if other:  # a fresh start that asks for its newest checkpoint: the other job's is not its own
        path, _ = engine.load_checkpoint(durable)
        if rank == 0:
            with open(os.path.join(root, "first_load.json"), "w") as f:
                json.dump({"path": None if path is None else str(path), "global_steps": engine.global_steps,
                           "log": list(lines)}, f)
    if restart > 0:
        state, _, _ = W.resume(engine, durable)
        prepared = _prepare(engine, durable, tier)
        if rank == 0:
            torch.save({"state": state, "global_steps": engine.global_steps, "log": lines, "restart": restart,
                        "prepared": prepared}, os.path.join(root, "resumed.pt"))
        W.train_step(engine, cfg, rank, engine.global_steps + 1)  # and training goes on
        if job.get("kill_mid_write"):  # the next save clears what the killed one left in memory
            pd.save_checkpoint(engine, durable, tag=f"s{engine.global_steps}", save_tier=tier)
            if rank == 0:
                folder = tier.folder()
                torch.save({**torch.load(os.path.join(root, "resumed.pt"), weights_only=False),
                            "after_save": sorted(os.listdir(folder))}, os.path.join(root, "resumed.pt"))
        engine.destroy()
        dist.barrier()
        return 0
    for step in range(1, job["steps"] + 1):
        W.train_step(engine, cfg, rank, step)
        if step == job["kill_at"] and job.get("kill_mid_write") and rank == 1:
            # rank 1 dies while its files are being written into the memory tier's staging folder: the
            # free slot's files (step 2's) already moved there to be written over, its write never done
            import threading

            from pyckpt.deepspeed.save import slot_save

            def write_then_never(*args, **kwargs):
                time.sleep(600)

            slot_save.write_archives = write_then_never
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
            pd.save_checkpoint(engine, durable, tag=f"s{engine.global_steps}", save_tier=tier, async_save=True)
            time.sleep(600)
        handle = pd.save_checkpoint(engine, durable, tag=f"s{engine.global_steps}", save_tier=tier, async_save=True)
        if step == job["kill_at"] and job.get("kill_mid_write"):  # never: rank 0 waits in the save for rank 1
            time.sleep(600)
        if step == job["kill_at"]:
            handle.wait()  # published on every rank (the outcome is agreed before wait returns)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            W.train_step(engine, cfg, rank, step + 1)  # rank 0: a collective rank 1 never joins
            time.sleep(600)
    if job["kill_at"] is None:  # a normal end: the memory tier goes, its newest checkpoint persisted first
        engine.destroy()
        dist.barrier()
        return 0
    return 1  # the kill never came


def _prepare(engine, durable: str, tier) -> dict:
    """prepare_memory_tier after the resume, before training goes on: what it did, and per rank the tier's
    files it mapped (their names, from /proc/self/maps), by the folder that holds them."""
    from pyckpt.deepspeed.tiers import free_slot

    kind = pd.prepare_memory_tier(engine, durable, save_tier=tier)
    free_slot.settle()
    folder = tier.folder()
    inodes = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[1].startswith("rw") and parts[1].endswith("s") and parts[4] != "0":
                inodes.add(int(parts[4]))
    mapped = sorted(f"{sub}/{name}" for sub in os.listdir(folder) if os.path.isdir(os.path.join(folder, sub))
                    for name in os.listdir(os.path.join(folder, sub))
                    if os.stat(os.path.join(folder, sub, name), follow_symlinks=False).st_ino in inodes)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mapped)
    return {"kind": kind, "mapped": out}


def _other_job(cfg, ws: int, rank: int, root: str, other: dict) -> None:
    """Another job on the same memory root, naming no job id either: one step of the same model saved to
    memory as step ``other["step"]`` and left there (keep_at_exit), as a job that crashed leaves it."""
    tier = pd.MemoryTier(root=os.path.join(root, "mem"), job=None, keep=2, keep_at_exit=True)
    engine = W.make_engine(cfg, ws)
    W.train_step(engine, cfg, rank, 1)
    engine.global_steps = other["step"]  # further on than this job will get: the newer checkpoint by step
    assert pd.save_checkpoint(engine, os.path.join(root, other["save_dir"]), tag=f"s{other['step']}", save_tier=tier)
    engine.destroy()


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    # a normal end runs pyckpt's exit duties (the memory tier persists and clears) before leaving
    leave_and_exit(main(), exit_handlers=True)
