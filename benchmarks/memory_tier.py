"""The memory tier (issue 37) in one training job: its cost per step, its recovery, its persistence.

    torchrun --standalone --nproc_per_node 4 benchmarks/memory_tier.py OUT --params 200M --stage 2 --rounds 3 \\
        --keep 1 --bucket 5e7 --json benchmarks/results/memory_tier_z2_200M_dp4.json
    torchrun --standalone --nproc_per_node 2 benchmarks/memory_tier.py OUT --quick      # smoke run, tiny model

Every rank builds the benchmarks' Linear stack (make_real_checkpoint.py's model and DeepSpeed config),
trains, and measures three things, each in ``--rounds`` rounds whose ways alternate in order. The memory
root is a folder of /dev/shm (``--memory-root``, default ``/dev/shm/pyckpt-bench-<pid>``), removed at the
end; the tier keeps ``--keep`` checkpoints (default 2; a save holds keep + 1 there until it is published)
and persists none unless asked. ``--bucket`` shrinks ZeRO's reduce and all-gather buckets: on a 23 GB
machine four 201M ranks peak at 12.7 GB in a step with DeepSpeed's default buckets, and the tier's
checkpoints (3.2 GB each, tmpfs pages are memory) and the snapshot arena (3.2 GB) must fit beside them.

1. Saving to memory every step: ``--steps`` training steps with no save against ``--steps`` steps each
   followed by ``save_checkpoint(engine, OUT, save_tier=tier, async_save=True)``. Per step the slowest
   rank's step, the call's wall time (which holds the join of the previous save's write and the tier's
   budget check) and ``handle.stall_s`` (the snapshot: from the save proper to the return); medians over
   the steps. The floor for the stall: a plain ``Tensor.copy_`` of the bytes the snapshot holds (each
   arena chunk, as filled, into one warm buffer of the largest chunk's size, reused: the same
   memory-bound copy as save.py's, without a second full-size buffer on a machine whose memory the tier
   itself fills).
2. Recovery after a crash at the same topology: the same step saved to memory (the tier) and by DeepSpeed
   to OUT; then per way a fresh engine (built untimed, like a restarted worker's), OUT's files synced and
   evicted from the page cache (``posix_fadvise(DONTNEED)``; ``mincore`` then counts what stayed
   resident), and from a barrier: ``stock``, DeepSpeed's own ``engine.load_checkpoint(OUT)``, or
   ``memory``, ``engine.load_checkpoint(OUT)`` under ``pyckpt.deepspeed.enable(resume_tier=tier)`` (it takes the
   memory copy: same step, memory first among equals); the load to the slowest rank's return, and the
   load plus the first training step (a seeded batch) to the slowest rank's end of it. The model's
   weights after that step are summed on rank 0 in float64: both ways must give the same sum. Before the
   rounds rank 0 reads the checkpoint's files alone (OUT evicted, OUT again, the memory copy): what the
   two tiers cost to read without DeepSpeed's own work.
3. Persistence: ``save_checkpoint(..., save_tier=tier, persist=True)`` (synchronous, so the memory copy is
   published when it returns), then ``join_persistence(engine)``: rank 0's copy of the tag folder
   to OUT in the background, from the call's return to the join (and from the call, for reference);
   against ``cp -r`` of the same memory folder to a fresh folder beside it in OUT. Both into the page
   cache (no fsync), each after ``os.sync()``, the other ranks waiting at a barrier.

Times are wall seconds of the slowest rank; ratios are within a round (these machines are shared and
noisy). ``df -T`` of OUT and of the memory root goes into the JSON: the recovery's ratio is a ratio
against that file system, cold.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))  # pagecache: eviction and mincore

from make_real_checkpoint import build_model, ds_config, skip_shm_comm_op

GOALS = {"step_with_save_over_plain": 1.1, "stall_over_memcpy": 1.3, "stock_over_memory_load": 5.0}


def _gather(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _slowest(value: float) -> float:
    return max(_gather(value))


def _slowest_median(values: list) -> float:
    """Per position the slowest rank's value, then the median over positions."""
    every = _gather(values)
    return statistics.median(max(v[i] for v in every) for i in range(len(values)))


