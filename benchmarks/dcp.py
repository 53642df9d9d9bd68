"""pyckpt's export to torch.distributed.checkpoint vs the road users take today vs a copy, alternating.

    python benchmarks/dcp.py --ckpt /tmp/z2/global_step1 --params 200M --runs 3 --json results/dcp_z2.json
    python benchmarks/dcp.py --rss-sweep 125M,250M,500M,1B --work /tmp/sweep --json results/dcp_rss.json

Tools, one run each per round in a rotating order (so a noisy machine's drift hits all alike):
- "pyckpt dcp": ``python -m pyckpt.export CKPT OUT --format dcp`` (weights and Adam state);
- "cp output": ``cp -r`` of a pyckpt DCP folder made before the rounds (the same bytes: what the export
  could at best take);
- "zero_to_fp32+fsdp2+dcp.save": benchmarks/dcp_road.py (zero_to_fp32's state dict, loaded into an FSDP2
  model, dcp.save; weights only, which is all that road keeps).
The input is read through once before the rounds and dirty pages are flushed before every run, so
each tool pays for its own writes only as far as the kernel makes it wait. The first round's outputs
are checked: pyckpt's model entries equal the road's, tensor by tensor, or no figure is reported.
--rss-sweep makes synthetic ZeRO-2 dp-4 checkpoints (pyckpt.testing, format-exact) of each size and
reports the export's peak RSS and its ratio to a copy of its output.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import folder_bytes, run_measured  # noqa: E402

PYCKPT, COPY, ROAD = "pyckpt dcp", "cp output", "zero_to_fp32+fsdp2+dcp.save"


def _sync() -> None:
    subprocess.run(["sync"], check=True)


def _read_through(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def _commands(tag_dir: Path, out: Path, src: Path, params: str, width: int) -> dict:
    py = sys.executable
    return {
        PYCKPT: [py, "-m", "pyckpt.export", str(tag_dir), str(out / "dcp"), "--format", "dcp", "--quiet"],
        COPY: ["cp", "-r", str(src), str(out / "copy")],
        ROAD: [py, str(HERE / "dcp_road.py"), str(tag_dir), str(out / "road"), "--params", params, "--width", str(width)],
    }


def _check(pyckpt_out: Path, road_out: Path, work: Path) -> None:
    """pyckpt's model entries and the road's are the same tensors (torch's own reader for both)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    a, b = work / "check_a.pt", work / "check_b.pt"
    dcp_to_torch_save(pyckpt_out, a)
    dcp_to_torch_save(road_out, b)
    x, y = torch.load(a, weights_only=False)["model"], torch.load(b, weights_only=False)["model"]
    if sorted(x) != sorted(y):
        raise SystemExit(f"check failed: model keys differ: {sorted(set(x) ^ set(y))[:5]}")
    for k in x:
        if x[k].dtype != y[k].dtype or not torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)):
            raise SystemExit(f"check failed: {k} differs")
    a.unlink()
    b.unlink()


def bench(args) -> dict:
    tag_dir = Path(args.ckpt).resolve()
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    subprocess.run([sys.executable, "-m", "pyckpt.export", str(tag_dir), str(src), "--format", "dcp", "--quiet"],
                   check=True, cwd=work)
    _read_through(tag_dir)
    tools = [PYCKPT, COPY, ROAD]
    seconds = {t: [] for t in tools}
    rss = {t: 0 for t in tools}
    out_bytes = {}
    for r in range(args.runs):
        order = tools[r % len(tools):] + tools[:r % len(tools)]
        out = work / f"round{r}"
        out.mkdir()
        cmds = _commands(tag_dir, out, src, args.params, args.width)
        for t in order:
            _sync()
            m = run_measured(cmds[t], cwd=str(work), env={**os.environ, "OMP_NUM_THREADS": "1"})
            seconds[t].append(m.seconds)
            rss[t] = max(rss[t], m.peak_rss)
            print(f"round {r} {t}: {m.seconds:.2f} s, peak RSS {m.peak_rss / 2**20:.0f} MiB", flush=True)
        out_bytes = {PYCKPT: folder_bytes(str(out / "dcp")), ROAD: folder_bytes(str(out / "road")),
                     COPY: folder_bytes(str(out / "copy"))}
        if r == 0:
            _check(out / "dcp", out / "road", work)
        shutil.rmtree(out)
    shutil.rmtree(src)
    ratios = {f"{ROAD} / {PYCKPT}": [b / a for a, b in zip(seconds[PYCKPT], seconds[ROAD])],
              f"{PYCKPT} / {COPY}": [a / b for a, b in zip(seconds[PYCKPT], seconds[COPY])]}
    return {
        "job": "dcp export",
        "checkpoint": str(tag_dir),
        "input_bytes": folder_bytes(str(tag_dir)),
        "runs": args.runs,
        "checked_model_entries_equal_to_the_road": True,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "tools": {t: {"seconds": seconds[t], "median_s": statistics.median(seconds[t]),
                      "peak_rss_mib": rss[t] / 2**20, "output_bytes": out_bytes[t]} for t in tools},
        "ratios": {k: {"per_round": v, "median": statistics.median(v)} for k, v in ratios.items()},
        "notes": {ROAD: "weights only (zero_to_fp32 keeps no optimizer state)",
                  PYCKPT: "weights and Adam state (exp_avg, exp_avg_sq, step, param groups)"},
    }


def rss_sweep(args) -> dict:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    points = []
    for size in args.rss_sweep.split(","):
        ck = work / f"z2_{size}"
        shutil.rmtree(ck, ignore_errors=True)
        subprocess.run([sys.executable, str(HERE / "make_checkpoint.py"), str(ck), "--params", size, "--dp", "4",
                        "--stage", "2"], check=True, cwd=work)
        tag = ck / (ck / "latest").read_text().strip()
        _read_through(tag)
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        _sync()
        m = run_measured([sys.executable, "-m", "pyckpt.export", str(tag), str(out / "dcp"), "--format", "dcp",
                          "--quiet"], cwd=str(work))
        _sync()
        c = run_measured(["cp", "-r", str(out / "dcp"), str(out / "copy")], cwd=str(work))
        point = {"params": size, "input_bytes": folder_bytes(str(tag)), "output_bytes": folder_bytes(str(out / "dcp")),
                 "seconds": m.seconds, "peak_rss_mib": m.peak_rss / 2**20, "copy_seconds": c.seconds,
                 "vs_copy": m.seconds / c.seconds}
        print(json.dumps(point), flush=True)
        points.append(point)
        shutil.rmtree(out)
        shutil.rmtree(ck)
    return {"job": "dcp export peak RSS sweep (synthetic ZeRO-2 fp32, dp 4)", "points": points,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="a ZeRO tag folder (e.g. made by make_real_checkpoint.py)")
    p.add_argument("--params", default="200M", help="the size make_real_checkpoint.py was given (the road's model)")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--work", default="/tmp/pyckpt-bench-dcp")
    p.add_argument("--rss-sweep", help="comma-separated sizes: peak RSS of the export at each")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()
    if not args.ckpt and not args.rss_sweep:
        p.error("give --ckpt or --rss-sweep")
    report = rss_sweep(args) if args.rss_sweep else bench(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
