"""A device check (scripts/gpu_bundle.sh prepares what it needs). On a CUDA machine, one rank: load a ZeRO checkpoint saved at 2 CPU ranks (ZeRO-2 and ZeRO-3, bf16)
three ways into a GPU engine and compare every optimizer tensor bit for bit, before and after one step:
stock (DeepSpeed's own universal load of ds_to_universal's folder), pyckpt-universal (the same under
enable(): pyckpt gathers into the CUDA partitions through pinned windows), pyckpt-reshard (a plain
load under enable(): the topology changed, so pyckpt resumes from the ZeRO shards)."""

import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLE = os.path.abspath(os.environ.get("PYCKPT_GPU_BUNDLE", os.path.join(HERE, "..", ".gpu")))  # z2/, z3/
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script on a CPU machine
if DEVICE == "cpu":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402

import pyckpt.deepspeed  # noqa: E402
from pyckpt.deepspeed.load import hooks  # noqa: E402
from make_real_checkpoint import build_model, ds_config  # noqa: E402


def engine_for(stage: int, universal: bool):
    model, _ = build_model("400K", 128)
    cfg = ds_config(stage, "bf16")
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def snapshot(engine, stage: int) -> dict:
    opt = engine.optimizer
    base = opt.optimizer
    flats = opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups
    out = {}
    for i, flat in enumerate(flats):
        assert flat.device.type == DEVICE, flat.device
        out[f"flat{i}"] = flat.detach().cpu().clone()
        for key, value in base.state.get(flat, {}).items():
            out[f"flat{i}/{key}"] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    for name, p in engine.module.named_parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p
        out[f"module/{name}"] = t.detach().cpu().clone()
    out["global_steps"] = engine.global_steps
    return out


def run(stage: int, way: str) -> dict:
    root = os.path.join(BUNDLE, f"z{stage}")
    engine = engine_for(stage, universal=way != "pyckpt-reshard")
    hooks.last_load.clear()
    handle = pyckpt.deepspeed.enable() if way != "stock" else None
    try:
        engine.load_checkpoint(root)
    finally:
        if handle:
            pyckpt.deepspeed.disable()
    info = dict(hooks.last_load)
    before = snapshot(engine, stage)
    torch.manual_seed(5)
    x = torch.randn(4, 128, dtype=torch.bfloat16, device=DEVICE)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    after = snapshot(engine, stage)
    engine.destroy()
    return {"before": before, "after": after, "loss": loss.item(), "info": info}


def differ(a: dict, b: dict) -> list:
    bad = [k for k in a if k not in b]
    for k, v in a.items():
        if k in b and (torch.is_tensor(v) and not (v.dtype == b[k].dtype and v.shape == b[k].shape and
                                                   torch.equal(v, b[k])) or not torch.is_tensor(v) and v != b[k]):
            bad.append(k)
    return bad


def main() -> int:
    deepspeed.init_distributed(dist_backend="nccl" if DEVICE == "cuda" else "gloo")
    print(f"device {DEVICE}: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}", flush=True)
    failures = 0
    for stage in (2, 3):
        results = {way: run(stage, way) for way in ("stock", "pyckpt-universal", "pyckpt-reshard")}
        stock = results["stock"]
        assert stock["info"] == {}, stock["info"]
        for way in ("pyckpt-universal", "pyckpt-reshard"):
            r = results[way]
            bad = differ(stock["before"], r["before"]) + differ(stock["after"], r["after"])
            same_loss = stock["loss"] == r["loss"]
            ok = not bad and same_loss and r["info"].get("backend") == "pyckpt"
            failures += not ok
            print(f"ZeRO-{stage} {way}: {'OK' if ok else 'MISMATCH'} ({len(stock['before'])} tensors, loss "
                  f"{r['loss']!r} vs {stock['loss']!r}, backend {r['info'].get('backend')}, direct "
                  f"{r['info'].get('direct')}, gathered {r['info'].get('bytes_read')} B in "
                  f"{r['info'].get('gather_s', 0):.4f} s) {bad[:8]}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