def _df(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True).stdout.splitlines()
        fs, kind, size = out[-1].split()[:3]
        return f"{kind} ({fs}, {int(size) / 2**20:.0f} GiB)"
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        return f"unknown ({exc})"


def _files(folder: str) -> list:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs)


def _size(folder: str) -> int:
    return sum(os.path.getsize(f) for f in _files(folder))


def _evict(folder: str) -> int:
    """Syncs, drops ``folder``'s files from the page cache; the bytes still resident after (mincore)."""
    from pagecache import evict, resident_bytes

    os.sync()
    files = _files(folder)
    for f in files:
        evict(f)
    return sum(resident_bytes(f) for f in files)


def _read_through(folder: str) -> float:
    """Seconds to read every file of ``folder`` once (16 MiB reads)."""
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    for f in _files(folder):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="durable folder (emptied at the start and the end)")
    p.add_argument("--params", default="200M")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="training steps per way and round in part 1")
    p.add_argument("--keep", type=int, default=2, help="checkpoints the tier keeps (a save holds keep + 1 at its peak)")
    p.add_argument("--bucket", type=float, default=None,
                   help="ZeRO reduce_bucket_size and allgather_bucket_size (elements; default DeepSpeed's 5e8)")
    p.add_argument("--memory-root", default=None, help="default /dev/shm/pyckpt-bench-<pid of rank 0>")
    p.add_argument("--quick", action="store_true", help="smoke run: 2M parameters, width 256, 1 round, 2 steps")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.params, args.width, args.rounds, args.steps = "2M", 256, 1, 2

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    import pyckpt.deepspeed as pd
    from pyckpt.deepspeed.load import hooks
    from pyckpt.deepspeed.save.in_flight import join_persistence

    on_cpu = get_accelerator().device_name() == "cpu"
    if on_cpu:
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    out = os.path.abspath(args.out)
    root = _gather(args.memory_root or f"/dev/shm/pyckpt-bench-{os.getpid()}")[0]
    tier = pd.MemoryTier(root=root, job="bench", keep=args.keep)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cuda = not on_cpu
    client = {"universal_checkpoint_info": {}}

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    def make_engine():
        model, _ = build_model(args.params, args.width)
        cfg = ds_config(args.stage, args.dtype)
        if args.bucket:  # smaller buckets: less transient memory in a step, nothing else changes
            cfg["zero_optimization"].update(reduce_bucket_size=int(args.bucket), allgather_bucket_size=int(args.bucket))
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=model.parameters())
        return engine

    def step(engine, generator=None) -> float:
        x = torch.randn(1, args.width, generator=generator).to(dtype=dtype, device=engine.device)
        t0 = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def on_rank0(fn) -> None:
        if rank == 0:
            fn()
        dist.barrier()

    def clear_out() -> None:
        on_rank0(lambda: (shutil.rmtree(out, ignore_errors=True), os.makedirs(out), os.sync()))

    def clear_tier() -> None:
        on_rank0(lambda: shutil.rmtree(os.path.join(tier.root_path, tier.job_name), ignore_errors=True))

    clear_out()
    engine = make_engine()
    params = sum(q.numel() for q in engine.module.parameters())
    step(engine)
    # the first memory saves write fresh tmpfs files; from the third on (keep <= 2) they write over a
    # retired checkpoint's files
    firsts = []
    for _ in range(3):
        handle = pd.save_checkpoint(engine, out, client_state=client, save_tier=tier, async_save=True)
        firsts.append(_slowest(handle.stall_s))
        handle.wait()
    first_stall = firsts[0]
    memory_folder = tier.folder()
    tag_folder = os.path.join(memory_folder, f"global_step{engine.global_steps}")
    checkpoint_bytes = _size(tag_folder) if rank == 0 else None
    # the floor: a plain copy of the bytes this rank's files hold (its optimizer partition, and on rank 0
    # the model states), from one warm buffer into another
    mine = [n for n in os.listdir(tag_folder) if f"zero_pp_rank_{rank}_" in n or (rank == 0 and "model_states" in n)]
    snapshot_bytes = _gather(sum(os.path.getsize(os.path.join(tag_folder, n)) for n in mine))
    source = torch.empty(snapshot_bytes[rank], dtype=torch.uint8).fill_(1)
    warm = torch.empty(snapshot_bytes[rank], dtype=torch.uint8).fill_(2)

    def memcpy() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        warm.copy_(source)
        return _slowest(time.perf_counter() - t0)

    # -- 1. saving to memory every step ------------------------------------------------------------
    every_step = []
    for r in range(args.rounds):
        order = ["plain", "save"] if r % 2 == 0 else ["save", "plain"]
        row = {"round": r, "order": order}
        for way in order:
            dist.barrier()
            if way == "plain":
                row["plain_step"] = _slowest_median([step(engine) for _ in range(args.steps)])
                continue
            steps, calls, stalls = [], [], []
            for _ in range(args.steps):
                steps.append(step(engine))
                t0 = time.perf_counter()
                handle = pd.save_checkpoint(engine, out, client_state=client, save_tier=tier, async_save=True)
                calls.append(time.perf_counter() - t0)
                stalls.append(handle.stall_s)
            ok = handle.wait()
            assert ok and not os.listdir(out), "a memory save went to OUT, not to memory"
            row["save_step"] = _slowest_median(steps)
            row["step_with_save"] = _slowest_median([s + c for s, c in zip(steps, calls)])
            row["call"] = _slowest_median(calls)
            row["stall"] = _slowest_median(stalls)
        row["memcpy"] = memcpy()
        row["step_with_save_over_plain"] = row["step_with_save"] / row["plain_step"]
        row["stall_over_memcpy"] = row["stall"] / row["memcpy"]
        row["call_over_memcpy"] = row["call"] / row["memcpy"]
        every_step.append(row)
        say(f"every step, round {r}: plain step {row['plain_step']:.2f} s, step + save call "
            f"{row['step_with_save']:.2f} s ({row['step_with_save_over_plain']:.3f}x); stall {row['stall']:.3f} s, "
            f"call {row['call']:.3f} s, memcpy {row['memcpy']:.3f} s (stall/memcpy {row['stall_over_memcpy']:.2f}, "
            f"call/memcpy {row['call_over_memcpy']:.2f})")
    del warm, source

    # -- 3. persistence (before the recovery, which needs this engine gone) -------------------------
    persistence = []
    for r in range(args.rounds):
        order = ["persist", "cp"] if r % 2 == 0 else ["cp", "persist"]
        row = {"round": r, "order": order}
        tag = f"global_step{engine.global_steps}"
        # the cp way's source, whichever way goes first (the persist way saves this tag again)
        assert pd.save_checkpoint(engine, out, client_state=client, save_tier=tier)
        for way in order:
            clear_out()
            dist.barrier()
            t0 = time.perf_counter()
            if way == "persist":
                assert pd.save_checkpoint(engine, out, client_state=client, save_tier=tier, persist=True)
                t1 = time.perf_counter()
                ok = join_persistence(engine)
                t2 = time.perf_counter()
                assert ok, "the persistence failed"
                if rank == 0:
                    assert sorted(os.listdir(out)) == sorted(["latest", tag]), os.listdir(out)
                    row["persisted_bytes"] = _size(os.path.join(out, tag))
                row["persist"] = _gather(t2 - t1)[0]  # rank 0 persists; the others have nothing to wait for
                row["memory_save"] = _slowest(t1 - t0)
                row["save_and_persist"] = _gather(t2 - t0)[0]
            else:
                seconds = None
                if rank == 0:
                    t0 = time.perf_counter()
                    subprocess.run(["cp", "-r", os.path.join(memory_folder, tag), os.path.join(out, "cp_r")],
                                   check=True)
                    seconds = time.perf_counter() - t0
                row["cp"] = _gather(seconds)[0]
            dist.barrier()
        row["persist_over_cp"] = row["persist"] / row["cp"]
        persistence.append(row)
        say(f"persistence, round {r}: {row['persist']:.2f} s after the call returned ({row['save_and_persist']:.2f} s "
            f"from the call), cp -r {row['cp']:.2f} s, persist/cp {row['persist_over_cp']:.2f}")
        step(engine)  # a new step, so the next round persists a new tag

    # -- 2. recovery: the same step in memory and, by DeepSpeed, in OUT ------------------------------
    clear_out()
    clear_tier()
    assert pd.save_checkpoint(engine, out, client_state=client, save_tier=tier)
    engine.save_checkpoint(out, client_state=client)
    saved_step = engine.global_steps
    tag = f"global_step{saved_step}"
    if rank == 0:
        for folder in (out, memory_folder):
            with open(os.path.join(folder, "latest")) as f:
                assert f.read().strip() == tag, folder
    engine.destroy()
    handle = None
    del engine
    gc.collect()
    dist.barrier()

    # what the two tiers' files cost to read, without DeepSpeed: OUT's evicted (cold), the memory copy
    reads = None
    if rank == 0:
        nbytes = _size(os.path.join(out, tag))
        resident = _evict(os.path.join(out, tag))
        cold = _read_through(os.path.join(out, tag))
        warm = _read_through(os.path.join(out, tag))
        memory = _read_through(os.path.join(memory_folder, tag))
        reads = {"bytes": nbytes, "resident_after_eviction": resident, "durable_cold_s": cold,
                 "durable_cold_gb_s": nbytes / cold / 1e9, "durable_warm_s": warm, "memory_s": memory,
                 "memory_gb_s": nbytes / memory / 1e9}
        say(f"reading the checkpoint ({nbytes / 1e9:.2f} GB) alone: OUT evicted {cold:.2f} s "
            f"({reads['durable_cold_gb_s']:.2f} GB/s), OUT again {warm:.2f} s, memory {memory:.2f} s "
            f"({reads['memory_gb_s']:.2f} GB/s)")
    dist.barrier()

    def recover(way: str) -> dict:
        fresh = make_engine()
        resident = _gather(_evict(os.path.join(out, tag)) if rank == 0 else None)[0]
        enabled = pd.enable(resume_tier=tier) if way == "memory" else None
        lines = []
        said = logging.Handler(logging.WARNING)
        said.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("pyckpt").addHandler(said)
        try:
            hooks.last_load.clear()
            dist.barrier()
            t0 = time.perf_counter()
            fresh.load_checkpoint(out)
            t1 = time.perf_counter()
            step(fresh, torch.Generator().manual_seed(1234))
            t2 = time.perf_counter()
        finally:
            logging.getLogger("pyckpt").removeHandler(said)
            if enabled is not None:
                pd.disable()
        # the memory way took the memory copy (rank 0 says so), the stock way had nothing from pyckpt
        taken = [line for line in lines if "from memory" in line]
        assert (len(taken) == 1) == (way == "memory" and rank == 0), (way, lines)
        assert fresh.global_steps == saved_step + 1, (fresh.global_steps, saved_step)
        weights = float(sum(q.detach().double().sum() for q in fresh.module.parameters())) if rank == 0 else None
        result = {"log": taken, "load": _slowest(t1 - t0), "load_and_step": _slowest(t2 - t0),
                  "step": _slowest(t2 - t1),
                  "resident_after_eviction": resident, "weights_sum": weights}
        fresh.destroy()
        del fresh
        gc.collect()
        dist.barrier()
        return result

    recovery = []
    for r in range(args.rounds):
        order = ["stock", "memory"] if r % 2 == 0 else ["memory", "stock"]
        row = {"round": r, "order": order}
        for way in order:
            row[way] = recover(way)
        row["stock_over_memory_load"] = row["stock"]["load"] / row["memory"]["load"]
        row["stock_over_memory_load_and_step"] = row["stock"]["load_and_step"] / row["memory"]["load_and_step"]
        row["same_weights"] = row["stock"]["weights_sum"] == row["memory"]["weights_sum"]
        recovery.append(row)
        say(f"recovery, round {r}: DeepSpeed's load {row['stock']['load']:.2f} s, from memory "
            f"{row['memory']['load']:.2f} s ({row['stock_over_memory_load']:.2f}x); with the first step "
            f"{row['stock']['load_and_step']:.2f} s vs {row['memory']['load_and_step']:.2f} s "
            f"({row['stock_over_memory_load_and_step']:.2f}x); OUT resident after eviction "
            f"{row['stock']['resident_after_eviction']} / {row['memory']['resident_after_eviction']} B; same weights "
            f"after the step: {row['same_weights']}")

    def med(rows, key, sub=None):
        return statistics.median(x[key][sub] if sub else x[key] for x in rows)

    medians = {
        "plain_step": med(every_step, "plain_step"), "step_with_save": med(every_step, "step_with_save"),
        "stall": med(every_step, "stall"), "call": med(every_step, "call"), "memcpy": med(every_step, "memcpy"),
        "step_with_save_over_plain": med(every_step, "step_with_save_over_plain"),
        "stall_over_memcpy": med(every_step, "stall_over_memcpy"),
        "call_over_memcpy": med(every_step, "call_over_memcpy"),
        "stock_load": med(recovery, "stock", "load"), "memory_load": med(recovery, "memory", "load"),
        "stock_load_and_step": med(recovery, "stock", "load_and_step"),
        "memory_load_and_step": med(recovery, "memory", "load_and_step"),
        "stock_over_memory_load": med(recovery, "stock_over_memory_load"),
        "stock_over_memory_load_and_step": med(recovery, "stock_over_memory_load_and_step"),
        "persist": med(persistence, "persist"), "cp": med(persistence, "cp"),
        "persist_over_cp": med(persistence, "persist_over_cp"),
    }
    goals = {k: {"goal": ("<= " if k != "stock_over_memory_load" else ">= ") + str(v), "median": medians[k],
                 "met": medians[k] >= v if k == "stock_over_memory_load" else medians[k] <= v}
             for k, v in GOALS.items()}
    memory_fs = _df(os.path.dirname(tier.root_path))
    on_rank0(lambda: shutil.rmtree(tier.root_path, ignore_errors=True))
    if rank == 0:
        result = {"params": params, "params_arg": args.params, "width": args.width, "stage": args.stage,
                  "dtype": args.dtype, "world_size": world, "cores": os.cpu_count(), "device": str(get_accelerator()
                                                                                                   .device_name()),
                  "steps_per_way": args.steps, "rounds_count": args.rounds, "keep": args.keep,
                  "bucket": args.bucket, "checkpoint_bytes": checkpoint_bytes,
                  "snapshot_bytes_per_rank": snapshot_bytes, "first_async_stall": first_stall,
                  "first_three_stalls": firsts,
                  "durable_fs": _df(out), "memory_fs": memory_fs,
                  "eviction": "os.sync, then fsync + posix_fadvise(POSIX_FADV_DONTNEED) on every file of OUT/<tag>; "
                              "resident_after_eviction is what mincore then counted (bytes)",
                  "every_step": every_step, "reads": reads, "recovery": recovery, "persistence": persistence,
                  "medians": medians, "goals": goals}
        print(json.dumps({"medians": medians, "goals": {k: v["met"] for k, v in goals.items()}}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    on_rank0(lambda: shutil.rmtree(out, ignore_errors=True))
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main())
