"""The least time any restore of ZeRO-2 fp32 Adam from memory can take on this machine: the bytes it must
write, copied by the kernel from tmpfs at once on every rank, with nothing else done.

    python benchmarks/restore_floor.py --params 100M --nproc 2

A restarted rank holds its engine's buffers (touched when the engine was built) and no optimizer state yet
(torch's Adam makes its moments at its first step). Whatever a restore does, each rank must write at least:

- its flat fp32 partition: 4 P / W bytes, into memory it holds;
- the whole model's weights: 4 P bytes, into memory it holds (DeepSpeed's all-gather writes them too);
- its two Adam moments: 8 P / W bytes, into memory it allocates then (the first touch of every page).

Here W processes do only that, side by side: each reads those bytes with ``pread`` (one thread per core,
64 MiB calls, as the tier's restore reads a slot) from one tmpfs file they share (a checkpoint's bytes, read
by every rank, as the model's weights are), into a buffer it filled before (the partition and the weights)
and into one it allocates inside the timed part (the moments). The figure is the slowest rank's time, the
median of ``--repeats``: a floor for the load of pyckpt's memory tier, and for a multiple of another load.
It does no training and no pickling; its copy runs at the machine's memory bandwidth and the VM's cost of a
page touched first (benchmarks/README.md, "The restore read by the kernel").

memory_vs_dlrover.py measures it in every round, after pyckpt's restart and while that way's tier still
holds its two slots, so that the floor runs with the memory in use that pyckpt's load had.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 64 << 20


def rank_bytes(params: int, world: int) -> dict:
    """What one rank of ``world`` must write to restore ``params`` fp32 parameters with their Adam moments."""
    part = -(-params // world) * 4  # DeepSpeed pads the flat buffer to a multiple of the world size
    return {"held": part + 4 * params, "fresh": 2 * part}


def _read_into(fd: int, view: memoryview, threads: int) -> None:
    """``view`` filled from the file's start, 64 MiB per call, ``threads`` calls at a time."""
    spans = [(i, min(CHUNK, len(view) - i)) for i in range(0, len(view), CHUNK)]

    def one(span):
        at, n = span
        done = 0
        while done < n:
            got = os.preadv(fd, [view[at + done:at + n]], at + done)
            if got <= 0:
                raise OSError(f"short read at {at + done}")
            done += got

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, spans))


def _rank(path: str, sizes: dict, repeats: int, threads: int, barrier, out) -> None:
    import numpy as np

    fd = os.open(path, os.O_RDONLY)
    held = np.ones(sizes["held"], dtype=np.uint8)  # the engine's buffers, touched when it was built
    times = []
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        _read_into(fd, memoryview(held), threads)
        fresh = np.empty(sizes["fresh"], dtype=np.uint8)  # the moments: a new mapping, no page touched yet
        _read_into(fd, memoryview(fresh), threads)
        times.append(time.perf_counter() - t0)
        del fresh  # unmapped: the next repeat touches new pages again
        barrier.wait()
    os.close(fd)
    out.put(times)


def floor(params: int, world: int, repeats: int = 3, threads: int = 0, shm: str = "/dev/shm") -> dict:
    """The floor's figures: per-rank bytes, each repeat's slowest rank, their median (seconds)."""
    sizes = rank_bytes(params, world)
    threads = threads or max(1, os.cpu_count() or 1)
    path = os.path.join(shm, f"pyckpt-restore-floor-{os.getpid()}")
    procs = []
    try:
        with open(path, "wb") as f:  # the source's pages in tmpfs, as a slot's are
            block = os.urandom(1 << 20) * 64
            left = max(sizes["held"], sizes["fresh"])
            while left > 0:
                left -= f.write(block[:min(left, len(block))])
        ctx = mp.get_context("fork")
        barrier, out = ctx.Barrier(world), ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(path, sizes, repeats, threads, barrier, out)) for _ in range(world)]
        for p in procs:
            p.start()
        per_rank = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"a floor rank failed (exit {p.exitcode})")
    finally:
        for p in procs:  # a rank that failed leaves the others at the barrier: none outlives the call
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(path):
            os.remove(path)
    slowest = [max(r[i] for r in per_rank) for i in range(repeats)]
    return {"params": params, "world": world, "threads_per_rank": threads, "held_bytes_per_rank": sizes["held"],
            "fresh_bytes_per_rank": sizes["fresh"], "repeats": slowest, "median": statistics.median(slowest)}


def main() -> int:
    sys.path.insert(0, HERE)
    from make_real_checkpoint import parse_count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="100M", help="parameter count (suffix K/M/B)")
    p.add_argument("--nproc", type=int, default=2, help="ranks, one process each")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="reading threads per rank (0: one per core)")
    p.add_argument("--shm", default="/dev/shm", help="the folder of the source file (a tmpfs, as the slots')")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    got = floor(parse_count(a.params), a.nproc, a.repeats, a.threads, a.shm)
    print(json.dumps(got, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
