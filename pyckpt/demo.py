"""The built-in example: ``python -m pyckpt.demo [WORKDIR]``, a checkpoint's whole life on 2 CPU ranks.

1. A word-level tokenizer is trained here with the ``tokenizers`` library (nothing comes from a hub);
   DeepSpeed (ZeRO-2 by default, gloo) trains a small Llama (``transformers``) on 2 ranks and saves
   through ``pyckpt.deepspeed.save_checkpoint``: DeepSpeed's files plus tokenizer, config and
   training state, published whole.
2. ``torchrun --nproc_per_node 2 -m pyckpt.convert`` converts it to a Universal Checkpoint, the 2
   processes sharing the files; DeepSpeed's own ds_to_universal.py converts it too, and the two are
   compared tensor by tensor.
3. ``python -m pyckpt.export`` writes a Hugging Face folder (safetensors, config, tokenizer).
4. ``transformers`` loads that folder: nothing missing or unexpected, the same logits as the trained
   model to the last bit, the same token ids.
5. DeepSpeed resumes on 3 ranks with ``pyckpt.deepspeed.enable()``: every rank reads only its share of
   the Universal Checkpoint; every fp32 master equals the export, the step count is restored, and one
   more training step runs.

Each step prints one line, and the run stops at the first check that fails (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

TRAIN_RANKS, RESUME_RANKS, STEPS = 2, 3, 6
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a checkpoint is cut into one shard per rank",
    "pyckpt turns deepspeed checkpoints into model files",
    "every rank reads only its own bytes of the state",
    "the tokenizer was trained here from these sentences",
    "resume the run on another number of ranks",
]


class DemoFailed(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"demo FAILED: {message}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tokenizer(folder: str, sentences=SENTENCES):
    """A word-level tokenizer trained on ``sentences``, saved with save_pretrained (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[BOS]", "[EOS]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]")
    fast.save_pretrained(folder)
    return fast


def _model(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        pad_token_id=1, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False))


def _ids(tokenizer, sentences):
    return tokenizer(sentences, padding="max_length", max_length=12, truncation=True, return_tensors="pt")["input_ids"]


def _batch(tokenizer, rank: int, step: int):
    picks = [SENTENCES[(rank * 2 + step + i) % len(SENTENCES)] for i in range(2)]
    return _ids(tokenizer, picks)


