"""Make a real DeepSpeed ZeRO checkpoint of a given size on CPU (one training step, then save).

    torchrun --standalone --nproc_per_node 4 benchmarks/make_real_checkpoint.py OUT --params 200M --stage 2

The model is a stack of square Linear layers (width --width) with a small odd-sized head so the
partitions carry padding. Real DeepSpeed writes every file, so this is the format-exact input the
benchmarks use against ds_to_universal.
"""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KMBG" else text) * scale)


def build_model(params: str, width: int):
    """(the model, its layer count): square Linear(width) layers + ReLU to about ``params``
    parameters, then a 7-wide head; seeded, so every rank (and a later loader) builds the same."""
    import torch

    layers = max(1, round(parse_count(params) / (width * width + width)))
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 7)), layers


def ds_config(stage: int, dtype: str = "fp32") -> dict:
    cfg = {
        "train_batch_size": int(os.environ.get("WORLD_SIZE", "1")),
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def skip_shm_comm_op() -> None:
    """On DeepSpeed's CPU accelerator, init_distributed compiles its shared-memory comm op (~35 s on
    2 cores in a fresh TORCH_EXTENSIONS_DIR). That op backs only inference_all_reduce, which no save or
    training step here calls; DeepSpeed skips the build when deepspeed.ops.__compatible_ops__ marks the
    op incompatible, and that dict is read for nothing else."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--params", default="200M")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()

    import torch
    import deepspeed

    w = args.width
    model, layers = build_model(args.params, w)
    cfg = ds_config(args.stage, args.dtype)
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(1, w, dtype=dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.out, client_state={"universal_checkpoint_info": {}})
    if torch.distributed.get_rank() == 0:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(f"saved {n} parameters ({layers} x Linear({w},{w}) + head) to {args.out}")


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    main()
    leave_and_exit(0)
