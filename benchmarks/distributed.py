"""Converting with several processes (torchrun): what each process reads, and the wall time, at K = 1, 2, 4.

    torchrun --standalone --nproc_per_node 4 benchmarks/make_real_checkpoint.py /tmp/bench12/z2_200M --params 200M --stage 2
    python benchmarks/distributed.py /tmp/bench12/z2_200M --rounds 3 --json benchmarks/results/distributed_z2_200M.json

Each run is ``torchrun --standalone --nproc_per_node K`` of this script's worker, which converts
the checkpoint as ``python -m pyckpt.convert`` does under torchrun (from_launcher, the cores split
among the processes, rank 0 publishing). K = 1 goes through torchrun too, so every run pays the same
start-up. Before each run the input files are flushed and evicted from the page cache and the
previous output removed, so that what a process reads comes from the disk and is counted:

- ``read_bytes`` from /proc/self/io: bytes this process had read from the storage layer (memory-mapped
  faults and readahead included, which read() counters do not see); with the cache cold, this is
  what a process on its own node would pull over the shared filesystem;
- ``planned``: the source bytes its share of the plan gathers (page-exact ranges, plus whole-file
  copies), for comparison;
- wall time: of the whole launch (outer, start-up included) and of the conversion call (inner, the
  slowest rank's, between the process group being up and the output being published).

The order of K rotates by round, and ratios are taken within a round: this machine is shared.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))  # pagecache: mincore and eviction helpers


def proc_io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f if line.strip())}


def planned_bytes(share) -> int:
    """Source bytes a share's ops gather (each op a plain byte run here) plus its whole-file copies."""
    from pyckpt.execution.executor import compile_plan

    _, _, ops, _ = compile_plan(share, "/nonexistent")
    rows = ops.tolist() if len(ops) else []
    return sum(row[5] for row in rows if row[0] >= 0) + sum(c.src.size for c in share.copies)


def worker(ckpt: str, out: str, result: str) -> None:
    from pyckpt.execution.distributed import default_workers, from_launcher, split_outputs
    from pyckpt.universal.convert import convert_to_universal

    ranks = from_launcher()
    rank, size = (ranks.rank, ranks.size) if ranks else (0, 1)
    if ranks:
        ranks.all_gather(None)  # start together: the inner time is the conversion's alone
    io0, t0 = proc_io(), time.perf_counter()
    report = convert_to_universal(ckpt, out, workers=default_workers(), ranks=ranks)
    seconds = time.perf_counter() - t0
    io1 = proc_io()
    # what this rank's share was, planned again after the timing (planning is deterministic)
    from pyckpt.zero.discovery import discover
    from pyckpt.universal.write import build_plan

    share = split_outputs(build_plan(discover(ckpt), False, False, True)[0], size)[rank]
    mine = {"rank": rank, "seconds": seconds, "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "rchar": io1["rchar"] - io0["rchar"], "planned": planned_bytes(share),
            "files": len(share.archives) + len(share.raw_files) + len(share.copies),
            "workers": default_workers()}
    every = ranks.all_gather(mine) if ranks else [mine]
    if rank == 0:
        with open(result, "w") as f:
            json.dump({"ranks": every, "bytes_written": report.bytes_written, "files": report.files}, f)
    if ranks:
        ranks.close()


def cold(files) -> None:
    from pagecache import evict

    os.sync()
    for f in files:
        evict(f)


def one_run(ckpt: str, scratch: str, k: int) -> dict:
    from pagecache import resident_bytes

    out = os.path.join(scratch, "out", "global_step1_universal")
    shutil.rmtree(os.path.join(scratch, "out"), ignore_errors=True)
    tag = os.path.join(ckpt, open(os.path.join(ckpt, "latest")).read().strip())
    files = sorted(os.path.join(tag, n) for n in os.listdir(tag))
    cold(files)
    resident = sum(resident_bytes(f) for f in files)
    result = os.path.join(scratch, f"result_{k}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(k),
           os.path.abspath(__file__), "--worker", ckpt, out, result]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    outer = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"K={k} failed:\n{proc.stderr[-4000:]}")
    with open(result) as f:
        got = json.load(f)
    got.update(k=k, outer_seconds=outer, inner_seconds=max(r["seconds"] for r in got["ranks"]),
               resident_before=resident, input_bytes=sum(os.path.getsize(f) for f in files))
    shutil.rmtree(os.path.join(scratch, "out"), ignore_errors=True)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", nargs="?", help="a checkpoint of make_real_checkpoint.py (the folder holding `latest`)")
    p.add_argument("--ks", default="1,2,4", help="process counts (default 1,2,4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scratch", default=None, help="where outputs go (default: beside the checkpoint)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", nargs=3, metavar=("CKPT", "OUT", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ckpt = os.path.abspath(args.ckpt)
    scratch = args.scratch or f"{ckpt}_distributed_bench"
    os.makedirs(scratch, exist_ok=True)
    ks = [int(k) for k in args.ks.split(",")]
    runs = []
    for r in range(args.rounds):
        order = ks[r % len(ks):] + ks[:r % len(ks)]
        for k in order:
            got = one_run(ckpt, scratch, k)
            got["round"] = r
            runs.append(got)
            per = ", ".join(f"{x['read_bytes'] / 1e9:.2f}" for x in got["ranks"])
            print(f"round {r} K={k}: {got['inner_seconds']:.2f} s inner, {got['outer_seconds']:.2f} s outer; "
                  f"GB read per process: {per} (input {got['input_bytes'] / 1e9:.2f} GB)", flush=True)
    summary = {}
    for k in ks:
        mine = [x for x in runs if x["k"] == k]
        reads = [rk["read_bytes"] for x in mine for rk in x["ranks"]]
        summary[k] = {"inner_s": sorted(x["inner_seconds"] for x in mine),
                      "outer_s": sorted(x["outer_seconds"] for x in mine),
                      "read_per_process_max_gb": max(reads) / 1e9, "read_per_process_min_gb": min(reads) / 1e9,
                      "read_total_gb_per_run": sum(reads) / len(mine) / 1e9,
                      "max_read_over_input": max(reads) / mine[0]["input_bytes"]}
    ratios = {}
    for k in ks:
        if k == 1 or 1 not in ks:
            continue
        pairs = [(a, b) for a in runs for b in runs if a["round"] == b["round"] and a["k"] == k and b["k"] == 1]
        ratios[f"inner_K{k}_over_K1"] = sorted(a["inner_seconds"] / b["inner_seconds"] for a, b in pairs)
        ratios[f"outer_K{k}_over_K1"] = sorted(a["outer_seconds"] / b["outer_seconds"] for a, b in pairs)
    result = {"checkpoint": ckpt, "cores": os.cpu_count(), "rounds": args.rounds, "runs": runs, "summary": summary,
              "ratios_within_round": ratios}
    print(json.dumps({"summary": summary, "ratios_within_round": ratios}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