def _engine(model, stage: int, load_universal: bool = False):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "checkpoint": {"load_universal": load_universal},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def _init(rank: int, world: int, port: int, log: str) -> None:
    # The ranks' own output (DeepSpeed's and torch's logs) goes to a file per rank, so the demo's
    # output is its five lines; a failing rank's traceback still reaches the terminal (the parent
    # re-raises it).
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    # On the CPU accelerator init_distributed JIT-compiles DeepSpeed's shared-memory all-reduce op
    # (about 35 s on 2 cores, and a compiler needed), which backs only inference_all_reduce: marking
    # the ops unavailable skips that; training and checkpoints use torch.distributed (gloo).
    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _train(rank: int, work: str, port: int, stage: int) -> None:
    """A training job: steps, then the collective save through pyckpt, on every rank."""
    _init(rank, TRAIN_RANKS, port, os.path.join(work, "logs", f"train-rank{rank}.log"))
    import deepspeed
    import torch
    from transformers import PreTrainedTokenizerFast

    import pyckpt.deepspeed

    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(work, "tokenizer"))
    model = _model(len(tokenizer))
    engine = _engine(model, stage)
    for step in range(STEPS):
        ids = _batch(tokenizer, rank, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    # Universal conversion needs universal_checkpoint_info (DeepSpeed's ds_to_universal asserts it).
    pyckpt.deepspeed.save_checkpoint(engine, os.path.join(work, "checkpoint"), tokenizer=tokenizer,
                                     model_config=model.config, client_state={"universal_checkpoint_info": {}})
    # The reference for the export: the trained model's logits on a fixed batch (ZeRO-3 holds
    # shards, gathered for the forward pass).
    engine.eval()
    params = list(engine.module.parameters())
    with torch.no_grad(), deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        logits = engine.module(input_ids=_ids(tokenizer, SENTENCES[:2])).logits
    if rank == 0:
        torch.save({"logits": logits.detach().clone(), "loss": loss.item()}, os.path.join(work, "reference.pt"))
    _finish(engine)


def _resume(rank: int, work: str, port: int, stage: int) -> None:
    """Another job, on another number of ranks: resume through pyckpt's accelerated universal load."""
    _init(rank, RESUME_RANKS, port, os.path.join(work, "logs", f"resume-rank{rank}.log"))
    import torch
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    import pyckpt.deepspeed
    from pyckpt.deepspeed.load.hooks import last_load

    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(work, "hf"))
    model = _model(len(tokenizer))
    engine = _engine(model, stage, load_universal=True)
    with pyckpt.deepspeed.enable():
        path, _ = engine.load_checkpoint(os.path.join(work, "checkpoint"))
    exported = load_file(os.path.join(work, "hf", "model.safetensors"))
    wrong = [name for name, p in engine.module.named_parameters()
             if not torch.equal(safe_get_full_fp32_param(p), exported[name])]
    ids = _batch(tokenizer, rank, STEPS)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if rank == 0:
        with open(os.path.join(work, "resume.json"), "w") as f:
            json.dump({"path": path, "backend": last_load.get("backend"), "bytes_read": last_load.get("bytes_read"),
                       "wrong": wrong, "steps_loaded": engine.global_steps - 1, "loss": loss.item(),
                       "params": sum(1 for _ in engine.module.parameters()),
                       # fp32 master + two Adam moments of every parameter, all ranks together
                       "state_bytes": 12 * sum(p.numel() for p in engine.module.parameters())}, f)
    _finish(engine)


def _finish(engine) -> None:
    """The rank's end: the engine's resources, then the group left together (see leave_and_exit)."""
    from .execution.distributed import leave_and_exit

    engine.destroy()
    leave_and_exit(0)


def _spawn(fn, nprocs: int, *args) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn")


