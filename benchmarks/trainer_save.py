"""The Hugging Face Trainer's checkpoints under ``pyckpt.deepspeed.enable(save=...)``: the stall per save and
the whole run, against DeepSpeed's own save.

    python benchmarks/trainer_save.py --root /tmp/bench/trainer_save --params 200M --ranks 4 --rounds 3 \\
        --steps 60 --save-every 20 --json benchmarks/results/trainer_save_z2_200M_dp4.json
    python benchmarks/trainer_save.py --root /tmp/bench/trainer_save --quick      # smoke run, tiny model

Each way is one ``torchrun`` launch of a Trainer job (gloo, DeepSpeed on CPU, ZeRO-2, fp32 weights and Adam
unless ``--dtype bf16``) training a LlamaForCausalLM of about ``--params`` parameters (resume.py's shape:
width 1024, 32k vocabulary, depth solved; ``--quick``: a tiny one) for ``--steps`` steps of one short
sequence per rank, saving every ``--save-every`` steps (``save_total_limit=--keep``):

- ``none``: DeepSpeed's own ``save_checkpoint``, as the Trainer calls it;
- ``async``: ``pyckpt.deepspeed.enable(save="async")``: the call returns once the state is snapshotted, the
  files are written in the background, and ``checkpoint-N/`` is renamed into place once complete;
- ``atomic``: ``enable(save="atomic")``, the same staging and rename, written before the call returns.

Per save (the slowest rank's, as the next step waits for every rank): the wall time of
``Trainer._save_checkpoint`` (the training loop's stall), and inside it DeepSpeed's ``save_checkpoint``,
the Trainer's ``save_model`` (model.safetensors, written synchronously by every way) and the join of the
previous asynchronous write (``join_pending``, which the next save makes: with too few steps between saves
it would hold the write's rest). The first asynchronous save of a job also allocates its snapshot buffers, so
the stall is reported over all saves and over the later ones. Per run: ``trainer.train()`` from a barrier to
the slowest rank's return (it holds the Trainer's engine set-up and, for ``async``, the join of the last
write at its end) and the loop alone (first step to return), with the peak RSS of the launch's process tree.

Ways rotate their order from round to round; ratios compare within a round (these machines are shared and
noisy). Before each launch the output folder is emptied and ``os.sync()`` run, so no way pays for the
previous one's writeback. Round 0's final ``checkpoint-N`` of every way is compared, untimed, with the stock
run's byte for byte (every file but the pickled ``TrainingArguments``, which names the run's own folder),
with the same visible checkpoints and no staging folder left, before any later round runs or anything is
reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GOAL_STALL_RATIO = 5.0  # stock / async, per save


def model_config(params: str, quick: bool):
    if quick:  # a few hundred thousand parameters: the smoke run checks the plumbing, not the speed
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    from pyckpt.testing import parse_count
    from resume import llama_config

    return llama_config(parse_count(params))


def ds_config(dtype: str, bucket) -> dict:
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 2}, "steps_per_print": 10**6}
    if bucket:
        cfg["zero_optimization"].update(reduce_bucket_size=int(bucket), allgather_bucket_size=int(bucket))
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# ------------------------------------------------------------------------------------------------------------
# one rank of one launch


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist

    if args.mode != "none":
        import pyckpt.deepspeed

        pyckpt.deepspeed.enable(save=args.mode)
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from make_real_checkpoint import skip_shm_comm_op

    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    current = {}  # the save in progress on this rank: its record
    saves, stamps = [], {"final_join": 0.0}

    # DeepSpeed's save as the Trainer calls it (pyckpt's hooked one where enabled, which calls the original
    # again into its staging folder: only the outermost call is timed)
    engine_save = DeepSpeedEngine.save_checkpoint
    depth = [0]

    def timed_engine_save(self, *a, **kw):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return engine_save(self, *a, **kw)
        finally:
            depth[0] -= 1
            if depth[0] == 0 and current:
                current["deepspeed"] += time.perf_counter() - t0
    DeepSpeedEngine.save_checkpoint = timed_engine_save

    if args.mode != "none":
        from pyckpt.deepspeed.integrations import trainer_save

        join = trainer_save.join_pending

        def timed_join(owner=None):
            t0 = time.perf_counter()
            try:
                return join(owner)
            finally:
                seconds = time.perf_counter() - t0
                if current:
                    current["join"] += seconds
                else:  # the end of train()
                    stamps["final_join"] += seconds
        trainer_save.join_pending = timed_join

    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(args.params, args.quick))
    vocab = model.config.vocab_size
    rows = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(0, vocab, (args.seq,), generator=torch.Generator().manual_seed(i)) for i in range(64))]
    targs = TrainingArguments(output_dir=args.out, deepspeed=ds_config(args.dtype, args.bucket),
                              per_device_train_batch_size=1, max_steps=args.steps, save_strategy="steps",
                              save_steps=args.save_every, save_total_limit=args.keep or None, report_to=[],
                              use_cpu=True, seed=0, disable_tqdm=True, logging_steps=args.save_every,
                              learning_rate=1e-4, bf16=args.dtype == "bf16")

    class FirstStep(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            stamps.setdefault("first_step", time.perf_counter())

    trainer = Trainer(model=model, args=targs, train_dataset=rows, callbacks=[FirstStep()])
    save_model = trainer.save_model

    def timed_save_model(*a, **kw):
        t0 = time.perf_counter()
        try:
            return save_model(*a, **kw)
        finally:
            if current:
                current["save_model"] += time.perf_counter() - t0
    trainer.save_model = timed_save_model
    save_checkpoint = trainer._save_checkpoint  # the class's, which enable() wrapped where a mode is set

    from pyckpt.deepspeed.save.in_flight import save_in_flight

    def timed_save_checkpoint(model, trial):
        engine = trainer.model_wrapped
        previous = save_in_flight(engine)
        current.update(step=trainer.state.global_step, deepspeed=0.0, save_model=0.0, join=0.0,
                       previous_done=previous.done() if previous is not None else None)
        t0 = time.perf_counter()
        current["start"] = t0
        try:
            save_checkpoint(model, trial)
        finally:
            current["stall"] = time.perf_counter() - t0
            current["end"] = time.perf_counter()
            handle = save_in_flight(engine)
            current["handle"] = handle if handle is not previous else None
            saves.append(dict(current))
            current.clear()
    trainer._save_checkpoint = timed_save_checkpoint

    dist.barrier()
    t0 = time.perf_counter()
    trainer.train()
    t1 = time.perf_counter()
    for s in saves:  # every write joined by now: when each was published, from its call
        handle = s.pop("handle")
        s["published"] = handle.published_s if handle is not None else None
        s["stall_snapshot"] = handle.stall_s if handle is not None else None
    mine = {"train": t1 - t0, "loop": t1 - stamps["first_step"], "final_join": stamps["final_join"], "saves": saves,
            "global_step": trainer.state.global_step}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        by_save = []
        for i, s in enumerate(saves):
            per_rank = [r["saves"][i] for r in every]
            row = {"step": s["step"]}
            for key in ("stall", "deepspeed", "save_model", "join", "stall_snapshot"):
                values = [x[key] for x in per_rank if x[key] is not None]
                row[key] = max(values) if values else None
            row["other"] = row["stall"] - max(x["deepspeed"] + x["save_model"] + x["join"] for x in per_rank)
            row["previous_done"] = (all(x["previous_done"] for x in per_rank)
                                    if per_rank[0]["previous_done"] is not None else None)
            row["published"] = s["published"]  # rank 0's: it publishes, the others learn the outcome from it
            row["gap_before"] = s["start"] - saves[i - 1]["end"] if i else None  # rank 0's steps between saves
            by_save.append(row)
        with open(args.result, "w") as f:
            json.dump({"params": params, "train": max(r["train"] for r in every),
                       "loop": max(r["loop"] for r in every), "final_join": max(r["final_join"] for r in every),
                       "global_step": trainer.state.global_step, "saves": by_save}, f)
    return 0


# ------------------------------------------------------------------------------------------------------------
# the driver


def _checkpoints(run: str) -> list:
    return sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))


def _hidden(run: str) -> list:
    return sorted(n for n in os.listdir(run) if n.startswith("."))


def _same_bytes(a: str, b: str, chunk: int = 16 << 20) -> bool:
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def compare(stock_run: str, run: str) -> dict:
    """The final ``checkpoint-N`` of ``run`` against the stock run's: the same files, byte for byte, less the
    pickled TrainingArguments (it names the run's own output folder); the same visible checkpoints, no staging
    folder left behind."""
    problems = []
    if _checkpoints(run) != _checkpoints(stock_run):
        problems.append(f"visible checkpoints {_checkpoints(run)} vs stock {_checkpoints(stock_run)}")
    if _hidden(run):
        problems.append(f"left behind: {_hidden(run)}")
    final = _checkpoints(stock_run)[-1] if _checkpoints(stock_run) else None
    if final is None:
        return {"equal": False, "problems": problems + ["the stock run saved nothing"]}

    def listing(folder):
        return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
                      if f != "training_args.bin")

    ours, theirs = os.path.join(run, final), os.path.join(stock_run, final)
    names = listing(theirs)
    if not os.path.isdir(ours) or listing(ours) != names:
        problems.append(f"{final}: files differ: {listing(ours) if os.path.isdir(ours) else 'absent'} vs {names}")
    else:
        problems += [f"{final}/{n} differs" for n in names
                     if not _same_bytes(os.path.join(ours, n), os.path.join(theirs, n))]
    size = sum(os.path.getsize(os.path.join(theirs, n)) for n in names)
    return {"equal": not problems, "problems": problems, "checkpoint": final, "files": len(names), "bytes": size}


def launch(args, mode: str, run: str, result: str, env: dict):
    from measure import run_measured

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
           os.path.abspath(__file__), "--rank-main", "--mode", mode, "--out", run, "--result", result,
           "--params", args.params, "--steps", str(args.steps), "--save-every", str(args.save_every),
           "--keep", str(args.keep), "--seq", str(args.seq), "--dtype", args.dtype]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--bucket", str(args.bucket)] if args.bucket else []
    # the launch's tree sampled every 0.1 s: enough for a peak that lasts a save, cheap beside four ranks
    return run_measured(cmd, env=env, interval=0.1, cwd=args.root)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_run(got: dict, peak_rss: int, wall: float) -> dict:
    saves = got["saves"]
    later = saves[1:] or saves
    return {"train": got["train"], "loop": got["loop"], "final_join": got["final_join"], "launch": wall,
            "peak_rss": peak_rss, "saves": saves,
            "stall": _median(s["stall"] for s in saves), "stall_later": _median(s["stall"] for s in later),
            "stall_first": saves[0]["stall"] if saves else None,
            "deepspeed": _median(s["deepspeed"] for s in saves), "save_model": _median(s["save_model"] for s in saves),
            "join": _median(s["join"] for s in saves), "join_max": max((s["join"] for s in saves), default=0.0),
            "published": _median(s["published"] for s in saves),
            "gap": _median(s["gap_before"] for s in saves),
            "writes_done_before_next_save": all(s["previous_done"] for s in saves[1:]
                                                if s["previous_done"] is not None)}


def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summarize(args, modes: list, rounds: list, check: dict, df: list, complete: bool) -> dict:
    """Medians over the rounds so far and the goal; written to --json after every round, so that a run cut
    short keeps what it measured."""
    medians = {}
    for mode in modes:
        for key in ("stall", "stall_later", "stall_first", "deepspeed", "save_model", "join", "join_max",
                    "published", "gap", "train", "loop", "final_join", "peak_rss"):
            medians[f"{mode}_{key}"] = _median(row[mode][key] for row in rounds if mode in row)
        medians[f"{mode}_writes_done_before_next_save"] = all(row[mode]["writes_done_before_next_save"]
                                                              for row in rounds if mode in row)
    for key in rounds[0]:
        if key.startswith(("stall_none_over_", "stall_later_none_over_", "train_none_over_", "loop_none_over_")):
            medians[key] = _median(row.get(key) for row in rounds)
    goal = None
    if "stall_none_over_async" in medians:
        goal = {"goal": f"stock / async stall >= {GOAL_STALL_RATIO}", "median": medians["stall_none_over_async"],
                "met": medians["stall_none_over_async"] >= GOAL_STALL_RATIO}
    summary = {"params": rounds[0]["params"], "params_arg": args.params, "quick": args.quick, "ranks": args.ranks,
               "stage": 2, "dtype": args.dtype, "steps": args.steps, "save_every": args.save_every, "keep": args.keep,
               "seq": args.seq, "bucket": args.bucket, "rounds_count": args.rounds, "rounds_done": len(rounds),
               "complete": complete, "atomic_rounds": args.atomic_rounds, "modes": modes, "cores": os.cpu_count(),
               "root_fs": f"{df[1]} ({df[0]})" if len(df) > 1 else None, "check": check, "rounds": rounds,
               "medians": medians, "goal": goal}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="working folder on disk, not /dev/shm (emptied of its runs at the "
                                                 "end); default /tmp/pyckpt-bench-trainer-save")
    p.add_argument("--params", default="200M")
    p.add_argument("--ranks", type=int, default=None, help="default 4 (2 with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="default 60 (12 with --quick)")
    p.add_argument("--save-every", type=int, default=None, help="default 20 (4 with --quick)")
    p.add_argument("--keep", type=int, default=2, help="the Trainer's save_total_limit (0: keep every checkpoint)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence; one sequence per rank and step")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--bucket", type=float, default=None,
                   help="ZeRO reduce_bucket_size and allgather_bucket_size (elements; default DeepSpeed's 5e8)")
    p.add_argument("--modes", default="none,async,atomic", help="ways, comma-separated; 'none' is DeepSpeed's own")
    p.add_argument("--atomic-rounds", type=int, default=None,
                   help="run 'atomic' (a reference) in the first N rounds only; default every round")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model (1 round, 12 steps, a save every 4 "
                                                        "unless given)")
    p.add_argument("--json", default=None)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        from pyckpt.execution.distributed import leave_and_exit

        leave_and_exit(rank_main(args), exit_handlers=True)
    quick = {"rounds": 1, "steps": 12, "save_every": 4, "ranks": 2}
    full = {"rounds": 3, "steps": 60, "save_every": 20, "ranks": 4}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    modes = args.modes.split(",")
    if args.steps < 2 * args.save_every:
        raise SystemExit("--steps must allow at least two saves (2 x --save-every)")
    args.root = os.path.abspath(args.root or "/tmp/pyckpt-bench-trainer-save")
    os.makedirs(args.root, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=os.path.join(args.root, "ext"))
    df = subprocess.run(["df", "-T", args.root], capture_output=True, text=True).stdout.splitlines()[-1].split()

    rounds, check = [], {}
    for r in range(args.rounds):
        these = [m for m in modes if m != "atomic" or args.atomic_rounds is None or r < args.atomic_rounds]
        order = these[r % len(these):] + these[:r % len(these)]
        row = {"round": r, "order": order}
        for mode in order:
            run = os.path.join(args.root, f"run-{mode}")
            result = os.path.join(args.root, f"result-{mode}.json")
            shutil.rmtree(run, ignore_errors=True)
            os.sync()  # no dirty pages from the previous way
            m = launch(args, mode, run, result, env)
            with open(result) as f:
                got = json.load(f)
            row["params"] = got["params"]
            row[mode] = summarize_run(got, m.peak_rss, m.seconds)
            x = row[mode]
            print(f"round {r} {mode}: train() {x['train']:.1f} s (loop {x['loop']:.1f} s), stall per save "
                  f"{_fmt(x['stall'])} s (saves: {', '.join(_fmt(s['stall']) for s in x['saves'])}; DeepSpeed's save "
                  f"{_fmt(x['deepspeed'])} s, save_model {_fmt(x['save_model'])} s, join {_fmt(x['join'], 3)} s), "
                  f"published {_fmt(x['published'])} s after the call, peak RSS {m.peak_rss / 2**30:.1f} GiB",
                  flush=True)
        if r == 0 and "none" in order:  # before anything is reported, and before the other rounds
            stock = os.path.join(args.root, "run-none")
            for mode in order:
                if mode != "none":
                    check[mode] = compare(stock, os.path.join(args.root, f"run-{mode}"))
                    print(f"check {mode} vs stock: {json.dumps(check[mode])}", flush=True)
            if not all(c["equal"] for c in check.values()):
                raise SystemExit(f"a way's checkpoint differs from DeepSpeed's own: {check}")
        for mode in modes:
            shutil.rmtree(os.path.join(args.root, f"run-{mode}"), ignore_errors=True)
        for mode in order:
            if mode != "none" and "none" in order:
                row[f"stall_none_over_{mode}"] = row["none"]["stall"] / row[mode]["stall"]
                row[f"stall_later_none_over_{mode}"] = row["none"]["stall_later"] / row[mode]["stall_later"]
                row[f"train_none_over_{mode}"] = row["none"]["train"] / row[mode]["train"]
                row[f"loop_none_over_{mode}"] = row["none"]["loop"] / row[mode]["loop"]
        rounds.append(row)
        print(f"round {r} ratios: " + json.dumps({k: round(v, 3) for k, v in row.items()
                                                  if k.startswith(("stall_", "train_", "loop_"))}), flush=True)
        summary = summarize(args, modes, rounds, check, df, complete=r == args.rounds - 1)
    medians, goal = summary["medians"], summary["goal"]
    print("medians: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in medians.items()}))
    print(f"goal: {json.dumps(goal)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
