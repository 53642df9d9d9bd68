"""Scale benchmark (issue 22): planning time and peak RSS against rank, file, expert and parameter count.

    python benchmarks/scale.py --sweep ranks                      # dense, dp 64..4096
    python benchmarks/scale.py --sweep experts                    # AutoEP ZeRO-2, 16..256 experts per MoE layer
    python benchmarks/scale.py --sweep layers                     # dense, 8..80 layers at dp 1024 (alias: params)
    python benchmarks/scale.py --sweep cases --before moe16x256   # dsv3, dense70b, moe16x256; old build at one point
    python benchmarks/scale.py --sweep ranks --plot-only          # redraw from results/scale_ranks.json
    python benchmarks/scale.py --sweep ranks --dps 4,8 --no-ds --runs 1 --work /tmp/s --results /tmp/s/r   # seconds

Every point is one synthetic checkpoint (make_checkpoint.py, tiny hidden size: the cost measured is
metadata, not bytes), written under --work and deleted once measured. On it, each in a fresh
process under `ulimit -n` --nofile (soft and hard, as bash's `ulimit -n 1024` sets both):

* convert --dry-run, export --dry-run: wall, CPU (user + sys, steadier than wall on a shared
  2-core machine), peak RSS; --runs rounds in rotating order, medians.
* full convert and `cp -r` of the same tag folder, alternating, each after reading the input through
  and a sync (untimed, as run.py); convert also reports the output's bytes and files; the ratio
  is per round, median.
* ds_to_universal once, with --ds-timeout; its wall or "did not finish in N s". After a sweep point
  where it did not finish, the larger points of the sweep skip it.
* at the points named by --before, convert --dry-run of the build at --pyckpt-path (PYTHONPATH),
  in the same rounds as the current build's.
* one rank's load plan and direct-resume plan (benchmarks/rank_plan.py, the middle rank of a job at
  the point's dp): the seconds it plans after its imports, and the process's wall and peak RSS.

Peak RSS comes from /usr/bin/time (the kernel's max RSS of the tool's largest process): the rusage
this script could read itself from os.wait4 would include its own RSS, which the forked child
carries until exec. The NOFILE limit is read back inside the measured process (the shell that
execs the tool) and stored with each measurement. Without /usr/bin/time, RSS is sampled every
20 ms with psutil over the process tree and marked so.

Writes results/scale_<sweep>.json (after every point, so an interrupted sweep keeps what it
measured), .md (table, and the issue's targets for the named cases) and .png (time and peak RSS,
log axes).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench  # noqa: E402
from pyckpt.testing import make_checkpoint  # noqa: E402

TIME = "/usr/bin/time"
HAS_FAMILY = "family" in inspect.signature(make_checkpoint).parameters

# The named inputs. The realistic layouts (Hugging Face names: Llama's 80 layers are 723
# parameters) are used where make_checkpoint has --family; the toy layouts have the same counts of
# layers, experts and files.
CASES = {
    "dsv3": {"toy": dict(layers=61, hidden=8, experts=256, ep=64, moe_layers=58, dp=1024, stage=2),
             "family": dict(family="deepseek", layers=61, hidden=8, ep=64, dp=1024, stage=2)},
    "dense70b": {"toy": dict(layers=80, hidden=8, dp=4096, stage=2),
                 "family": dict(family="llama", layers=80, hidden=8, dp=4096, stage=2)},
    "moe16x256": {"toy": dict(params="100M", experts=256, ep=8, moe_layers=16, dp=8, stage=2)},
}
# (what, measurement or ratio, field, comparison, limit), from the issue.
TARGETS = {
    "dsv3": [("convert --dry-run wall s", "convert_dry", "wall_s", "<=", 5.0),
             ("convert --dry-run peak RSS MiB", "convert_dry", "peak_rss_mib", "<=", 256.0),
             ("convert / cp -r", "ratios", "convert / cp -r", "<=", 1.5),
             ("one rank's load plan s", "load_plan", "plan_s", "<=", 1.0)],
    "dense70b": [("convert --dry-run wall s", "convert_dry", "wall_s", "<=", 2.0),
                 ("one rank's load plan s", "load_plan", "plan_s", "<=", 0.5)],
    "moe16x256": [("before / now, convert --dry-run wall", "ratios", "before / now dry-run wall", ">=", 20.0)],
}
SWEEPS = ("ranks", "experts", "layers", "cases")
# x axis of each sweep: the point field, its label, log base.
AXES = {"ranks": ("dp", "data-parallel ranks (ZeRO shards)", 2),
        "experts": ("experts", "experts per MoE layer", 2),
        "layers": ("tensors", "parameter tensors (dense, layers swept)", 10),
        "cases": ("input_files", "case", 10)}
DRY = ("convert_dry", "export_dry")
NAMES = {"convert_dry": "convert --dry-run", "export_dry": "export --dry-run",
         "before_dry": "before: convert --dry-run",
         "convert": "convert", "cp": "cp -r", "ds_to_universal": "ds_to_universal"}


def csv(text: str):
    return [s.strip() for s in text.split(",") if s.strip()]


def points_of(sweep: str, args) -> list:
    """Each point: a label (what --before names), and make_checkpoint's arguments."""
    small = dict(params="1M", layers=args.layers, hidden=args.hidden, stage=args.stage, dtype=args.dtype)
    # The dense sweeps measure Llama's layout (9 parameters a layer, an 80-layer model is 723 of
    # them, as the 70B case) where the generator has it; the toy layout has 2 a layer.
    dense = dict(small, family="llama") if HAS_FAMILY and args.family else small
    if sweep == "ranks":
        return [(f"dp{dp}", dict(dense, dp=int(dp))) for dp in csv(args.dps)]
    if sweep == "experts":
        return [(f"experts{e}", dict(small, layers=args.moe_layers, experts=int(e), ep=args.ep,
                                     moe_layers=args.moe_layers, dp=args.experts_dp)) for e in csv(args.experts_list)]
    if sweep == "layers":
        return [(f"layers{n}", dict(dense, layers=int(n), dp=args.layers_dp)) for n in csv(args.layers_list)]
    out = []
    for name in csv(args.cases):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r} (known: {', '.join(CASES)})")
        spec = CASES[name]
        gen = spec["family"] if HAS_FAMILY and args.family and "family" in spec else spec["toy"]
        out.append((name, dict({"params": "1B", "dtype": args.dtype}, **gen)))
    return out


