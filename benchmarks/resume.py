"""Resuming a Hugging Face Trainer run at another world size: pyckpt vs DeepSpeed's own road.

    python benchmarks/resume.py OUT --make --params 200M --world 4        # the Trainer's save (torchrun inside)
    python benchmarks/resume.py OUT --moves 4:2,2:4,4:4 --rounds 2 --json resume.json

The model is a LlamaForCausalLM of about --params parameters, trained one step by the Trainer under
ZeRO-2 (fp32 weights, Adam) and saved as ``OUT/checkpoint-1``. Each measurement is one torchrun
launch at the new world size whose ranks build the same Trainer and call
``trainer.train(resume_from_checkpoint=...)``; the figure is the seconds from that call to the start
of the first training step after it (the slowest rank's, as every rank waits for it; the window holds
the Trainer's own set-up of the DeepSpeed engine, which ``train()`` does), and the load's own part of it
(``DeepSpeedEngine.load_checkpoint`` as the run calls it, plus the conversion for ``stock``), with:

- ``pyckpt``: ``pyckpt.deepspeed.enable()`` and the DeepSpeed config the run was saved with;
- ``stock``: DeepSpeed's own road to another world size: ``ds_to_universal.py --inject_missing_state``
  (the Trainer saves no ``universal_checkpoint_info``; its seconds added, run once per round) and
  ``"checkpoint": {"load_universal": true}``;
- at the saved world size, ``plain``: DeepSpeed's own load without pyckpt (which ``pyckpt`` leaves
  it to, after comparing topologies), and ``direct``: pyckpt's resume from the shards forced there
  (the topology comparison patched to say "changed"), to see whether it would be faster.

Ways alternate within a round; ratios compare within a round (these machines are noisy).
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

from pyckpt.testing import parse_count

HERE = os.path.dirname(os.path.abspath(__file__))


def llama_config(params: int):
    """A Llama of about ``params`` parameters: width 1024, 4096-wide MLP, 32000 tokens, depth solved."""
    from transformers import LlamaConfig

    hidden, ffn, vocab = 1024, 4096, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64)


def ds_config(universal: bool) -> dict:
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def trainer(out: str, params: int, steps: int, universal: bool, save: bool, cpu: bool = True):
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(params))
    rows = [{"input_ids": torch.arange(16) + i, "labels": torch.arange(16) + i} for i in range(64)]
    args = TrainingArguments(output_dir=out, deepspeed=ds_config(universal), per_device_train_batch_size=1,
                             max_steps=steps, save_strategy="steps" if save else "no", save_steps=1, report_to=[],
                             use_cpu=cpu, seed=0, disable_tqdm=True, logging_steps=1000, learning_rate=1e-4)
    return Trainer(model=model, args=args, train_dataset=rows)


def rank_main(args) -> int:
    """Inside torchrun: --make (one step, then the Trainer's save) or one timed resume."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    params = parse_count(args.params)
    if args.make:
        trainer(args.out, params, 1, False, True).train()
        return 0
    if args.way in ("pyckpt", "direct"):
        import pyckpt.deepspeed

        pyckpt.deepspeed.enable()
        if args.way == "direct":  # measurement only: take the resume from the shards at the saved topology too
            from pyckpt.deepspeed.load import topology

            topology.Topology.partitioned_like = lambda self, other: False
    # The load's own part of the window: DeepSpeed's load_checkpoint as the run calls it (pyckpt's
    # hooked one where enabled), timed from outside.
    from deepspeed.runtime.engine import DeepSpeedEngine

    load = DeepSpeedEngine.load_checkpoint
    stamps = {}

    def timed_load(self, *a, **kw):
        t = time.perf_counter()
        try:
            return load(self, *a, **kw)
        finally:
            stamps["load"] = time.perf_counter() - t

    DeepSpeedEngine.load_checkpoint = timed_load
    t = trainer(os.path.join(args.out, f"resume-{args.way}"), params, 2, args.way == "stock", False,
                cpu=args.device == "cpu")

    class FirstStep(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            stamps.setdefault("step", time.perf_counter())
            control.should_training_stop = True  # the load is what is measured, not the step

    t.add_callback(FirstStep())
    source = os.path.join(args.from_dir or args.out, "checkpoint-1")
    dist.barrier()
    t0 = time.perf_counter()
    t.train(resume_from_checkpoint=source)
    seconds = [None] * dist.get_world_size()
    dist.all_gather_object(seconds, (stamps["step"] - t0, stamps["load"]))
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"seconds": max(s for s, _ in seconds), "load_seconds": max(x for _, x in seconds)}, f)
    return 0


