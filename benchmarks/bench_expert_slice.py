"""One EP rank's expert rows: pyckpt.read_expert_slice vs torch.load of the whole universal file.

    python benchmarks/bench_expert_slice.py --experts 64 --rows 2048 --cols 1024 --ep 8 --runs 5

A universal expert file ``{param: [E, rows, cols] fp32, is_expert_param, ep_num_experts}`` is written
once; then, alternating, each method produces rank r's ``E/ep`` experts (r cycles over the ranks):
  * torch.load      - torch.load(weights_only=True) of the file, then ``param[lo:hi].clone()``
  * torch.load mmap - torch.load(mmap=True), then ``.clone()`` of the rows (the lazy way)
  * pyckpt          - read_expert_slice(path, r, ep)
Both cold (the file evicted from the page cache with posix_fadvise before each read) and warm.
Each result is checked against the expected rows.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from pyckpt.universal.expert_slice import read_expert_slice


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--work", default="bench-out")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    path = os.path.join(args.work, "expert_fp32.pt")
    torch.manual_seed(0)
    full = torch.randn(args.experts, args.rows, args.cols)
    torch.save({"param": full, "cat_dim": 0, "is_expert_param": True, "ep_num_experts": args.experts}, path)
    size = os.path.getsize(path)
    local = args.experts // args.ep

    def torch_load(r):
        return torch.load(path, weights_only=True)["param"][r * local:(r + 1) * local].clone()

    def torch_mmap(r):
        return torch.load(path, weights_only=True, mmap=True)["param"][r * local:(r + 1) * local].clone()

    def pyckpt(r):
        return read_expert_slice(path, r, args.ep)

    methods = {"torch.load": torch_load, "torch.load mmap": torch_mmap, "pyckpt read_expert_slice": pyckpt}
    results = {}
    for cache in ("cold", "warm"):
        times = {m: [] for m in methods}
        for run in range(args.runs):
            r = run % args.ep
            names = list(methods)
            for name in names[run % len(names):] + names[:run % len(names)]:
                if cache == "cold":
                    evict(path)
                else:
                    methods[name](r)  # warm the cache for this method's access pattern
                t0 = time.perf_counter()
                got = methods[name](r)
                times[name].append(time.perf_counter() - t0)
                if not torch.equal(got, full[r * local:(r + 1) * local]):
                    raise SystemExit(f"{name} returned wrong rows")
        results[cache] = {m: statistics.median(t) for m, t in times.items()}
    summary = {"file_bytes": size, "slice_bytes": size // args.ep, "experts": args.experts, "ep": args.ep,
               "runs": args.runs, "median_seconds": results}
    print(f"expert file {size / 2**20:.0f} MiB, {args.experts} experts, ep={args.ep} "
          f"(slice {size / args.ep / 2**20:.0f} MiB), median of {args.runs}\n")
    print("| method | cold s | warm s | cold vs pyckpt | warm vs pyckpt |")
    print("|---|---:|---:|---:|---:|")
    for m in methods:
        c, w = results["cold"][m], results["warm"][m]
        pc, pw = results["cold"]["pyckpt read_expert_slice"], results["warm"]["pyckpt read_expert_slice"]
        print(f"| {m} | {c:.3f} | {w:.3f} | {c / pc:.1f}x | {w / pw:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    os.remove(path)
    return summary


if __name__ == "__main__":
    sys.exit(main() and 0)
