"""The built-in example: ``python -m pyckpt.demo [WORKDIR]`` (needs the ``deepspeed`` extra).

1. DeepSpeed trains a small MLP for a few steps on 2 CPU ranks (gloo) with ZeRO stage 2 and saves
   a checkpoint, as a training job would;
2. pyckpt converts it to Universal format;
3. DeepSpeed's own ds_to_universal.py converts it too, and every output file is compared tensor by
   tensor, key by key with pyckpt's.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank: int, save_dir: str, port: int, stage: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    import torch
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 129), torch.nn.GELU(), torch.nn.Linear(129, 33))
    config = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(4, 64, generator=gen)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    # Universal conversion needs this key (DeepSpeed's ds_to_universal asserts it).
    engine.save_checkpoint(save_dir, client_state={"universal_checkpoint_info": {}})


def _compare(expected: str, actual: str) -> int:
    import torch

    checked = 0
    for dirpath, _, files in os.walk(expected):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), expected)
            if not rel.startswith("zero" + os.sep):
                continue
            a = torch.load(os.path.join(expected, rel), weights_only=False)
            b = torch.load(os.path.join(actual, rel), weights_only=False)
            ta = a["param"] if isinstance(a, dict) and "param" in a else a
            tb = b["param"] if isinstance(b, dict) and "param" in b else b
            if torch.is_tensor(ta):
                if not (ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(ta, tb)):
                    raise SystemExit(f"MISMATCH in {rel}")
                if isinstance(a, dict) and sorted(a) != sorted(b):
                    raise SystemExit(f"MISMATCH in keys of {rel}: {sorted(a)} vs {sorted(b)}")
            checked += 1
    return checked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyckpt.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir", nargs="?", help="where to put the checkpoints (default: a new temp folder)")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="pyckpt-demo-")
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.multiprocessing as mp

    save_dir = os.path.join(work, "checkpoint")
    print(f"[1/3] DeepSpeed ZeRO-{args.stage} training on {WORLD} CPU ranks, saving to {save_dir}")
    mp.start_processes(_train, args=(save_dir, _free_port(), args.stage), nprocs=WORLD, start_method="spawn")
    tag = open(os.path.join(save_dir, "latest")).read().strip()

    from pyckpt import convert_to_universal

    ours = os.path.join(save_dir, f"{tag}_universal")
    report = convert_to_universal(save_dir, ours, overwrite=True)
    print(f"[2/3] pyckpt: {report.summary()}")

    import deepspeed
    theirs = os.path.join(work, "deepspeed", f"{tag}_universal")
    script = os.path.join(os.path.dirname(deepspeed.__file__), "checkpoint", "ds_to_universal.py")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, script, "--input_folder", os.path.join(save_dir, tag), "--output_folder", theirs],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ds_seconds = time.perf_counter() - t0
    n = _compare(theirs, ours)
    print(f"[3/3] DeepSpeed's ds_to_universal.py took {ds_seconds:.2f} s; its {n} zero/ files and pyckpt's "
          "are identical, tensor by tensor")
    print(f"Resume with {{\"checkpoint\": {{\"load_universal\": true}}}} and "
          f"engine.load_checkpoint({save_dir!r}) (reads latest_universal).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
