"""pyckpt vs DeepSpeed's ds_to_universal.py vs `cp -r`, alternating, on one checkpoint.

    python benchmarks/run.py --make --params 200M --dp 4 --runs 3     # make a real DeepSpeed checkpoint first
    python benchmarks/run.py --ckpt path/to/global_step1 --runs 3     # or use an existing one

Each round runs every tool once, in a rotating order, so drift on a noisy machine hits all tools
alike; the report gives medians and the per-round ratios (pyckpt vs each other tool in the same
round), peak RSS of each tool's whole process tree, and the peak disk usage of its output folder
(ds_to_universal's temp files show there). The first pyckpt output is checked against DeepSpeed's,
tensor by tensor, before any number is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from measure import folder_bytes, run_measured  # noqa: E402


def ds_converter() -> str:
    import deepspeed
    return os.path.join(os.path.dirname(deepspeed.__file__), "checkpoint", "ds_to_universal.py")


def tools(tag_dir: Path, out: Path):
    py = sys.executable
    return {
        "pyckpt": ([py, "-m", "pyckpt.convert", str(tag_dir), str(out / "u"), "--quiet"], out),
        "ds_to_universal": ([py, ds_converter(), "--input_folder", str(tag_dir), "--output_folder", str(out / "u")],
                            out),
        "cp -r": (["cp", "-r", str(tag_dir), str(out / "copy")], out),
    }


def make_checkpoint(root: Path, params: str, dp: int, stage: int, dtype: str) -> Path:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={dp}",
           str(HERE / "make_real_checkpoint.py"), str(root), "--params", params, "--stage", str(stage),
           "--dtype", dtype]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    print(f"made checkpoint in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    tag = (root / "latest").read_text().strip()
    return root / tag


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, help="tag folder of an existing ZeRO checkpoint")
    p.add_argument("--make", action="store_true", help="make a real DeepSpeed checkpoint first")
    p.add_argument("--params", default="200M")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("bench-out"), help="scratch folder (big)")
    p.add_argument("--tools", default="pyckpt,ds_to_universal,cp -r")
    p.add_argument("--json", type=Path, default=None, help="result file (default: <work>/result.json)")
    p.add_argument("--no-check", action="store_true", help="skip the tensor-by-tensor check")
    args = p.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    if args.make:
        root = args.work / f"ckpt_{args.params}_dp{args.dp}_z{args.stage}_{args.dtype}"
        tag_dir = make_checkpoint(root, args.params, args.dp, args.stage, args.dtype) if not (
            root / "latest").exists() else root / (root / "latest").read_text().strip()
    elif args.ckpt:
        tag_dir = args.ckpt
    else:
        p.error("--ckpt or --make is required")
    in_bytes = folder_bytes(str(tag_dir))
    names = [t.strip() for t in args.tools.split(",")]

    if not args.no_check and {"pyckpt", "ds_to_universal"} <= set(names):
        from compare import diff_folders
        chk = args.work / "check"
        shutil.rmtree(chk, ignore_errors=True)
        for name in ("pyckpt", "ds_to_universal"):
            cmd, _ = tools(tag_dir, chk / name)[name]
            (chk / name).mkdir(parents=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        diffs = diff_folders(str(chk / "ds_to_universal" / "u"), str(chk / "pyckpt" / "u"))
        if diffs:
            raise SystemExit("pyckpt output differs from DeepSpeed's:\n" + "\n".join(diffs[:20]))
        print("check: pyckpt output is bit-equal to ds_to_universal's", file=sys.stderr)
        shutil.rmtree(chk)

    results = {n: [] for n in names}
    for r in range(args.runs):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            out = args.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            cmd, watch = tools(tag_dir, out)[name]
            m = run_measured(cmd, watch_dir=str(watch))
            results[name].append(m)
            print(f"round {r}: {name:16s} {m.seconds:8.2f} s  peak RSS {m.peak_rss / 2**20:8.0f} MiB  "
                  f"peak disk {m.peak_disk / 2**30:6.2f} GiB", file=sys.stderr)
            shutil.rmtree(out, ignore_errors=True)

    summary = {
        "checkpoint": str(tag_dir),
        "input_bytes": in_bytes,
        "runs": args.runs,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "tools": {},
        "ratios": {},
    }
    for name, ms in results.items():
        summary["tools"][name] = {
            "seconds": [m.seconds for m in ms],
            "median_s": median([m.seconds for m in ms]),
            "gbps": in_bytes / median([m.seconds for m in ms]) / 1e9,
            "peak_rss_mib": max(m.peak_rss for m in ms) / 2**20,
            "peak_disk_gib": max(m.peak_disk for m in ms) / 2**30,
        }
    if "pyckpt" in results:
        for other in names:
            if other == "pyckpt":
                continue
            per_round = [o.seconds / p_.seconds for o, p_ in zip(results[other], results["pyckpt"])]
            summary["ratios"][f"{other} / pyckpt"] = {"per_round": per_round, "median": median(per_round)}
    out_json = args.json or (args.work / "result.json")
    out_json.write_text(json.dumps(summary, indent=2))
    print(markdown(summary))
    return summary


def markdown(s) -> str:
    lines = [f"Input: `{s['checkpoint']}` ({s['input_bytes'] / 2**30:.2f} GiB), {s['runs']} alternating rounds, "
             f"{s['machine']['cpus']} CPUs.", "",
             "| tool | median s | GB/s (input) | peak RSS MiB | peak disk GiB |", "|---|---:|---:|---:|---:|"]
    for name, t in s["tools"].items():
        lines.append(f"| {name} | {t['median_s']:.2f} | {t['gbps']:.2f} | {t['peak_rss_mib']:.0f} | "
                     f"{t['peak_disk_gib']:.2f} |")
    if s["ratios"]:
        lines += ["", "| ratio (same round) | per round | median |", "|---|---|---:|"]
        for k, v in s["ratios"].items():
            lines.append(f"| {k} | {', '.join(f'{x:.2f}' for x in v['per_round'])} | {v['median']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
