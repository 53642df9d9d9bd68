"""Loading a checkpoint into a running DeepSpeed job: DeepSpeed's tools vs pyckpt, in alternating rounds.

    python -m pyckpt.convert CKPT CKPT/global_step1_universal && echo global_step1_universal > CKPT/latest_universal
    torchrun --standalone --nproc_per_node 4 benchmarks/load.py CKPT --stage 2 --rounds 3 \\
        --json benchmarks/results/load_z2_200M_dp4.json

CKPT is a checkpoint of benchmarks/make_real_checkpoint.py (same --params, --width and --dtype): every rank
builds the same model and engine with ``"checkpoint": {"load_universal": true}``, then loads into that
engine again and again, each way in turn (the order rotates by round):

- ``stock``: DeepSpeed's own universal load of CKPT/global_step1_universal;
- ``pyckpt``: the same with ``pyckpt.deepspeed.enable()``;
- ``direct``: ``pyckpt.deepspeed.load_checkpoint(engine, CKPT)``, straight from the ZeRO shards;
- ``convert+stock`` (``--modes``): what a user without pyckpt runs to resume at another world size,
  DeepSpeed's ds_to_universal.py (rank 0, the others waiting) and then DeepSpeed's universal load.

Per load and rank: wall time (between barriers, so the slowest rank counts), bytes read (read() bytes
from /proc/self/io; pyckpt's gathers from files on a disk go through memory maps, which read() does not
see, so for pyckpt the bytes its plan gathered are reported too), and the RSS the load added at its peak (sampled every 5 ms),
for pyckpt also during its own part (planning to the end of the gather, without DeepSpeed's epilogue).
Ratios are within a round: this machine is shared and noisy.

Before the rounds, each way loads once untimed (``--warmup 0`` to skip; ds_to_universal's input is
read through instead of converted). That brings both folders into the page cache, and it pays the
first use of the collective that ends every ZeRO-1/2 load, DeepSpeed's all-gather of the whole
low-precision model. Over gloo that first call is slow whatever loads (an 800 MB
``all_gather_into_tensor`` on 4 ranks here: 3.8 s the first time, 1.1-1.3 s after), and a training
job pays it at its first step when its load did not; without the warm-up it fell on whichever load
came first.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")




def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __init__(self):
        self.base = rss()
        self.peak = self.base
        self.samples = []  # (perf_counter, rss)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.005):
            value = rss()
            self.samples.append((time.perf_counter(), value))
            self.peak = max(self.peak, value)

    def peak_between(self, t0: float, t1: float) -> int:
        return max([v for t, v in self.samples if t0 <= t <= t1] + [self.base])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt")
    p.add_argument("--params", default="200M")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the training precision CKPT was made with (make_real_checkpoint.py --dtype)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="stock,pyckpt,direct,convert+stock",
                   help="comma-separated, from stock, pyckpt, direct, convert+stock")
    p.add_argument("--warmup", type=int, default=1, help="untimed loads of each way before the rounds")
    p.add_argument("--json")
    args = p.parse_args()

    import torch.distributed as tdist
    import deepspeed

    import pyckpt.deepspeed
    from pyckpt.deepspeed.load import hooks

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_real_checkpoint import build_model, ds_config

    model, _ = build_model(args.params, args.width)
    cfg = dict(ds_config(args.stage, args.dtype), checkpoint={"load_universal": True})
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    rank, world = tdist.get_rank(), tdist.get_world_size()

    universal_tag = "global_step1_universal"
    scratch = os.path.join(os.path.abspath(args.ckpt), "bench_ds_universal")

    def convert_with_deepspeed() -> float:
        """ds_to_universal.py on rank 0 into a scratch folder; its seconds."""
        t0 = time.perf_counter()
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
            tag = open(os.path.join(args.ckpt, "latest")).read().strip()
            script = os.path.join(os.path.dirname(deepspeed.__file__), "checkpoint", "ds_to_universal.py")
            subprocess.run([sys.executable, script, "--input_folder", os.path.join(args.ckpt, tag),
                            "--output_folder", os.path.join(scratch, universal_tag)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tdist.barrier()
        return time.perf_counter() - t0

    def load(mode: str) -> dict:
        handle = pyckpt.deepspeed.enable() if mode == "pyckpt" else None
        try:
            convert_s = convert_with_deepspeed() if mode == "convert+stock" else 0.0
            tdist.barrier()
            r0 = rchar()
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                if mode == "direct":
                    pyckpt.deepspeed.load_checkpoint(engine, args.ckpt)
                elif mode == "convert+stock":
                    engine.load_checkpoint(scratch, tag=universal_tag)
                else:
                    engine.load_checkpoint(args.ckpt, tag=universal_tag)
                tdist.barrier()
                seconds = time.perf_counter() - t0
            read = rchar() - r0
        finally:
            if handle is not None:
                pyckpt.deepspeed.disable()
        out = {"seconds": seconds + convert_s, "convert_seconds": convert_s, "read_syscall_bytes": read,
               "rss_added": peak.peak - peak.base}
        if mode in ("pyckpt", "direct"):
            assert hooks.last_load.get("backend") == "pyckpt", hooks.last_load
            out["gathered_bytes"] = hooks.last_load["bytes_read"]
            out["plan_seconds"] = hooks.last_load["plan_s"]
            out["gather_seconds"] = hooks.last_load["gather_s"]
            out["rss_added_pyckpt_part"] = peak.peak_between(hooks.last_load["started"],
                                                             hooks.last_load["gathered"]) - peak.base
        if mode == "convert+stock" and rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        return out

    modes = [m for m in args.modes.split(",") if m]
    for _ in range(args.warmup):
        for m in dict.fromkeys("stock" if m == "convert+stock" else m for m in modes):
            load(m)
        if "convert+stock" in modes and rank == 0:  # ds_to_universal's input, all of it, into the cache
            tag_dir = os.path.join(args.ckpt, open(os.path.join(args.ckpt, "latest")).read().strip())
            for name in sorted(os.listdir(tag_dir)):
                with open(os.path.join(tag_dir, name), "rb") as f:
                    while f.read(1 << 24):
                        pass
        tdist.barrier()
    rounds = []
    for i in range(args.rounds):
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        rounds.append({m: load(m) for m in order})
    everyone = [None] * world
    tdist.all_gather_object(everyone, rounds)
    if rank == 0:
        result = {"ckpt": args.ckpt, "stage": args.stage, "dtype": args.dtype, "world_size": world, "params": args.params,
                  "warmup": args.warmup, "rounds": everyone}
        print(f"checkpoint load, ZeRO-{args.stage} {args.dtype}, {world} ranks ({args.ckpt})")
        per_round = {}
        for i in range(args.rounds):
            wall = {m: max(everyone[r][i][m]["seconds"] for r in range(world)) for m in modes}
            line = ", ".join(f"{m} {s:.2f} s" for m, s in wall.items())
            ratios = {}
            if "stock" in wall and "pyckpt" in wall:
                ratios["stock/pyckpt"] = wall["stock"] / wall["pyckpt"]
            if "convert+stock" in wall and "direct" in wall:
                ratios["convert+stock/direct"] = wall["convert+stock"] / wall["direct"]
            for name, value in ratios.items():
                per_round.setdefault(name, []).append(value)
            print(f"  round {i}: {line}; " + ", ".join(f"{n} {v:.1f}x" for n, v in ratios.items()))
        for name, values in per_round.items():
            print(f"  {name}: median {statistics.median(values):.1f}x, rounds {min(values):.1f}-{max(values):.1f}x")
        for r in range(world):
            last = everyone[r][-1]
            parts = []
            for m in modes:
                x = last[m]
                got = f", gathered {x['gathered_bytes'] / 2**20:.0f} MiB" if "gathered_bytes" in x else ""
                own = f" (own part {x['rss_added_pyckpt_part'] / 2**20:.0f})" if "rss_added_pyckpt_part" in x else ""
                parts.append(f"{m}: read() {x['read_syscall_bytes'] / 2**20:.0f} MiB{got}, RSS +{x['rss_added'] / 2**20:.0f} "
                             f"MiB{own}")
            print(f"  rank {r}: " + "; ".join(parts))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    engine.destroy()


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    main()
    leave_and_exit(0)