def _run(cmd, what: str) -> str:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise DemoFailed(f"{what} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _compare_universal(expected: str, actual: str) -> int:
    import torch

    checked = 0
    for dirpath, _, files in os.walk(expected):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), expected)
            if not rel.startswith("zero" + os.sep):
                continue
            # both folders were written by this demo; neither is outside input
            a = torch.load(os.path.join(expected, rel), weights_only=False)
            b = torch.load(os.path.join(actual, rel), weights_only=False)
            ta = a["param"] if isinstance(a, dict) and "param" in a else a
            tb = b["param"] if isinstance(b, dict) and "param" in b else b
            if torch.is_tensor(ta):
                if not (ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(ta, tb)):
                    raise DemoFailed(f"{rel} differs between DeepSpeed's conversion and pyckpt's")
                if isinstance(a, dict) and sorted(a) != sorted(b):
                    raise DemoFailed(f"the keys of {rel} differ: {sorted(a)} vs {sorted(b)}")
            checked += 1
    return checked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyckpt.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir", nargs="?", help="where to put everything (default: a new temp folder)")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage of the training run")
    args = p.parse_args(argv)
    work = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="pyckpt-demo-"))
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    save_dir = os.path.join(work, "checkpoint")

    # 1. train and save
    tokenizer = build_tokenizer(os.path.join(work, "tokenizer"))
    t0 = time.perf_counter()
    _spawn(_train, TRAIN_RANKS, work, _free_port(), args.stage)
    tag = open(os.path.join(save_dir, "latest")).read().strip()
    tag_dir = os.path.join(save_dir, tag)
    companions = {"tokenizer.json", "config.json", "training_state.json"}
    missing = companions - set(os.listdir(tag_dir))
    if tag != f"global_step{STEPS}" or missing:
        raise DemoFailed(f"the saved checkpoint is {tag} and lacks {sorted(missing)}")
    state = json.load(open(os.path.join(tag_dir, "training_state.json")))
    print(f"[1/5] train+save: DeepSpeed ZeRO-{args.stage} trained a {len(tokenizer)}-word-vocab Llama for {STEPS} steps "
          f"on {TRAIN_RANKS} CPU ranks; pyckpt.deepspeed.save_checkpoint published {tag_dir} "
          f"(DeepSpeed's files + tokenizer, config, training state at step {state['global_steps']}), "
          f"latest -> {tag} ({time.perf_counter() - t0:.1f} s)")

    # 2. distributed conversion, checked against DeepSpeed's converter
    ours = os.path.join(save_dir, f"{tag}_universal")
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(TRAIN_RANKS),
                "-m", "pyckpt.convert", save_dir, ours, "--json"], "torchrun -m pyckpt.convert")
    report = json.loads(out)
    import deepspeed

    theirs = os.path.join(work, "deepspeed", f"{tag}_universal")
    script = os.path.join(os.path.dirname(deepspeed.__file__), "checkpoint", "ds_to_universal.py")
    _run([sys.executable, script, "--input_folder", tag_dir, "--output_folder", theirs], "ds_to_universal.py")
    n = _compare_universal(theirs, ours)
    print(f"[2/5] convert: torchrun --nproc_per_node {TRAIN_RANKS} -m pyckpt.convert wrote {ours} ({report['files']} "
          f"files, {report['bytes_written'] / 1e6:.1f} MB) with the processes sharing the files; DeepSpeed's "
          f"ds_to_universal.py wrote the same: its {n} zero/ files equal pyckpt's, tensor by tensor")

    # 3. export for Hugging Face
    hf = os.path.join(work, "hf")
    out = _run([sys.executable, "-m", "pyckpt.export", save_dir, hf, "--overwrite", "--json"], "python -m pyckpt.export")
    report = json.loads(out)
    print(f"[3/5] export: python -m pyckpt.export wrote {hf}: {', '.join(sorted(os.listdir(hf)))}")

    # 4. transformers loads it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    loaded_tok = AutoTokenizer.from_pretrained(hf)
    problems = {k: v for k, v in info.items() if v}
    reference = torch.load(os.path.join(work, "reference.pt"), weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=_ids(loaded_tok, SENTENCES[:2])).logits
    if problems or not torch.equal(logits, reference["logits"]):
        diff = (logits - reference["logits"]).abs().max().item() if logits.shape == reference["logits"].shape else None
        raise DemoFailed(f"from_pretrained: loading problems {problems}, logits max difference {diff}")
    if loaded_tok(SENTENCES)["input_ids"] != tokenizer(SENTENCES)["input_ids"]:
        raise DemoFailed("the exported tokenizer encodes differently")
    print(f"[4/5] transformers: from_pretrained({hf!r}) loaded {type(model).__name__} with nothing missing or "
          "unexpected; its logits equal the trained model's bit for bit, the tokenizer's ids are the same")

    # 5. resume on another number of ranks through the accelerated loader
    t0 = time.perf_counter()
    _spawn(_resume, RESUME_RANKS, work, _free_port(), args.stage)
    res = json.load(open(os.path.join(work, "resume.json")))
    if res["backend"] != "pyckpt" or res["wrong"] or res["steps_loaded"] != STEPS:
        raise DemoFailed(f"resume: {res}")
    print(f"[5/5] resume: DeepSpeed on {RESUME_RANKS} ranks with pyckpt.deepspeed.enable() loaded {res['path']} "
          f"(rank 0 read {res['bytes_read']} of the {res['state_bytes']} bytes of optimizer state); all {res['params']} fp32 masters equal the "
          f"export, step {res['steps_loaded']} restored, one more step: loss {res['loss']:.4f} "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"done: everything is in {work} (the ranks' logs in {os.path.join(work, 'logs')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
