"""Scaling of pyckpt, ds_to_universal and `cp -r` against dp (fixed model) and model size (fixed dp).

    python benchmarks/scaling.py --scale dp   --params 250M --dps 4,16,64,256 --runs 3 --runs-at 256=2
    python benchmarks/scaling.py --scale size --dp 16 --sizes 125M,250M,500M,1B --runs 3 --runs-at 500M=2,1B=1
    python benchmarks/scaling.py --scale dp --plot-only      # redraw from the saved points
    python benchmarks/scaling.py --job export --scale size --dp 4 --sizes 125M,250M,500M,1B --runs 3

Every point is one `run.py --make-synthetic` run (alternating rounds, bit-equality check on the
first round), its checkpoint deleted afterwards. Points are saved as
results/points/<params>_dp<dp>_z<stage>_<dtype>.json as soon as they finish and reused unless
--rerun, so the two sweeps share their common point and an interrupted sweep resumes.
Writes results/scaling_<scale>.json, .md and .png (seconds on a log axis, peak RSS).

--job export sweeps the Hugging Face export instead (pyckpt export vs zero_to_fp32 writing the same
safetensors file vs a copy of a file of its size): points end in _export.json, results are
scaling_export_<scale>_z<stage>.*.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench  # noqa: E402
from pyckpt.testing import parse_count  # noqa: E402

# Per job: the tool measured, the tool it replaces, the copy it is held against.
JOBS = {"universal": ("pyckpt", "ds_to_universal", "cp -r"),
        "export": ("pyckpt export", "zero_to_fp32 --safe", "cp output")}
TOOLS = JOBS["universal"]
# Peak RSS targets drawn on the memory plot: the conversion's grows with the largest tensor, the
# export's is flat.
RSS_TARGET_MIB = {"universal": 512, "export": 128}


def point_path(results: Path, params: str, dp: int, stage: int, dtype: str, job: str = "universal") -> Path:
    suffix = "" if job == "universal" else f"_{job}"
    return results / "points" / f"{params}_dp{dp}_z{stage}_{dtype}{suffix}.json"


def run_point(args, params: str, dp: int, runs: int, check: bool = True) -> dict:
    path = point_path(args.results, params, dp, args.stage, args.dtype, args.job)
    if path.exists() and not args.rerun:
        print(f"reusing {path}", file=sys.stderr)
        return json.loads(path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = ["--make-synthetic", "--delete-input", "--params", params, "--dp", str(dp), "--stage", str(args.stage),
            "--dtype", args.dtype, "--runs", str(runs), "--work", str(args.work), "--tools", ",".join(args.tools),
            "--json", str(path)] + ([] if check else ["--no-check"]) + (["--export"] if args.job == "export" else [])
    print(f"== {params} dp {dp}: {runs} rounds", file=sys.stderr)
    return bench.main(argv)


def parse_runs_at(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, n = item.partition("=")
        out[key.strip().upper()] = int(n)
    return out


def table(points, scale: str, job: str = "universal") -> str:
    base, ref, copy = JOBS[job]
    head = "dp" if scale == "dp" else "params"
    lines = [f"| {head} | input GiB | files | {base} s | {ref} s | {copy} s | {ref} / {base} | {base} / {copy} "
             f"| {base} GB/s | {base} peak RSS MiB | largest tensor MiB | {ref} peak RSS MiB | {ref} temp GiB "
             f"| {base} temp GiB | rounds |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x, s in points:
        t, r = s["tools"], s["ratios"]

        def g(tool, key, fmt):
            return format(t[tool][key], fmt) if tool in t else "-"

        def ratio(key):
            return f"{r[key]['median']:.2f}" if key in r else "-"

        rounds = "/".join(str(len(t[n]["seconds"])) for n in JOBS[job] if n in t)
        if not s.get("checked_bit_equal", True):
            rounds += " (unchecked)"
        lt = s.get("largest_tensor_mib")
        lines.append(f"| {x} | {s['input_bytes'] / 2**30:.2f} | {s.get('input_files', '-')} | {g(base, 'median_s', '.2f')} "
                     f"| {g(ref, 'median_s', '.2f')} | {g(copy, 'median_s', '.2f')} "
                     f"| {ratio(f'{ref} / {base}')} | {ratio(f'{base} / {copy}')} | {g(base, 'gbps', '.2f')} "
                     f"| {g(base, 'peak_rss_mib', '.0f')} | {'-' if lt is None else f'{lt:.0f}'} "
                     f"| {g(ref, 'peak_rss_mib', '.0f')} | {g(ref, 'temp_gib', '.2f')} "
                     f"| {g(base, 'temp_gib', '.2f')} | {rounds} |")
    return "\n".join(lines)


def plot(points, scale: str, png: Path, title: str, job: str = "universal") -> None:
    import matplotlib
    matplotlib.use("Agg")  # headless: no display on the benchmark machine
    import matplotlib.pyplot as plt

    xs = [x for x, _ in points]
    xv = [int(x) for x in xs] if scale == "dp" else [parse_count(x) / 1e6 for x in xs]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for tool, style in zip(JOBS[job], ("o-", "s-", "^--")):
        ts = [(v, s["tools"][tool]) for v, (_, s) in zip(xv, points) if tool in s["tools"]]
        if not ts:
            continue
        ax_t.plot([v for v, _ in ts], [t["median_s"] for _, t in ts], style, label=tool)
        ax_m.plot([v for v, _ in ts], [t["peak_rss_mib"] for _, t in ts], style, label=tool)
    lt = [(v, s.get("largest_tensor_mib")) for v, (_, s) in zip(xv, points) if s.get("largest_tensor_mib")]
    if job == "export":
        ax_m.plot(xv, [RSS_TARGET_MIB[job]] * len(xv), "k:", label=f"target: {RSS_TARGET_MIB[job]} MiB")
    elif lt:
        ax_m.plot([v for v, _ in lt], [RSS_TARGET_MIB[job] + m for _, m in lt], "k:",
                  label=f"target: {RSS_TARGET_MIB[job]} MiB + largest tensor")
    xlabel = "data-parallel degree (ZeRO shards)" if scale == "dp" else "model parameters (millions)"
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2 if scale == "dp" else 10)
        ax.set_xticks(xv)
        ax.set_xticklabels([str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("median wall time, s (log)")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("peak RSS of the process tree, MiB (log)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=("dp", "size"), required=True)
    p.add_argument("--job", choices=tuple(JOBS), default="universal",
                   help="the Universal conversion (default) or the Hugging Face export")
    p.add_argument("--params", default="250M", help="model size of the dp sweep")
    p.add_argument("--dps", default="4,16,64,256")
    p.add_argument("--dp", type=int, default=16, help="dp of the size sweep")
    p.add_argument("--sizes", default="125M,250M,500M,1B")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--runs-at", default="", metavar="X=N,...", help="fewer rounds at some points, e.g. 256=2 or 1B=1")
    p.add_argument("--tools", default=None, help="comma list (default: the job's three tools)")
    p.add_argument("--work", type=Path, default=Path("bench-out"), help="scratch folder (big)")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--no-check-at", default="", metavar="X,...",
                   help="points timed without the bit-equality check, e.g. 1B: it holds both outputs at once "
                   "next to the input and ds_to_universal's temp files (4 copies on disk)")
    p.add_argument("--rerun", action="store_true", help="measure points even if saved")
    p.add_argument("--plot-only", action="store_true", help="only redraw from saved points")
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in (args.tools or ",".join(JOBS[args.job])).split(",")]
    runs_at = parse_runs_at(args.runs_at)
    no_check = {x.strip().upper() for x in args.no_check_at.split(",") if x.strip()}

    if args.scale == "dp":
        grid = [(str(dp), args.params, int(dp)) for dp in args.dps.split(",")]
        title = f"{args.params} params, ZeRO-{args.stage} {args.dtype}, dp swept"
    else:
        grid = [(s, s, args.dp) for s in args.sizes.split(",")]
        title = f"dp {args.dp}, ZeRO-{args.stage} {args.dtype}, model size swept"
    if args.job == "export":
        title = "Hugging Face export: " + title
    title += " (synthetic checkpoints, 2-core machine, medians of alternating rounds)"

    points = []
    for label, params, dp in grid:
        if args.plot_only:
            path = point_path(args.results, params, dp, args.stage, args.dtype, args.job)
            if path.exists():
                points.append((label, json.loads(path.read_text())))
            continue
        points.append((label, run_point(args, params, dp, runs_at.get(label.upper(), args.runs),
                                        check=label.upper() not in no_check)))

    stem = args.results / (f"scaling_{args.scale}" if args.job == "universal"
                           else f"scaling_{args.job}_{args.scale}_z{args.stage}")
    stem.with_suffix(".json").write_text(json.dumps({"title": title, "points": dict(points)}, indent=2))
    md = f"{title}\n\n{table(points, args.scale, args.job)}\n"
    stem.with_suffix(".md").write_text(md)
    plot(points, args.scale, stem.with_suffix(".png"), title, args.job)
    print(md)


if __name__ == "__main__":
    main()
