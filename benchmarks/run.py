"""pyckpt vs DeepSpeed's ds_to_universal.py vs zero_to_fp32 vs `cp -r`, alternating, on one checkpoint.

    python benchmarks/run.py --quick                                        # smoke run, seconds (CI)
    python benchmarks/run.py --make-synthetic --params 250M --dp 64 --runs 3 # synthetic, format-exact
    python benchmarks/run.py --make --params 200M --dp 4 --runs 3           # a real DeepSpeed save first
    python benchmarks/run.py --ckpt path/to/global_step1 --runs 3           # or an existing checkpoint
    python benchmarks/run.py --ckpt path/to/global_step1 --export           # the Hugging Face export instead
    python benchmarks/run.py --ckpt ... --before /tmp/pyckpt_old            # and an older build, same rounds

Each round runs every tool once, in a rotating order, so drift on a noisy machine hits all tools
alike; the report gives medians and the per-round ratios (pyckpt vs each other tool in the same
round), GB/s of input, peak RSS of each tool's whole process tree, and the peak disk usage of its
output folder against what it finally leaves there (the difference is temp files: ds_to_universal
keeps its slice files under OUTPUT/tmp until the merge ends). pyckpt's first output is checked
against DeepSpeed's, tensor by tensor; a mismatch aborts the run before any number is reported.
Before every timed run the input is read through and dirty pages are flushed (both untimed), so
each tool starts from a warm input and pays for its own writes only as far as the kernel makes it
wait, not for the previous tool's (--cold, --no-sync to skip).

zero_to_fp32 is a different job (one consolidated fp32 weights file, no optimizer state), so it is
reported for scale but its ratio is labelled as such. It is DeepSpeed's
``convert_zero_checkpoint_to_fp32_state_dict`` called without ``max_shard_size``: the script's CLI
always passes its 5GB default, which imports huggingface_hub, not a dependency here.
"""

from __future__ import annotations

import argparse
import filecmp
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
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))  # compare: the bit-equality check

from measure import folder_bytes, run_measured  # noqa: E402

ALL_TOOLS = ("pyckpt", "ds_to_universal", "zero_to_fp32", "cp -r")
# --export: the consolidated export against zero_to_fp32 writing the same safetensors file, and a
# copy of a file of that file's size (what the export could at best take).
EXPORT_TOOLS = ("pyckpt export", "zero_to_fp32 --safe", "cp output")
# Ratios of tools that produce a different thing than the tool measured.
DIFFERENT_JOB = {"zero_to_fp32": "fp32 weights only", "cp -r": "copy", "cp output": "copy of the output's size"}

ZERO_TO_FP32 = ("import sys\n"
                "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c\n"
                "c(sys.argv[1], sys.argv[2], max_shard_size=None, tag=sys.argv[3], "
                "safe_serialization=sys.argv[4:] == ['safe'])\n")


def ds_converter() -> str:
    import deepspeed
    return os.path.join(os.path.dirname(deepspeed.__file__), "checkpoint", "ds_to_universal.py")


BEFORE = " (before)"


def tools(tag_dir: Path, out: Path, work: Path = None, before: Path = None):
    py = sys.executable
    found = {
        "pyckpt export": ([py, "-m", "pyckpt.export", str(tag_dir), str(out / "hf"), "--quiet"], out),
        "zero_to_fp32 --safe": ([py, "-c", ZERO_TO_FP32, str(tag_dir.parent), str(out / "hf"), tag_dir.name, "safe"],
                                out),
        "cp output": (["cp", str((work or out) / "export_src" / "model.safetensors"), str(out / "copy")], out),
        "pyckpt": ([py, "-m", "pyckpt.convert", str(tag_dir), str(out / "u"), "--quiet"], out),
        "ds_to_universal": ([py, ds_converter(), "--input_folder", str(tag_dir), "--output_folder", str(out / "u")],
                            out),
        "zero_to_fp32": ([py, "-c", ZERO_TO_FP32, str(tag_dir.parent), str(out / "fp32"), tag_dir.name], out),
        "cp -r": (["cp", "-r", str(tag_dir), str(out / "copy")], out),
    }
    if before is not None:
        # an older build (pip install --target BEFORE), imported ahead of the installed one
        for name in ("pyckpt", "pyckpt export"):
            cmd, watch = found[name]
            found[name + BEFORE] = (["env", f"PYTHONPATH={before}"] + cmd, watch)
    return found