def launch(world: int, argv: list, env: dict) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           os.path.abspath(__file__), "--rank-main", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def convert_stock(out: str) -> float:
    """ds_to_universal.py on the Trainer's checkpoint, into a copy that holds only it; its seconds."""
    import importlib.util

    stock = os.path.join(out, "stock")
    shutil.rmtree(stock, ignore_errors=True)
    ckpt = os.path.join(out, "checkpoint-1")
    os.makedirs(os.path.join(stock, "checkpoint-1"))
    for name in os.listdir(ckpt):  # the Trainer's own files; the ZeRO tag stays where it is
        if not os.path.isdir(os.path.join(ckpt, name)):
            shutil.copy2(os.path.join(ckpt, name), os.path.join(stock, "checkpoint-1", name))
    spec = importlib.util.find_spec("deepspeed")
    script = os.path.join(list(spec.submodule_search_locations)[0], "checkpoint", "ds_to_universal.py")
    tag = open(os.path.join(ckpt, "latest")).read().strip()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, script, "--input_folder", os.path.join(ckpt, tag), "--output_folder",
                    os.path.join(stock, "checkpoint-1", f"{tag}_universal"), "--inject_missing_state"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the Trainer's output_dir (holds checkpoint-1 after --make)")
    p.add_argument("--make", action="store_true", help="train one step at --world ranks and save")
    p.add_argument("--params", default="200M")
    p.add_argument("--world", type=int, default=4, help="--make: the world size to save at")
    p.add_argument("--moves", default="4:2,2:4,4:4", help="saved:resumed world sizes (the saved must be --world's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the resumed runs train (the save is made on CPU ranks either way)")
    p.add_argument("--json")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--way", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--from-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        from pyckpt.execution.distributed import leave_and_exit

        leave_and_exit(rank_main(args))
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    resume_env = dict(env) if args.device == "cpu" else {k: v for k, v in env.items() if k != "DS_ACCELERATOR"}
    out = os.path.abspath(args.out)
    if args.make:
        launch(args.world, [out, "--make", "--params", args.params], env)
        print(f"saved {out}/checkpoint-1 at {args.world} ranks")
        return 0
    results = []
    for move in args.moves.split(","):
        saved, world = (int(x) for x in move.split(":"))
        ways = ["plain", "pyckpt", "direct"] if saved == world else ["stock", "pyckpt"]
        for r in range(args.rounds):
            row = {"move": move, "round": r}
            for way in (ways if r % 2 == 0 else ways[::-1]):
                convert = convert_stock(out) if way == "stock" else 0.0
                result = os.path.join(out, f"result-{way}.json")
                launch(world, [out, "--params", args.params, "--way", way, "--result", result, "--device", args.device]
                       + (["--from-dir", os.path.join(out, "stock")] if way == "stock" else []), resume_env)
                with open(result) as f:
                    got = json.load(f)
                row[way] = convert + got["seconds"]
                row[f"{way}_convert"] = convert
                row[f"{way}_load"] = got["load_seconds"]
            other = "plain" if saved == world else "stock"
            row["ratio"] = row[other] / row["pyckpt"]
            # the load's own part: the conversion (stock) and load_checkpoint, without the engine's set-up
            row["load_ratio"] = (row[f"{other}_convert"] + row[f"{other}_load"]) / row["pyckpt_load"]
            if "direct" in row:
                row["plain/direct"] = row["plain"] / row["direct"]
            print(json.dumps(row), flush=True)
            results.append(row)
    summary = {}
    for move in args.moves.split(","):
        rows = [r for r in results if r["move"] == move]
        summary[move] = statistics.median(r["ratio"] for r in rows)
        summary[move + " load part"] = statistics.median(r["load_ratio"] for r in rows)
        if rows and "plain/direct" in rows[0]:
            summary[move + " plain/direct"] = statistics.median(r["plain/direct"] for r in rows)
    print("median ratio (stock or plain / pyckpt) by move:", json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": results, "median_ratio": summary, "params": args.params}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
