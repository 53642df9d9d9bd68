"""A device check of the asynchronous save with real DeepSpeed on one CUDA rank (scripts/gpu_bundle.sh
carries DeepSpeed there; the command is in that script's header, with this file in place of
gpu_load_check.py).

For each ZeRO layout below, on the GPU: two training steps; DeepSpeed's own synchronous save of the
state (``bare``); then ``pyckpt.deepspeed.save_checkpoint(async_save=True)`` of the same state with
the background write held back, and two more training steps launched at once, while the snapshot's
device-to-host copies may still be in flight on the side stream. The check: the call returned before
the write ended, the steps changed the state, the published files are DeepSpeed's own bytes, and a
fresh engine resumed from them by DeepSpeed's ``load_checkpoint`` holds the state at the call, every
optimizer and parameter tensor bit for bit. A missing wait between the side stream and the training
stream shows up here as a resumed tensor holding a later step's values.

On a machine without CUDA the same runs take the host path (a dry run of this script)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
os.environ.setdefault("MASTER_PORT", "29518")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402

import pyckpt.deepspeed as pd  # noqa: E402
from make_real_checkpoint import build_model, ds_config, skip_shm_comm_op  # noqa: E402
from pyckpt.deepspeed.save import async_save  # noqa: E402

WIDTH = int(os.environ.get("PYCKPT_GPU_SAVE_WIDTH", "1024"))
PARAMS = os.environ.get("PYCKPT_GPU_SAVE_PARAMS", "24M")  # ~100 MB of fp32 state a tensor kind: copies take ms

# name -> (stage, bf16, offload, grad_accum_dtype)
CONFIGS = {
    "z1-bf16": (1, True, False, None),
    "bf16-optimizer": (1, True, False, "fp32"),
    "z2-fp32": (2, False, False, None),
    "z2-bf16": (2, True, False, None),
    "z3-bf16": (3, True, False, None),
    "z2-bf16-offload": (2, True, True, None),
    "z3-bf16-offload": (3, True, True, None),
}


def config_of(stage: int, bf16: bool, offload: bool, grad_accum_dtype) -> dict:
    """The benchmarks' DeepSpeed config (torch's Adam, one sample a step) with the layout's options."""
    cfg = ds_config(stage, "bf16" if bf16 else "fp32")
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if grad_accum_dtype:
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return cfg


def make_engine(spec):
    model, _ = build_model(PARAMS, WIDTH)
    engine, *_ = deepspeed.initialize(model=model, config=config_of(*spec), model_parameters=model.parameters())
    return engine


def step(engine, spec, seed: int) -> float:
    torch.manual_seed(seed)
    x = torch.randn(1, WIDTH, dtype=torch.bfloat16 if spec[1] else torch.float32, device=engine.device)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def state_of(engine) -> dict:
    """Every tensor of the optimizer's state_dict and every parameter (ZeRO-3: the rank's partition),
    copied to the host; plain values as they are; other objects by type."""
    out = {}

    def walk(prefix, obj):
        if torch.is_tensor(obj):
            out[prefix] = obj.detach().to("cpu", copy=True)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        elif obj is None or isinstance(obj, (bool, int, float, str)):
            out[prefix] = obj
        else:
            out[prefix] = type(obj).__name__

    walk("optimizer", engine.optimizer.state_dict())
    for name, p in engine.module.named_parameters():
        walk(f"module/{name}", p.ds_tensor if hasattr(p, "ds_tensor") else p)
    out["global_steps"] = engine.global_steps
    return out


def differ(a: dict, b: dict) -> list:
    bad = sorted(set(a) ^ set(b))
    for k, v in a.items():
        if k not in b:
            continue
        w = b[k]
        if torch.is_tensor(v):
            if not (torch.is_tensor(w) and v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w)):
                bad.append(k)
        elif v != w:
            bad.append(k)
    return bad


@contextlib.contextmanager
def held_background_write(gate: threading.Event, limit_s: float = 120.0):
    """The background write waits for ``gate`` (set once the caller's steps after the save have run),
    so "the save was not done after the steps" holds on a slow or busy machine too, not only when the
    steps outran a fixed delay."""
    real = async_save.write_files

    def held(*args, **kwargs):
        gate.wait(limit_s)
        return real(*args, **kwargs)

    async_save.write_files = held
    try:
        yield
    finally:
        async_save.write_files = real


def tree(folder: str) -> dict:
    return {os.path.relpath(os.path.join(d, f), folder): os.path.join(d, f)
            for d, _, fs in os.walk(folder) for f in fs}


def check(name: str, spec, root: str) -> bool:
    engine = make_engine(spec)
    for s in range(2):
        step(engine, spec, s)
    t0 = time.perf_counter()
    engine.save_checkpoint(os.path.join(root, "bare"), tag="t", client_state={"note": name})
    sync_s = time.perf_counter() - t0
    saved = state_of(engine)
    gate = threading.Event()
    with held_background_write(gate):
        handle = pd.save_checkpoint(engine, os.path.join(root, "async"), tag="t", client_state={"note": name},
                                    async_save=True)
        done_at_return = handle.done()
        for s in range(2):  # launched right away: the snapshot's copies may still be in flight
            step(engine, spec, 10 + s)
        done_after_steps = handle.done()
        gate.set()
        ok = handle.wait()
    changed = differ(saved, state_of(engine)) != []
    pinned = all(c.is_pinned() for c in engine._pyckpt_arena.chunks) if DEVICE == "cuda" else None
    engine.destroy()
    bare, written = tree(os.path.join(root, "bare", "t")), tree(os.path.join(root, "async", "t"))
    extras = sorted(set(written) - set(bare))
    unequal = [rel for rel, path in sorted(bare.items())
               if rel not in written or open(path, "rb").read() != open(written[rel], "rb").read()]
    fresh = make_engine(spec)
    path, client = fresh.load_checkpoint(os.path.join(root, "async"))
    problems = differ(saved, state_of(fresh))
    fresh.destroy()
    good = (ok and not done_at_return and not done_after_steps and changed and extras == ["training_state.json"]
            and not unequal and not problems and client.get("note") == name
            and path.startswith(os.path.join(root, "async", "t")))
    print(f"{name}: {'OK' if good else 'FAILED'} (ok {ok}, done at return {done_at_return}, after steps "
          f"{done_after_steps}, state changed {changed}, {len(bare)} files, unequal {unequal[:4]}, extras {extras}, "
          f"resumed tensors {len(saved)} differing {problems[:6]}, pinned arena {pinned}; "
          f"stall {handle.stall_s * 1e3:.1f} ms vs DeepSpeed's save {sync_s * 1e3:.0f} ms)", flush=True)
    return good


def main() -> int:
    if DEVICE == "cpu":
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if DEVICE == "cuda" else "gloo")
    print(f"device {DEVICE}: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, model {PARAMS} "
          f"width {WIDTH}", flush=True)
    wanted = sys.argv[1:] or list(CONFIGS)
    failures = 0
    for name in wanted:
        root = tempfile.mkdtemp(prefix=f"gpu_save_{name}_")
        try:
            failures += not check(name, CONFIGS[name], root)
        except Exception as exc:  # one layout's failure must not hide the others' results
            failures += 1
            print(f"{name}: ERROR {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{len(wanted) - failures} of {len(wanted)} layouts OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