def is_autoep(tag_dir: Path) -> bool:
    # zero_to_fp32 knows nothing of AutoEP's expert group; the per-expert files give such a save away.
    return any(tag_dir.glob("*_expert_*"))


def is_tensor_parallel(tag_dir: Path) -> bool:
    # zero_to_fp32 merges no tp slices; a second model-parallel rank's files give tp/pp away.
    return any(tag_dir.glob("*mp_rank_01*"))


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


def make_synthetic(root: Path, args) -> Path:
    from pyckpt.testing import make_checkpoint as synth
    if (root / "latest").exists():
        return root / (root / "latest").read_text().strip()
    info: dict = {}
    tag_dir = synth(root, params=args.params, dp=args.dp, stage=args.stage, dtype=args.dtype, experts=args.experts,
                    ep=args.ep, moe_layers=args.moe_layers, tp=args.tp, report=info)
    print(f"made synthetic checkpoint: {info['numel']:,} params, {info['files']} files, "
          f"{info['bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s", file=sys.stderr)
    return tag_dir


def warm(tag_dir: Path) -> None:
    # Every tool starts from the same page-cache state: the whole input cached. Without this the
    # first tool of round 0 reads what the generator's writes left behind, the others what it read.
    buf = bytearray(8 << 20)
    for f in sorted(tag_dir.iterdir()):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def evict(folder: Path) -> None:
    # The outputs kept for the check would otherwise fill the page cache for the rest of round 0,
    # and whoever writes next pays for reclaiming it (cp -r ran 3x slower there).
    os.sync()
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def parse_max_runs(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, n = item.rpartition("=")
        out[name.strip()] = int(n)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("input (one of)")
    src.add_argument("--ckpt", type=Path, help="tag folder of an existing ZeRO checkpoint")
    src.add_argument("--make", action="store_true", help="make a real DeepSpeed checkpoint first (torchrun, slow)")
    src.add_argument("--make-synthetic", action="store_true",
                     help="make a synthetic one with make_checkpoint.py (format-exact, seconds)")
    src.add_argument("--quick", action="store_true",
                     help="smoke run: tiny synthetic checkpoint, 1 round, every tool (CI)")
    p.add_argument("--params", default="200M")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--tp", type=int, default=1, help="synthetic tensor-parallel degree (Megatron-style layout)")
    p.add_argument("--experts", type=int, default=0, help="synthetic AutoEP experts per MoE layer (0: dense)")
    p.add_argument("--ep", type=int, default=1, help="synthetic AutoEP size")
    p.add_argument("--moe-layers", type=int, default=0, help="synthetic MoE layers (default 2 with --experts)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-runs", default="", metavar="TOOL=N,...",
                   help="fewer rounds for slow tools, e.g. ds_to_universal=1; ratios use the shared rounds")
    p.add_argument("--work", type=Path, default=Path("bench-out"), help="scratch folder (big)")
    p.add_argument("--tools", default=None,
                   help="comma list (default: every tool of the job); zero_to_fp32 is dropped for AutoEP and "
                   "tensor-parallel checkpoints")
    p.add_argument("--export", action="store_true",
                   help="measure the consolidated export (pyckpt export vs zero_to_fp32 writing safetensors vs a copy "
                   "of a file of the output's size) instead of the universal conversion")
    p.add_argument("--json", type=Path, default=None, help="result file (default: <work>/result.json)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    p.add_argument("--before", type=Path, default=None,
                   help="also time the pyckpt build installed in this folder (pip install --target), in the same "
                   "rounds: a before/after comparison of the tool itself")
    p.add_argument("--no-check", action="store_true", help="skip the tensor-by-tensor check")
    p.add_argument("--cold", action="store_true", help="do not read the input through before each timed run")
    p.add_argument("--no-sync", action="store_true", help="do not flush dirty pages before each timed run")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed `cp -r` copies of the input before round 0 (default 1)")
    p.add_argument("--delete-input", action="store_true", help="delete a made checkpoint at the end")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    # Tools are measured as installed, with their modules' bytecode cached: an environment that
    # disables writing it would make each pyckpt run recompile its sources (tens of ms), which
    # site-packages installs (DeepSpeed's, torch's) never pay. The untimed runs before round 0 fill the cache.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.quick:
        # Small enough for seconds, but still dp 4 with padding, so every code path runs.
        args.make_synthetic, args.params, args.runs, args.delete_input = True, "2M", 1, True

    # Absolute, because the tools run with the work folder as their cwd (see run_measured).
    args.work = args.work.resolve()
    if args.ckpt:
        args.ckpt = args.ckpt.resolve()
    if args.before is not None:
        args.before = args.before.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    made = None
    if args.make:
        made = args.work / f"ckpt_{args.params}_dp{args.dp}_z{args.stage}_{args.dtype}"
        tag_dir = make_checkpoint(made, args.params, args.dp, args.stage, args.dtype) if not (
            made / "latest").exists() else made / (made / "latest").read_text().strip()
    elif args.make_synthetic:
        moe = (f"_e{args.experts}ep{args.ep}" if args.experts else "") + (f"_tp{args.tp}" if args.tp > 1 else "")
        made = args.work / f"syn_{args.params}_dp{args.dp}_z{args.stage}_{args.dtype}{moe}"
        tag_dir = make_synthetic(made, args)
    elif args.ckpt:
        tag_dir = args.ckpt
    else:
        p.error("--ckpt, --make, --make-synthetic or --quick is required")
    try:
        return run(args, tag_dir)
    finally:
        if made is not None and args.delete_input:
            shutil.rmtree(made, ignore_errors=True)


def run(args, tag_dir: Path):
    in_bytes = folder_bytes(str(tag_dir))
    base, reference = ("pyckpt export", "zero_to_fp32 --safe") if args.export else ("pyckpt", "ds_to_universal")
    default = EXPORT_TOOLS if args.export else ALL_TOOLS
    names = [t.strip() for t in (args.tools or ",".join(default)).split(",") if t.strip()]
    if args.before is not None and base + BEFORE not in names:
        names.insert(1, base + BEFORE)
    skipped = {}
    for z in ("zero_to_fp32", "zero_to_fp32 --safe"):
        if z in names and is_autoep(tag_dir):
            names.remove(z)
            skipped[z] = "AutoEP checkpoint"
        elif z in names and is_tensor_parallel(tag_dir):
            names.remove(z)
            skipped[z] = "tensor-parallel checkpoint"
    max_runs = parse_max_runs(args.max_runs)
    check = not args.no_check and {base, reference} <= set(names)
    if args.export:
        # The copy's source: one export, untimed (the file the tools write, at its size).
        src = args.work / "export_src"
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pyckpt.export", str(tag_dir), str(src), "--quiet"], check=True,
                       cwd=str(args.work))
    keep = args.work / "check"
    shutil.rmtree(keep, ignore_errors=True)
    # Untimed: caches pyckpt's bytecode (see main) before its first timed run.
    subprocess.run([sys.executable, "-c", "import pyckpt.universal.convert, pyckpt.huggingface.export"], check=True,
                   cwd=str(args.work))
    if args.before is not None:
        subprocess.run(["env", f"PYTHONPATH={args.before.resolve()}", sys.executable, "-c",
                        "import pyckpt.convert, pyckpt.export"], check=True, cwd=str(args.work))

    # The first big write after the checkpoint was made runs 1.4-2.5x slower for any tool (8 GB, seen
    # for pyckpt and cp alike); an untimed copy absorbs it instead of whichever tool goes first.
    for _ in range(args.warmup):
        out = args.work / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        subprocess.run(["cp", "-r", str(tag_dir), str(out / "copy")], check=True)
        shutil.rmtree(out)
        os.sync()

    largest = 0
    results = {n: [] for n in names}
    finals = {n: [] for n in names}
    for r in range(args.runs):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if r >= max_runs.get(name, args.runs):
                continue
            out = args.work / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            cmd, watch = tools(tag_dir, out, args.work, args.before)[name]
            if not args.cold:
                warm(tag_dir)
            if not args.no_sync:
                # Untimed: otherwise the previous tool's GBs of dirty pages are written back while
                # the next one runs, and whoever follows the biggest writer looks slow.
                os.sync()
            m = run_measured(cmd, watch_dir=str(watch), cwd=str(args.work))
            results[name].append(m)
            finals[name].append(folder_bytes(str(out)))
            print(f"round {r}: {name:16s} {m.seconds:8.2f} s  peak RSS {m.peak_rss / 2**20:8.0f} MiB  "
                  f"peak disk {m.peak_disk / 2**30:6.2f} GiB", file=sys.stderr)
            if check and r == 0 and name in (base, reference):
                # The check reuses the first round's outputs instead of converting twice more:
                # an extra ds_to_universal run would be the slowest step of every sweep point.
                produced = "hf" if args.export else "u"
                (keep / name).mkdir(parents=True, exist_ok=True)
                os.rename(out / produced, keep / name / "u")
                evict(keep / name / "u")
            shutil.rmtree(out, ignore_errors=True)
        if check and r == 0 and args.export:
            ours, theirs = keep / base / "u" / "model.safetensors", keep / reference / "u" / "model.safetensors"
            same = filecmp.cmp(ours, theirs, shallow=False)
            shutil.rmtree(keep)
            if not same:
                raise SystemExit("pyckpt's model.safetensors differs from zero_to_fp32's")
            print("check: pyckpt's model.safetensors is byte-identical to zero_to_fp32's", file=sys.stderr)
        elif check and r == 0:
            from compare import diff_folders
            largest = max((f.stat().st_size for f in (keep / "pyckpt" / "u").rglob("fp32.pt")), default=0)
            diffs = diff_folders(str(keep / "ds_to_universal" / "u"), str(keep / "pyckpt" / "u"))
            shutil.rmtree(keep)
            if diffs:
                raise SystemExit("pyckpt output differs from DeepSpeed's:\n" + "\n".join(diffs[:20]))
            print("check: pyckpt output is bit-equal to ds_to_universal's", file=sys.stderr)

    summary = {
        "job": "export" if args.export else "universal",
        "checkpoint": str(tag_dir),
        # One universal fp32.pt holds one parameter, so the biggest is the largest single tensor
        # (plus about a KiB of pickle): the yardstick of the RSS target.
        "largest_tensor_mib": largest / 2**20 if check and not args.export else None,
        "input_bytes": in_bytes,
        "input_files": sum(1 for f in tag_dir.iterdir() if f.is_file()),
        "params": args.params if (args.make or args.make_synthetic) else None,
        "dp": args.dp if (args.make or args.make_synthetic) else None,
        "runs": args.runs,
        "checked_bit_equal": check,
        "sync_between_runs": not args.no_sync,
        "warmup_copies": args.warmup,
        "warm_input": not args.cold,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "tools": {},
        "ratios": {},
        "skipped": skipped,
    }
    for name, ms in results.items():
        med = median([m.seconds for m in ms])
        peak_disk = max(m.peak_disk for m in ms)
        final = max(finals[name])
        summary["tools"][name] = {
            "seconds": [m.seconds for m in ms],
            "median_s": med,
            "gbps": in_bytes / med / 1e9,
            "peak_rss_mib": max(m.peak_rss for m in ms) / 2**20,
            "peak_disk_gib": peak_disk / 2**30,
            "output_gib": final / 2**30,
            # Sampled every 0.25 s, so a temp file shorter-lived than that can slip through.
            "temp_gib": max(0, peak_disk - final) / 2**30,
        }
    if base in results:
        py = results[base]
        for other in names:
            if other == base:
                continue
            if other.startswith("cp "):
                # The target is stated as pyckpt's time over the copy's, so keep that orientation.
                key, per_round = f"{base} / {other}", [p_.seconds / o.seconds for o, p_ in zip(results[other], py)]
            else:
                key, per_round = f"{other} / {base}", [o.seconds / p_.seconds for o, p_ in zip(results[other], py)]
            summary["ratios"][key] = {"per_round": per_round, "median": median(per_round),
                                      "note": DIFFERENT_JOB.get(other, "same output")}
    out_json = args.json or (args.work / "result.json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(summary, indent=2))
    table = markdown(summary)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    print(table)
    return summary


def markdown(s) -> str:
    lines = [f"Input: `{s['checkpoint']}` ({s['input_bytes'] / 2**30:.2f} GiB, {s.get('input_files', '?')} files), "
             f"{s['runs']} alternating rounds, {s['machine']['cpus']} CPUs.", "",
             "| tool | median s | GB/s (input) | peak RSS MiB | peak disk GiB | output GiB | temp GiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, t in s["tools"].items():
        lines.append(f"| {name} | {t['median_s']:.2f} | {t['gbps']:.2f} | {t['peak_rss_mib']:.0f} | "
                     f"{t['peak_disk_gib']:.2f} | {t.get('output_gib', float('nan')):.2f} | "
                     f"{t.get('temp_gib', float('nan')):.2f} |")
    if s["ratios"]:
        lines += ["", "| ratio (same round) | per round | median | |", "|---|---|---:|---|"]
        for k, v in s["ratios"].items():
            lines.append(f"| {k} | {', '.join(f'{x:.2f}' for x in v['per_round'])} | {v['median']:.2f} | "
                         f"{v.get('note', '')} |")
    for k, why in s.get("skipped", {}).items():
        lines.append(f"\n{k}: not run ({why}).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