def tree_rss(pid: int) -> int:
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_limited(cmd, *, env, cwd: Path, nofile: int, timeout: Optional[float] = None, sample: bool = False) -> dict:
    """One run of `cmd` under the NOFILE limit: wall, CPU, peak RSS, the limit it saw; never raises for the tool."""
    cwd.mkdir(parents=True, exist_ok=True)
    limits, usage, errors = cwd / ".scale-nofile", cwd / ".scale-time", cwd / ".scale-stderr"
    for f in (limits, usage):
        f.unlink(missing_ok=True)
    # The shell becomes the tool (exec), so the limit it prints is the tool's own.
    inner = ["sh", "-c", 'ulimit -Sn >"$0" && ulimit -Hn >>"$0" && exec "$@"', str(limits)] + [str(c) for c in cmd]
    have_time = os.access(TIME, os.X_OK)
    full = [TIME, "-f", "%e %U %S %M", "-o", str(usage)] + inner if have_time else inner

    def limit():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        n = nofile if hard == resource.RLIM_INFINITY else min(nofile, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    peak, done, timed_out = [0], threading.Event(), [False]
    with open(errors, "wb") as err:
        t0 = time.perf_counter()
        # Own session: a timeout kills exactly the group this call started (tool and its workers).
        proc = subprocess.Popen(full, env=env, cwd=str(cwd), stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=limit, start_new_session=True)

        def watch():
            while not done.wait(0.02):
                if sample or not have_time:
                    peak[0] = max(peak[0], tree_rss(proc.pid))
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    timed_out[0] = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    return

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        rc = proc.wait()
        wall = time.perf_counter() - t0
        done.set()
        th.join()
    got = limits.read_text().split() if limits.exists() else []
    out = {"wall_s": wall, "rc": rc, "nofile": [int(x) if x.isdigit() else x for x in got]}
    if timed_out[0]:
        out["status"] = f"did not finish in {timeout:g} s"
    elif rc != 0:
        tail = errors.read_text(errors="replace").strip().splitlines()[-3:]
        out["status"] = f"failed (exit {rc}): " + " | ".join(tail)
    else:
        out["status"] = "ok"
    # time writes "Command exited with non-zero status N" before the format line on failure, and
    # nothing at all when the timeout killed it along with the tool.
    last = usage.read_text().strip().splitlines()[-1:] if have_time and usage.exists() else []
    if last and len(last[0].split()) == 4:
        e, u, s, m = last[0].split()
        out.update(cpu_s=float(u) + float(s), peak_rss_mib=int(m) / 1024, rss_source="max RSS (/usr/bin/time)")
    if sample or not have_time:
        out["tree_rss_mib"] = peak[0] / 2**20
        if not have_time:
            out.update(peak_rss_mib=peak[0] / 2**20, rss_source="process tree, sampled every 20 ms")
    for f in (limits, usage, errors):
        f.unlink(missing_ok=True)
    return out


def summarize(runs: list, extra: Optional[dict] = None) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    s = {"runs": len(runs), "status": runs[-1]["status"] if not ok else "ok", "nofile": runs[0]["nofile"],
         "walls": [r["wall_s"] for r in ok], "cpus": [r.get("cpu_s") for r in ok]}
    if ok:
        s["wall_s"] = statistics.median(s["walls"])
        if all(c is not None for c in s["cpus"]):
            s["cpu_s"] = statistics.median(s["cpus"])
        if all("peak_rss_mib" in r for r in ok):
            s["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ok)
            s["rss_source"] = ok[0]["rss_source"]
        if any("tree_rss_mib" in r for r in ok):
            s["tree_rss_mib"] = max(r.get("tree_rss_mib", 0) for r in ok)
    s.update(extra or {})
    return s


def tree_size(path: Path):
    files = nbytes = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            files += 1
            nbytes += os.lstat(os.path.join(dirpath, n)).st_size
    return files, nbytes


def _rank_plan(mode: str, folder: Path, point: dict, env: dict, args) -> dict:
    """rank_plan.py in a fresh process under the NOFILE limit: the process's wall/RSS from run_limited,
    and the planning seconds it measured itself (after its imports, torch's included: a loading job
    has them already), for the middle rank of a job at the checkpoint's own dp."""
    out = args.work / f"{point['label']}.{mode}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    report = out / "plan.json"
    cmd = [sys.executable, HERE / "rank_plan.py", mode, folder, "--world", str(point["dp"]), "--stage",
           str(point["stage"]), "--json", report]
    runs = []
    for _ in range(args.runs):
        report.unlink(missing_ok=True)
        r = run_limited(cmd, env=env, cwd=out, nofile=args.nofile)
        if r["status"] == "ok" and report.exists():
            r.update(json.loads(report.read_text()))
        runs.append(r)
    got = summarize(runs)
    plans = [r["plan_s"] for r in runs if "plan_s" in r]
    if plans:
        got.update(plan_s=statistics.median(plans), params=runs[-1].get("params"), rank=runs[-1].get("rank"))
    print(f"   {mode + ' plan (one rank)':28s} {got.get('plan_s', float('nan')):.3f} s planning, "
          f"{got.get('params')} params", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    return got


def load_plan(tag_dir: Path, point: dict, env: dict, args) -> Optional[dict]:
    """One rank's universal-load plan (benchmarks/rank_plan.py load) on pyckpt's conversion of the point."""
    univ = args.work / f"{point['label']}.universal"
    shutil.rmtree(univ, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pyckpt.convert", str(tag_dir), str(univ), "--quiet"], env=env,
                   check=True, cwd=str(args.work))
    try:
        return _rank_plan("load", univ, point, env, args)
    finally:
        shutil.rmtree(univ, ignore_errors=True)
        (args.work / "latest_universal").unlink(missing_ok=True)


def resume_plan(tag_dir: Path, point: dict, env: dict, args) -> Optional[dict]:
    """One rank's direct-resume plan (benchmarks/rank_plan.py resume: the universal view of the ZeRO
    checkpoint, which every rank builds whole, then its own parameters' states)."""
    return _rank_plan("resume", tag_dir, point, env, args)


def measure_point(label: str, gen: dict, args, envs: dict, ds_state: dict) -> dict:
    root = args.work / label
    shutil.rmtree(root, ignore_errors=True)
    info: dict = {}
    if "family" in gen and not HAS_FAMILY:
        gen = {k: v for k, v in gen.items() if k != "family"}
    tag_dir = make_checkpoint(root, report=info, **gen)
    model = info["model"]
    in_files, in_bytes = tree_size(tag_dir)
    point = {"label": label, "generator": gen, "dp": gen["dp"], "stage": gen["stage"],
             "experts": gen.get("experts") or (model.layers[0].num_experts if getattr(model, "autoep", False) else 0),
             "ep": gen.get("ep", 1), "family": getattr(model, "family", "toy"), "numel": info["numel"],
             "tensors": len(model.params), "input_files": in_files, "input_bytes": in_bytes,
             "generate_s": info["seconds"], "measurements": {}, "ratios": {}}
    print(f"== {label}: {info['numel']:,} params in {point['tensors']} tensors, dp {gen['dp']}, "
          f"{in_files} files, {in_bytes / 2**20:.1f} MiB (made in {info['seconds']:.1f} s)", file=sys.stderr)
    out = args.work / f"{label}.out"
    py = sys.executable
    conv = [py, "-m", "pyckpt.convert", tag_dir, out / "u", "--quiet"]
    cmds = {"convert_dry": (conv + ["--dry-run"], envs["now"]),
            "export_dry": ([py, "-m", "pyckpt.export", tag_dir, out / "hf", "--quiet", "--dry-run"], envs["now"])}
    if label in args.before:
        cmds["before_dry"] = (conv + ["--dry-run"], envs["before"])
    m = point["measurements"]
    try:
        def one(name, **kw):
            shutil.rmtree(out, ignore_errors=True)
            cmd, env = cmds[name]
            r = run_limited(cmd, env=env, cwd=out, nofile=args.nofile, **kw)
            shown = f"{r['wall_s']:.3f} s" if r["status"] == "ok" else r["status"]
            print(f"   {NAMES[name]:28s} {shown}  RSS {r.get('peak_rss_mib', float('nan')):.0f} MiB", file=sys.stderr)
            return r

        names = list(cmds)
        runs = {n: [] for n in names}
        for r in range(args.runs):
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs[name].append(one(name))
        for name in names:
            m[name] = summarize(runs[name])
        if "before_dry" in m:
            for key, field in (("wall", "walls"), ("cpu", "cpus")):
                per = [b / n for b, n in zip(m["before_dry"][field], m["convert_dry"][field]) if b and n]
                if per:
                    point["ratios"][f"before / now dry-run {key}"] = statistics.median(per)

        if not args.dry_only:
            cmds["convert"] = ([py, "-m", "pyckpt.convert", tag_dir, out / "u", "--quiet"], envs["now"])
            cmds["cp"] = (["cp", "-r", tag_dir, out / "copy"], envs["now"])
            runs = {"convert": [], "cp": []}
            written = []
            for r in range(args.runs):
                for name in (("convert", "cp") if r % 2 == 0 else ("cp", "convert")):
                    bench.warm(tag_dir)
                    os.sync()
                    res = one(name)
                    if name == "convert" and res["status"] == "ok":
                        written.append(tree_size(out / "u"))
                    runs[name].append(res)
            files, nbytes = max(written) if written else (None, None)
            m["convert"] = summarize(runs["convert"], {"output_files": files, "output_bytes": nbytes})
            m["cp"] = summarize(runs["cp"])
            per = [c["wall_s"] / p["wall_s"] for c, p in zip(runs["convert"], runs["cp"])
                   if c["status"] == p["status"] == "ok"]
            if per:
                point["ratios"]["convert / cp -r"] = statistics.median(per)

        if args.ds:
            if ds_state.get("skip"):
                m["ds_to_universal"] = {"status": f"not run: {ds_state['skip']}"}
            else:
                cmds["ds_to_universal"] = ([py, bench.ds_converter(), "--input_folder", tag_dir, "--output_folder",
                                            out / "u"], envs["now"])
                bench.warm(tag_dir)
                os.sync()
                m["ds_to_universal"] = summarize([one("ds_to_universal", timeout=args.ds_timeout, sample=True)])
                st = m["ds_to_universal"]["status"]
                if st != "ok":
                    ds_state["skip"] = f"{st} at {label}"
                elif m.get("convert", {}).get("wall_s"):
                    ds_wall = m["ds_to_universal"]["wall_s"]
                    point["ratios"]["ds_to_universal / convert"] = ds_wall / m["convert"]["wall_s"]
        for name, hook in (("load_plan", load_plan), ("resume_plan", resume_plan)):
            got = hook(tag_dir, point, envs["now"], args)
            m[name] = got if got is not None else {"status": "not measured", "note": "hook not filled in"}
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return point


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def cell(m: dict, name: str, field: str = "wall_s", spec: str = ".3f") -> str:
    got = m.get(name)
    if got is None:
        return "-"
    if got.get(field) is None:
        return got["status"] if field == "wall_s" and got.get("status") not in (None, "ok") else "-"
    return format(got[field], spec)


def table(data: dict) -> str:
    cols = ["point", "files", "input MiB", "params", "tensors", "experts", "dp",
            "convert --dry-run s", "cpu s", "RSS MiB", "export --dry-run s", "cpu s", "RSS MiB",
            "convert s", "RSS MiB", "output MiB", "output files", "cp -r s", "convert / cp -r",
            "before --dry-run s", "before / now (wall, cpu)", "ds_to_universal s", "ds / convert", "ds RSS MiB (tree)",
            "load plan s", "resume plan s", "NOFILE"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for p in data["points"]:
        m, r = p["measurements"], p["ratios"]
        conv = m.get("convert", {})
        before = "-" if "before / now dry-run wall" not in r else \
            f"{r['before / now dry-run wall']:.1f}, {fmt(r.get('before / now dry-run cpu'), '.1f')}"
        nofile = sorted({tuple(x["nofile"]) for x in m.values() if x.get("nofile")})
        row = [p["label"], str(p["input_files"]), f"{p['input_bytes'] / 2**20:.1f}", f"{p['numel']:,}",
               str(p["tensors"]), str(p["experts"]), str(p["dp"]),
               cell(m, "convert_dry"), cell(m, "convert_dry", "cpu_s"), cell(m, "convert_dry", "peak_rss_mib", ".0f"),
               cell(m, "export_dry"), cell(m, "export_dry", "cpu_s"), cell(m, "export_dry", "peak_rss_mib", ".0f"),
               cell(m, "convert"), cell(m, "convert", "peak_rss_mib", ".0f"),
               "-" if conv.get("output_bytes") is None else f"{conv['output_bytes'] / 2**20:.1f}",
               "-" if conv.get("output_files") is None else str(conv["output_files"]),
               cell(m, "cp"), fmt(r.get("convert / cp -r")), cell(m, "before_dry"), before,
               cell(m, "ds_to_universal", spec=".2f"), fmt(r.get("ds_to_universal / convert"), ".1f"),
               f"{cell(m, 'ds_to_universal', 'peak_rss_mib', '.0f')} "
               f"({cell(m, 'ds_to_universal', 'tree_rss_mib', '.0f')})",
               cell(m, "load_plan", "plan_s"), cell(m, "resume_plan", "plan_s"), ", ".join("/".join(map(str, n)) for n in nofile) or "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def verdicts(data: dict) -> str:
    lines = []
    for p in data["points"]:
        for what, where, field, op, limit in TARGETS.get(p["label"], ()):
            v = (p["ratios"] if where == "ratios" else p["measurements"].get(where, {})).get(field)
            if v is None:
                verdict, shown = "not measured", "-"
            else:
                verdict, shown = ("met" if (v <= limit if op == "<=" else v >= limit) else "**missed**"), f"{v:.3g}"
            lines.append(f"| {p['label']} | {what} | {op} {limit:g} | {shown} | {verdict} |")
    if not lines:
        return ""
    return "\n".join(["| case | target | limit | measured | verdict |", "|---|---|---:|---:|---|"] + lines)


def flatness(data: dict) -> str:
    # "Peak RSS flat in the rank count": the spread of each planner's RSS across the sweep.
    out = []
    for name in DRY + ("convert",):
        pts = [(p["dp"], p["measurements"].get(name, {}).get("peak_rss_mib")) for p in data["points"]]
        pts = [(dp, v) for dp, v in pts if v]
        if len(pts) > 1:
            out.append(f"{NAMES[name]} peak RSS: {pts[0][1]:.0f} MiB at dp {pts[0][0]}, {pts[-1][1]:.0f} MiB at dp "
                       f"{pts[-1][0]} ({pts[-1][1] / pts[0][1]:.2f}x)")
    return "\n".join(out)


def markdown(data: dict) -> str:
    parts = [data["title"], "", table(data)]
    if data["sweep"] == "ranks" and flatness(data):
        parts += ["", flatness(data)]
    v = verdicts(data)
    if v:
        parts += ["", v]
    parts += ["", "Times are medians of the rounds (wall; cpu = user + sys); peak RSS is the largest process's, "
              "worst round. Every tool ran under `ulimit -n` (soft/hard as read inside it: NOFILE column)."]
    return "\n".join(parts) + "\n"


def plot(data: dict, png: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot (pip install -c constraints.txt matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")  # headless: no display on the benchmark machine
    import matplotlib.pyplot as plt

    key, xlabel, base = AXES[data["sweep"]]
    pts = data["points"]
    if not pts:
        return False
    cases = data["sweep"] == "cases"
    # The cases differ in every dimension at once (and two have about 4,100 files): one slot each,
    # unjoined, rather than a line through unrelated inputs.
    xs = list(range(len(pts))) if cases else [p[key] for p in pts]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"convert_dry": "o-", "export_dry": "s-", "before_dry": "v-", "convert": "D-", "cp": "^--",
              "ds_to_universal": "x-"}
    for name, style in styles.items():
        ok = [(x, p["measurements"][name]) for x, p in zip(xs, pts)
              if p["measurements"].get(name, {}).get("wall_s") is not None]
        if ok:
            style = style[0] if cases else style
            ax_t.plot([x for x, _ in ok], [m["wall_s"] for _, m in ok], style, label=NAMES[name])
            if all("peak_rss_mib" in m for _, m in ok):
                ax_m.plot([x for x, _ in ok], [m["peak_rss_mib"] for _, m in ok], style, label=NAMES[name])
    cpu = [(x, p["measurements"].get("convert_dry", {}).get("cpu_s")) for x, p in zip(xs, pts)]
    cpu = [(x, c) for x, c in cpu if c]
    if cpu:
        ax_t.plot([x for x, _ in cpu], [c for _, c in cpu], "o" if cases else "o:", color="grey",
                  label="convert --dry-run, CPU s")
    late = [x for x, p in zip(xs, pts) if p["measurements"].get("ds_to_universal", {}).get("status", "ok") != "ok"]
    if late:
        ax_t.plot(late, [data["ds_timeout_s"]] * len(late), "rx", markersize=10,
                  label=f"ds_to_universal: did not finish in {data['ds_timeout_s']:g} s (or not run)")
    for ax in (ax_t, ax_m):
        if cases:
            ax.set_xlim(-0.5, len(pts) - 0.5)
        else:
            ax.set_xscale("log", base=base)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{p['label']}\n{p['input_files']:,} files" if cases else str(x) for x, p in zip(xs, pts)])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, framealpha=0.6)
    ax_t.set_ylabel("wall time, s (median of rounds)")
    ax_m.set_ylabel("peak RSS, MiB (largest process)")
    fig.suptitle(data["title"], fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def write(data: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2))
    stem.with_suffix(".md").write_text(markdown(data))


# ----------------------------------------------------------------------------------------------


def pyckpt_location(env: dict, cwd: Path) -> str:
    # Untimed, and first: it also writes the build's bytecode cache, so no timed run compiles.
    code = "import pyckpt, pyckpt.convert, pyckpt.export; print(pyckpt.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(cwd), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pyckpt does not import with PYTHONPATH={env.get('PYTHONPATH', '')!r}:\n"
                         f"{proc.stderr[-2000:]}")
    return str(Path(proc.stdout.strip()).parent)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", default="ranks",
                   help=f"comma list of {', '.join(SWEEPS)} (params = layers); default ranks")
    p.add_argument("--dps", default="64,256,1024,4096", help="ranks sweep: dp values")
    p.add_argument("--layers", type=int, default=16, help="ranks sweep: layers of the fixed dense model")
    p.add_argument("--hidden", type=int, default=8, help="hidden size of the swept models (tiny: metadata-bound)")
    p.add_argument("--experts-list", default="16,32,64,128,256", help="experts sweep: experts per MoE layer")
    p.add_argument("--moe-layers", type=int, default=16, help="experts sweep: MoE layers (fixed)")
    p.add_argument("--ep", type=int, default=8, help="experts sweep: AutoEP size")
    p.add_argument("--experts-dp", type=int, default=64, help="experts sweep: dp")
    p.add_argument("--layers-list", default="8,16,32,64,80", help="layers sweep: layer counts")
    p.add_argument("--layers-dp", type=int, default=1024, help="layers sweep: dp")
    p.add_argument("--cases", default=",".join(CASES), help=f"cases sweep: comma list of {', '.join(CASES)}")
    p.add_argument("--no-family", dest="family", action="store_false",
                   help="the toy layouts even where make_checkpoint has --family (cases, and the dense sweeps)")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--runs", type=int, default=3, help="rounds of each pyckpt and cp measurement (default 3)")
    p.add_argument("--dry-only", action="store_true", help="skip the full convert and cp -r")
    p.add_argument("--no-ds", dest="ds", action="store_false", help="skip ds_to_universal")
    p.add_argument("--ds-timeout", type=float, default=600, help="seconds before ds_to_universal is killed (600)")
    p.add_argument("--ds-keep-going", action="store_true",
                   help="run ds_to_universal at every point, even after it did not finish at a smaller one")
    p.add_argument("--before", default="", metavar="LABEL,...",
                   help="points (e.g. moe16x256, dp1024) where the build at --pyckpt-path is measured too (dry-run)")
    p.add_argument("--pyckpt-path", type=Path, default=Path("/tmp/pyckpt_before"),
                   help="the other install (its folder goes first on PYTHONPATH) for --before")
    p.add_argument("--nofile", type=int, default=1024, help="ulimit -n of every measured process (1024)")
    p.add_argument("--work", type=Path, default=Path("/tmp/pyckpt-scale"), help="scratch folder")
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--plot-only", action="store_true", help="redraw .md and .png from the saved JSON")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    sweeps = []
    for s in csv(args.sweep):
        s = "layers" if s == "params" else s
        if s not in SWEEPS:
            raise SystemExit(f"unknown sweep {s!r} (known: {', '.join(SWEEPS)}, params)")
        sweeps.append(s)
    args.before = set(csv(args.before))
    args.work = args.work.resolve()
    if args.plot_only:
        for s in sweeps:
            stem = args.results / f"scale_{s}"
            data = json.loads(stem.with_suffix(".json").read_text())
            write(data, stem)
            plot(data, stem.with_suffix(".png"))
            print(markdown(data))
        return None

    args.work.mkdir(parents=True, exist_ok=True)
    # As run.py: tools run with their bytecode cached, as installed tools do.
    now = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    before = dict(now, PYTHONPATH=os.pathsep.join(filter(None, [str(args.pyckpt_path), now.get("PYTHONPATH")])))
    envs = {"now": now, "before": before}
    where = {"now": pyckpt_location(now, args.work)}
    if args.before:
        where["before"] = pyckpt_location(before, args.work)
        if where["before"] == where["now"]:
            raise SystemExit(f"--pyckpt-path {args.pyckpt_path} imports the same pyckpt as the current build")
    if args.ds:
        bench.ds_converter()  # fail before the first point, not after it
    results = []
    for s in sweeps:
        stem = args.results / f"scale_{s}"
        data = {"sweep": s, "title": "", "points": [], "runs": args.runs, "nofile": args.nofile,
                "ds_timeout_s": args.ds_timeout if args.ds else None, "pyckpt": where,
                "family_layouts": HAS_FAMILY and args.family,
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "date": time.strftime("%Y-%m-%d %H:%M")}
        data["title"] = (f"pyckpt scale benchmark, sweep {s}: synthetic ZeRO-{args.stage} {args.dtype} checkpoints, "
                         f"ulimit -n {args.nofile}, {args.runs} round(s), {os.cpu_count()} CPUs")
        ds_state: dict = {}
        for label, gen in points_of(s, args):
            data["points"].append(measure_point(label, gen, args, envs, ds_state if not args.ds_keep_going else {}))
            write(data, stem)
        plot(data, stem.with_suffix(".png"))
        print(markdown(data))
        results.append(data)
    return results


if __name__ == "__main__":
    main()
