"""The save glue against a bare DeepSpeed save, in one training job, rounds alternating.

    torchrun --standalone --nproc_per_node 4 benchmarks/save.py /tmp/bench12/save --params 200M --stage 2 \
        --rounds 0 --async-rounds 5 --json benchmarks/results/async_save_z2_200M_dp4.json


    torchrun --standalone --nproc_per_node 4 benchmarks/save.py /tmp/bench12/save --params 200M --stage 2 \
        --rounds 5 --universal-rounds 2 --json benchmarks/results/save_z2_200M_dp4.json

Every rank trains one step of the benchmarks' Linear stack (make_real_checkpoint.py's model), then:

* ``bare``: ``engine.save_checkpoint(dir, tag)``, DeepSpeed's own save;
* ``glue``: ``pyckpt.deepspeed.save_checkpoint(engine, dir, tag)``: the same files under a staging tag,
  the arrival check, the free-space estimate, two agreements, the training-state file, the rename and
  an atomic ``latest``;

alternating which goes first, each timed from a barrier to the last rank's return, the checkpoint
deleted and the page cache synced after each (so every save starts with no dirty pages). Then, with
``--universal-rounds``, a resumable-anywhere checkpoint two ways: ``save_checkpoint(universal=True)``
(the ranks convert together) against a bare save followed by DeepSpeed's ``ds_to_universal.py``
(defaults, run from rank 0 while the others wait, as a job script would).

With ``DS_ACCELERATOR=cuda`` (one rank a GPU, NCCL) the engine and its state live on the GPU; the
memcpy floor is then a device-to-host copy of the snapshot's bytes into pinned memory, and the
asynchronous rounds also report when the snapshot's copies (in flight on a side stream when the call
returns) have landed: ``alone_snapshot`` is the call plus that wait.
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

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_real_checkpoint import build_model, ds_config, skip_shm_comm_op  # noqa: E402


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _slowest(value: float) -> float:
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return max(gathered)


def _batch(args, engine):
    import torch

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return torch.randn(1, args.width, dtype=dtype, device=engine.device)


def _async_rounds(args, engine, client, rank, world, clear) -> dict:
    """DeepSpeed's synchronous save against an asynchronous one, alternating which goes first.

    Per round: the stall (from a barrier to the slowest rank's return from the call), the time to
    the published checkpoint (the slowest rank's outcome known), the training steps that run while
    the asynchronous save is written against the same number of steps without a save, and a plain
    copy of the bytes the snapshot holds (each rank copies that many bytes between two warm buffers,
    the floor for any snapshot)."""
    import torch
    import torch.distributed as dist

    import pyckpt.deepspeed as pd
    from pyckpt.deepspeed.save.in_flight import save_in_flight

    cuda = engine.device.type == "cuda"

    def step() -> float:
        t0 = time.perf_counter()
        loss = engine(_batch(args, engine)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()  # the step's own time, not its launch
        return time.perf_counter() - t0

    # the first asynchronous save allocates the snapshot buffers; later ones reuse them
    t0 = time.perf_counter()
    pd.save_checkpoint(engine, os.path.join(args.out, "warm"), tag="w", client_state=client, async_save=True).wait()
    handle = save_in_flight(engine)
    first_call = _slowest(handle.stall_s if handle else time.perf_counter() - t0)
    clear()
    arena = engine._pyckpt_arena
    snapshot_bytes = arena.used
    # warm: no page faults in the timed copy
    dst = torch.empty(arena.held, dtype=torch.uint8, pin_memory=cuda).fill_(2)
    src = torch.ones(snapshot_bytes, dtype=torch.uint8, device=engine.device) if cuda else None

    def memcpy():
        if cuda:  # the state's bytes from the device into pinned host memory, the floor on a GPU
            dst[:snapshot_bytes].copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return
        at = 0
        for chunk, filled in zip(arena.chunks, arena.extents):  # the bytes the snapshot copied, into a warm buffer
            dst[at:at + filled].copy_(chunk[:filled])
            at += filled
    rounds = []
    for r in range(args.async_rounds):
        order = ["sync", "async", "alone"] if r % 2 == 0 else ["alone", "async", "sync"]
        row = {"round": r, "order": order}
        for way in order:
            folder = os.path.join(args.out, way)
            if way == "sync":
                row["sync_stall"] = _timed(lambda: engine.save_checkpoint(folder, tag=f"r{r}", client_state=client))
            elif way == "alone":
                # the same asynchronous save with nothing running beside its write: the pipeline's own cost
                dist.barrier()
                t0 = time.perf_counter()
                handle = pd.save_checkpoint(engine, folder, tag=f"r{r}", client_state=client, async_save=True)
                if cuda:
                    torch.cuda.current_stream().synchronize()  # it waits on the snapshot's copies
                    row["alone_snapshot"] = _slowest(time.perf_counter() - t0)
                handle.wait()
                row["alone_published"] = _slowest(handle.published_s)
            else:
                dist.barrier()
                handle = pd.save_checkpoint(engine, folder, tag=f"r{r}", client_state=client, async_save=True)
                row["async_stall"] = _slowest(handle.stall_s)
                overlapped = [step() for _ in range(args.overlap_steps)]
                row["overlap_done"] = handle.done()
                handle.wait()
                row["async_published"] = _slowest(handle.published_s)
                row["overlap_step"] = _slowest(statistics.median(overlapped))
            clear()
        row["plain_step"] = _slowest(statistics.median(step() for _ in range(args.overlap_steps)))
        dist.barrier()
        t0 = time.perf_counter()
        memcpy()
        row["memcpy"] = _slowest(time.perf_counter() - t0)
        if cuda:
            row["sync_over_snapshot"] = row["sync_stall"] / row["alone_snapshot"]
            row["snapshot_over_memcpy"] = row["alone_snapshot"] / row["memcpy"]
        row["sync_over_async_stall"] = row["sync_stall"] / row["async_stall"]
        row["async_stall_over_memcpy"] = row["async_stall"] / row["memcpy"]
        row["overlap_step_over_plain"] = row["overlap_step"] / row["plain_step"]
        row["published_over_sync"] = row["async_published"] / row["sync_stall"]
        row["alone_published_over_sync"] = row["alone_published"] / row["sync_stall"]
        rounds.append(row)
        if rank == 0:
            print(f"async round {r}: stall {row['async_stall']:.3f} s vs DeepSpeed's save {row['sync_stall']:.2f} s "
                  f"({row['sync_over_async_stall']:.1f}x less), memcpy {row['memcpy']:.3f} s "
                  f"(stall/memcpy {row['async_stall_over_memcpy']:.2f}), steps during the write "
                  f"{row['overlap_step']:.2f} s vs {row['plain_step']:.2f} s ({row['overlap_step_over_plain']:.2f}x), "
                  f"published after {row['async_published']:.2f} s ({row['published_over_sync']:.2f}x the sync save; "
                  f"{row['alone_published_over_sync']:.2f}x with no training beside the write)",
                  flush=True)
    keys = ["sync_over_async_stall", "async_stall_over_memcpy", "overlap_step_over_plain", "published_over_sync",
            "alone_published_over_sync", "async_stall", "sync_stall", "memcpy", "plain_step", "overlap_step",
            "async_published", "alone_published"]
    if cuda:
        keys += ["alone_snapshot", "sync_over_snapshot", "snapshot_over_memcpy"]
        if rank == 0:
            print(f"snapshot copies landed {statistics.median(r['alone_snapshot'] for r in rounds):.3f} s after the "
                  f"call ({statistics.median(r['sync_over_snapshot'] for r in rounds):.1f}x less than DeepSpeed's "
                  f"save; {statistics.median(r['snapshot_over_memcpy'] for r in rounds):.2f}x the device-to-host "
                  "copy of the same bytes)", flush=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in keys}
    return {"rounds": rounds, "snapshot_bytes_rank0": snapshot_bytes, "first_call_stall": first_call,
            "medians": med}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", help="scratch folder for the checkpoints (emptied after every round)")
    p.add_argument("--params", default="200M")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--universal-rounds", type=int, default=0)
    p.add_argument("--async-rounds", type=int, default=0,
                   help="rounds of DeepSpeed's save vs save_checkpoint(async_save=True) (issue 26's figures)")
    p.add_argument("--overlap-steps", type=int, default=3,
                   help="training steps timed while an asynchronous save is written, and without one")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    import pyckpt.deepspeed as pd

    from deepspeed.accelerator import get_accelerator

    on_cpu = get_accelerator().device_name() == "cpu"
    if on_cpu:
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    model, layers = build_model(args.params, args.width)
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them away
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(args.stage, args.dtype),
                                      model_parameters=model.parameters())
    loss = engine(_batch(args, engine)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    client = {"universal_checkpoint_info": {}}

    def clear():
        # Every timed save starts with no dirty pages: without the sync, the second save of a round
        # runs into the writeback of the first one's 3 GB and the order decides the ratio.
        if rank == 0:
            if os.path.exists(args.out):
                shutil.rmtree(args.out)
            os.sync()
        dist.barrier()

    clear()
    # The glue's own cost, free of the I/O noise between rounds: its wall time less the DeepSpeed
    # save inside it (the slowest rank's), measured in the same call.
    inner = []
    deepspeed_save = engine.save_checkpoint

    def timed_deepspeed_save(*a, **kw):
        t0 = time.perf_counter()
        try:
            return deepspeed_save(*a, **kw)
        finally:
            inner.append(time.perf_counter() - t0)

    def glue(d, tag):
        engine.save_checkpoint = timed_deepspeed_save
        try:
            pd.save_checkpoint(engine, d, tag=tag, client_state=client)
        finally:
            del engine.save_checkpoint

    ways = {"bare": lambda d, tag: engine.save_checkpoint(d, tag=tag, client_state=client), "glue": glue}
    rounds = []
    written = None
    for r in range(args.rounds):
        order = ["bare", "glue"] if r % 2 == 0 else ["glue", "bare"]
        row = {"round": r, "order": order}
        for way in order:
            folder = os.path.join(args.out, way)
            row[way] = _timed(lambda: ways[way](folder, f"r{r}"))
            if rank == 0:
                written = _size(os.path.join(folder, f"r{r}"))
            clear()
        row["glue_over_bare"] = row["glue"] / row["bare"]
        gathered = [None] * world
        dist.all_gather_object(gathered, inner.pop())
        row["glue_deepspeed_part"] = max(gathered)
        row["glue_own"] = row["glue"] - row["glue_deepspeed_part"]
        row["glue_own_over_bare"] = row["glue_own"] / row["bare"]
        rounds.append(row)
        if rank == 0:
            print(f"round {r}: bare {row['bare']:.2f} s, glue {row['glue']:.2f} s (DeepSpeed's save inside: "
                  f"{row['glue_deepspeed_part']:.2f} s, the glue's own: {row['glue_own'] * 1e3:.0f} ms = "
                  f"{100 * row['glue_own_over_bare']:.1f}% of the bare save), glue/bare {row['glue_over_bare']:.3f}",
                  flush=True)

    universal = []
    script = os.path.join(os.path.dirname(deepspeed.__file__), "checkpoint", "ds_to_universal.py")
    for r in range(args.universal_rounds):
        row = {"round": r}
        order = ["pyckpt", "deepspeed"] if r % 2 == 0 else ["deepspeed", "pyckpt"]
        for way in order:
            folder = os.path.join(args.out, way)
            if way == "pyckpt":
                row[way] = _timed(lambda: pd.save_checkpoint(engine, folder, tag="u", client_state=client,
                                                             universal=True))
            else:
                def save_then_convert():
                    engine.save_checkpoint(folder, tag="u", client_state=client)
                    if rank == 0:
                        subprocess.run([sys.executable, script, "--input_folder", os.path.join(folder, "u"),
                                        "--output_folder", os.path.join(folder, "u_universal")], check=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

                row[way] = _timed(save_then_convert)
            clear()
        row["deepspeed_over_pyckpt"] = row["deepspeed"] / row["pyckpt"]
        universal.append(row)
        if rank == 0:
            print(f"universal round {r}: save + ds_to_universal {row['deepspeed']:.2f} s, "
                  f"save_checkpoint(universal=True) {row['pyckpt']:.2f} s, ratio {row['deepspeed_over_pyckpt']:.2f}",
                  flush=True)

    asynchronous = _async_rounds(args, engine, client, rank, world, clear) if args.async_rounds else None

    if rank == 0:
        result = {"params": params, "stage": args.stage, "dtype": args.dtype, "world_size": world,
                  "cores": os.cpu_count(), "device": str(engine.device),
                  "device_name": None if on_cpu else torch.cuda.get_device_name(engine.device),
                  "checkpoint_bytes": written, "rounds": rounds, "universal": universal,
                  "median_glue_over_bare": statistics.median(r["glue_over_bare"] for r in rounds) if rounds else None,
                  "median_glue_own_over_bare": statistics.median(r["glue_own_over_bare"] for r in rounds) if rounds else None,
                  "median_glue_own_seconds": statistics.median(r["glue_own"] for r in rounds) if rounds else None,
                  "median_deepspeed_over_pyckpt": statistics.median(r["deepspeed_over_pyckpt"] for r in universal)
                  if universal else None, "async": asynchronous}
        print(json.dumps({k: v for k, v in result.items() if k.startswith("median") or k == "checkpoint_bytes"}))
        if asynchronous:
            print(json.dumps({"async medians": asynchronous["medians"]}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    engine.destroy()
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main())
