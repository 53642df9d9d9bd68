"""Should the snapshot arena *be* the memory checkpoint? (issue 37, "no second copy")

    python benchmarks/memory_arena.py --gb 1.2 --rounds 5 --json benchmarks/results/memory_arena.json

An asynchronous save to the memory tier copies each storage twice today: into the snapshot arena (warm
host buffers the save reuses; training waits for this copy: the stall) and, in the background, from
the arena into the checkpoint's files on the tmpfs. The alternative is one copy: the snapshot goes
straight into the files, mmap'd. Three ways, the same bytes (``--gb`` of float32 tensors, 64 MiB
each, the shape of a rank's optimizer state), each round in rotating order:

* ``arena``: the stall is a copy into a warm arena (allocated and touched once, before the rounds);
  the background is a write(2) of the arena into a new tmpfs file. Both timed.
* ``mmap_cold``: the stall is creating the tmpfs file, sizing it, mapping it and copying into it: the
  kernel allocates and zeroes each page on first touch, inside the stall. No background part.
* ``mmap_reused``: a file of the same size whose pages the tier already holds (a retired checkpoint's,
  recycled as the next one's instead of removed) is mapped with MAP_POPULATE (timed apart) and the
  snapshot copied into it: what a save that recycles retired checkpoints' files would pay.
* ``mmap_ready``: the file is created, allocated (``posix_fallocate``) and mapped with MAP_POPULATE
  beforehand (as a save could prepare the next checkpoint's files in the background, sizes known from
  the previous save); the stall is the copy alone. The preparation is timed apart.

Single process, one copy thread (torch's ``copy_`` on CPU, set to 1 thread), as a rank's snapshot
runs; the tmpfs is ``--dir`` (default /dev/shm). Ratios are within a round.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    chunk = 16 << 20  # float32 elements: 64 MiB
    count = max(1, round(args.gb * 1e9 / (chunk * 4)))
    sources = [torch.randn(chunk) for _ in range(count)]
    nbytes = count * chunk * 4
    arena = torch.empty(count * chunk)
    arena.fill_(1.0)  # allocated and touched: warm, as the second save's arena is
    folder = os.path.join(args.dir, f"pyckpt-arena-bench-{os.getpid()}")
    os.makedirs(folder, mode=0o700)

    def copy_into(flat) -> None:
        for i, s in enumerate(sources):
            flat[i * chunk:(i + 1) * chunk].copy_(s)

    def way_arena(n: int) -> dict:
        t0 = time.perf_counter()
        copy_into(arena)
        t1 = time.perf_counter()
        path = os.path.join(folder, f"a{n}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        view = memoryview(arena.numpy()).cast("B")
        done = 0
        while done < nbytes:
            done += os.write(fd, view[done:done + (64 << 20)])
        os.close(fd)
        t2 = time.perf_counter()
        os.unlink(path)
        return {"stall": t1 - t0, "background": t2 - t1}

    def mapped(path: str, populate: bool):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if populate:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        m = mmap.mmap(fd, nbytes, flags=flags)
        os.close(fd)
        return m, torch.frombuffer(m, dtype=torch.float32)

    def way_mmap_cold(n: int) -> dict:
        path = os.path.join(folder, f"c{n}")
        t0 = time.perf_counter()
        m, flat = mapped(path, populate=False)
        copy_into(flat)
        t1 = time.perf_counter()
        del flat
        m.close()
        os.unlink(path)
        return {"stall": t1 - t0, "background": 0.0}

    def way_mmap_ready(n: int) -> dict:
        path = os.path.join(folder, f"r{n}")
        t0 = time.perf_counter()
        m, flat = mapped(path, populate=True)
        t1 = time.perf_counter()
        copy_into(flat)
        t2 = time.perf_counter()
        del flat
        m.close()
        os.unlink(path)
        return {"stall": t2 - t1, "prepare": t1 - t0, "background": 0.0}

    reused_path = os.path.join(folder, "reused")
    m0, _ = mapped(reused_path, populate=True)  # a retired checkpoint's file, its pages already the tier's
    m0.close()

    def way_mmap_reused(n: int) -> dict:
        t0 = time.perf_counter()
        fd = os.open(reused_path, os.O_RDWR)
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.close(fd)
        flat = torch.frombuffer(m, dtype=torch.float32)
        t1 = time.perf_counter()
        copy_into(flat)
        t2 = time.perf_counter()
        del flat
        m.close()
        return {"stall": t2 - t1, "prepare": t1 - t0, "background": 0.0}

    ways = {"arena": way_arena, "mmap_cold": way_mmap_cold, "mmap_ready": way_mmap_ready,
            "mmap_reused": way_mmap_reused}
    names = list(ways)
    rows = []
    try:
        for n in range(args.rounds):
            order = names[n % len(names):] + names[:n % len(names)]
            row = {"round": n, "order": order}
            for name in order:
                row[name] = ways[name](n)
            rows.append(row)
            print(f"round {n}: arena stall {row['arena']['stall']:.3f} s + background write "
                  f"{row['arena']['background']:.3f} s; mmap cold stall {row['mmap_cold']['stall']:.3f} s; mmap "
                  f"ready stall {row['mmap_ready']['stall']:.3f} s (prepared in {row['mmap_ready']['prepare']:.3f} s); a "
                  f"reused file's stall {row['mmap_reused']['stall']:.3f} s (mapped in {row['mmap_reused']['prepare']:.3f} s)",
                  flush=True)
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)

    def med(way, key):
        return statistics.median(r[way][key] for r in rows)

    medians = {"bytes": nbytes, "arena_stall": med("arena", "stall"), "arena_background": med("arena", "background"),
               "mmap_cold_stall": med("mmap_cold", "stall"), "mmap_ready_stall": med("mmap_ready", "stall"),
               "mmap_ready_prepare": med("mmap_ready", "prepare"), "mmap_reused_stall": med("mmap_reused", "stall"),
               "mmap_reused_prepare": med("mmap_reused", "prepare")}
    medians["mmap_cold_over_arena_stall"] = statistics.median(r["mmap_cold"]["stall"] / r["arena"]["stall"]
                                                              for r in rows)
    medians["mmap_ready_over_arena_stall"] = statistics.median(r["mmap_ready"]["stall"] / r["arena"]["stall"]
                                                               for r in rows)
    medians["arena_total_over_mmap_ready_total"] = statistics.median(
        (r["arena"]["stall"] + r["arena"]["background"]) / (r["mmap_ready"]["stall"] + r["mmap_ready"]["prepare"])
        for r in rows)
    medians["mmap_reused_over_arena_stall"] = statistics.median(r["mmap_reused"]["stall"] / r["arena"]["stall"]
                                                                for r in rows)
    medians["arena_total_over_mmap_reused_total"] = statistics.median(
        (r["arena"]["stall"] + r["arena"]["background"]) / (r["mmap_reused"]["stall"] + r["mmap_reused"]["prepare"])
        for r in rows)
    print(json.dumps(medians), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gb_arg": args.gb, "rounds": rows, "medians": medians, "cores": os.cpu_count(),
                       "dir": args.dir}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
