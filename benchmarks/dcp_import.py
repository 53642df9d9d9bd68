"""A torch.distributed.checkpoint (DCP) folder to a Hugging Face model folder: pyckpt vs torch's and
torchtitan's ways of doing it vs a copy, on a checkpoint saved by a real FSDP2 job.

    python benchmarks/dcp_import.py --quick                       # smoke run: ~20M parameters, one warm round
    python benchmarks/dcp_import.py --params 1B --second 200M --rounds 3 --json benchmarks/results/dcp_import_1B.json
    python benchmarks/dcp_import.py --params 500M --tools "torch,torchtitan,cp output" --rounds 1

The checkpoint. ``torchrun --nproc_per_node RANKS`` (gloo, CPU) builds a transformers LlamaForCausalLM
of about --params parameters (hidden 2048 at 300M and up, 32 heads, 4 key-value heads, vocabulary
32,000, untied head; the layer count rounded up so the count is at least the size asked for), fp32,
on the meta device, shards it with ``fully_shard`` per decoder layer and on the model (FSDP2),
materialises each rank's shards only (``to_empty``, then a seeded init of the local shards), takes one
torch AdamW step on a 16-token batch (so ``exp_avg``/``exp_avg_sq`` exist) and saves
``dcp.save({"model": msd, "optim": osd})`` with ``get_state_dict`` (the FileSystemWriter default:
one ``__K_0.distcp`` per rank and ``.metadata``). The model's config.json is written beside the DCP
folder. It goes under --root (on disk by default, not /dev/shm), is reused when it is there already
and deleted at the end unless --keep.

Contenders, each a fresh process (the measuring script imports neither torch nor transformers: a child's
``ru_maxrss`` starts from its parent's, and ``subprocess`` forks this process before the exec, so
this script's own peak, reported as ``driver_peak_rss_mib``, ~20 MiB, is the floor of every RSS figure):
- "pyckpt": ``python -m pyckpt export DCP OUT`` (fp32 model.safetensors, or shards + index), and
  "pyckpt bf16" with ``--dtype bf16``.
- "torch": the road torch itself documents, in two processes run back to back: step 1
  ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DCP, tmp.pt)`` (the whole checkpoint,
  weights and Adam state, gathered in memory and written as one torch.save file), step 2
  ``torch.load(tmp.pt, mmap=True, weights_only=True)``, the "model" entries cut into 5GB files by
  ``huggingface_hub.split_torch_state_dict_into_shards`` (what ``save_pretrained`` uses) and written
  with ``safetensors.torch.save_file`` (+ model.safetensors.index.json when sharded). Reported as the
  sum ("torch") and each step alone ("torch step 1", "torch step 2"); the temporary .pt lives in the
  output folder, so its peak disk shows it. ``mmap=True`` is the baseline's best case: step 2 then
  reads only the model's bytes of tmp.pt, not the optimizer's.
- "torchtitan": the procedure of torchtitan's ``scripts/checkpoint_conversion/convert_to_hf.py``
  (github.com/pytorch/torchtitan; not in the torchtitan 0.3.0 wheel). That script builds the torchtitan
  model at full size on the CPU, takes its state dict as the target, ``dcp.load``s the checkpoint into it
  in one process without a process group, maps the names with the model's state-dict adapter (torchtitan
  names to Hugging Face ones), casts to --export_dtype, and ``dcp.save``s the result with torch's
  ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True, thread_count_consolidation=5,
  fqn_to_index_mapping=<the adapter's file index>)``, which writes ``sharded/`` files first and then
  consolidates them into ``model-0000K-of-0000N.safetensors`` + index. The checkpoint here is a
  transformers model's, already under Hugging Face names, so torchtitan's model and adapter have nothing
  to do with it: the stand-in allocates the target tensors empty at the checkpoint's shapes (from the
  config, built on the meta device; the script's own build also initialises the weights, which is left
  out in the baseline's favour), loads ``{"model": target}`` with ``dcp.load`` (the checkpoint's keys are
  ``model.<name>``), leaves the names as they are (the adapter's job is the identity here), and writes with
  the same writer and settings; the file index is the 5GB split above. "torchtitan bf16" casts first, as
  ``--export_dtype bfloat16`` does. Its output keeps the ``sharded/`` folder, as the script's does.
- "cp output": ``cp -r`` of pyckpt's fp32 output folder (made untimed before the rounds), the floor:
  the same bytes written with no work. (When pyckpt cannot run, the torch road's output folder, the same
  tensors, stands in as the source.)

Cache states ("cold", "warm"; --quick: warm only), interleaved with the rounds, each contender in a
rotating order: before every timed run the dirty pages are flushed (``sync``, untimed); "warm" then
reads the input folder through (as benchmarks/run.py does), "cold" drops the input's pages
(``posix_fadvise(DONTNEED)`` on every input file after the sync; cp's source is treated as its input).
Step 2 of the torch road follows step 1 at once, as a user's script would run it.

Before any timing, each contender runs once untimed at every size (--no-check to skip) and the outputs
are read back with safetensors and compared tensor by tensor (names, dtype, shape, bytes): pyckpt's fp32
against the torch road's and torchtitan's, pyckpt's bf16 against torchtitan's bf16 (or, when that is
not run, the torch road's tensors cast with ``.to(torch.bfloat16)``); any difference stops the run.
If ``python -m pyckpt export`` cannot read the DCP folder (a build without the DCP reader), its
contenders are reported as unavailable (with the error's last line) and the rest still runs.

Report (JSON, --json, and a Markdown table on stdout): per size, cache state and contender the median
seconds (min-max), peak RSS of its process tree (MiB), peak disk of its output folder, output bytes;
per-round ratios and medians of fastest baseline / pyckpt (goal >= 5), pyckpt / cp output (goal <= 1.5),
and pyckpt's peak RSS at each size (goal <= 128 MiB, flat from --second to --params).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import folder_bytes, run_measured

THIS = str(Path(__file__).resolve())
PY = sys.executable

PYCKPT, PYCKPT_BF16 = "pyckpt", "pyckpt bf16"
TORCH, TORCH_1, TORCH_2 = "torch", "torch step 1", "torch step 2"
TITAN, TITAN_BF16 = "torchtitan", "torchtitan bf16"
COPY = "cp output"
CONTENDERS = (PYCKPT, PYCKPT_BF16, TORCH, TITAN, TITAN_BF16, COPY)
BASELINES = (TORCH, TITAN)  # fp32 outputs, the same job as "pyckpt"
MODES = ("cold", "warm")
GOALS = {"speedup": 5.0, "vs_copy": 1.5, "rss_mib": 128.0}


# ----------------------------------------------------------------------------------------------------------
# sizes


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KMBG" else text) * scale)


def llama_shape(params: int) -> dict:
    """LlamaConfig arguments for about ``params`` parameters: the width from the size class, then as many
    layers as reach the size (rounded up, so a 500M request is not a 480M model)."""
    if params < 60 * 10**6:
        width = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "vocab_size": 8192}
    elif params < 300 * 10**6:
        width = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "vocab_size": 32000}
    else:
        width = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "vocab_size": 32000}
    fixed, per_layer = _counts(width)
    layers = max(1, math.ceil((params - fixed) / per_layer))
    return {**width, "num_hidden_layers": layers, "tie_word_embeddings": False, "max_position_embeddings": 2048}


def _counts(c: dict) -> tuple:
    h, v, i = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    return 2 * v * h + h, per_layer  # embedding, untied head, final norm


def param_count(c: dict) -> int:
    fixed, per_layer = _counts(c)
    return fixed + per_layer * c["num_hidden_layers"]


# ----------------------------------------------------------------------------------------------------------
# worker modes: each runs in its own process (torchrun's ranks, the contenders, the check)


def _make_rank(out: str, config_json: str) -> None:
    """One FSDP2 rank: meta build, shard, materialise the local shards, one AdamW step, DCP save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = LlamaConfig(**json.loads(config_json))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # Only this rank's shards take memory: four full 1B fp32 models with Adam state would not fit in RAM.
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if name.endswith("norm.weight"):
                local.copy_(1 + 0.01 * torch.randn(local.shape, generator=gen))
            else:
                local.copy_(0.02 * torch.randn(local.shape, generator=gen))
    # to_empty left the rotary frequencies (a non-persistent buffer) as garbage; a fresh module has them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    # The gradients are not saved; freeing them leaves room for four ranks of a 1B model in 23 GB.
    optim.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.barrier()
    if rank == 0:
        cfg.to_json_file(str(Path(out).parent / "config.json"))
        n = sum(p.numel() for p in model.parameters())
        print(f"saved {n:,} parameters, loss {loss.item():.4f}, to {out}", flush=True)
    dist.destroy_process_group()


def _split(sd: dict) -> tuple:
    """(file name -> tensor names, tensor name -> file name, index metadata or None): the 5GB cut
    huggingface_hub gives save_pretrained."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(sd, max_shard_size="5GB")
    meta = {"metadata": split.metadata, "weight_map": split.tensor_to_filename} if split.is_sharded else None
    return split.filename_to_tensors, split.tensor_to_filename, meta


def _torch_step1(dcp_dir: str, pt: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dir, pt)


def _torch_step2(pt: str, out: str, config: str) -> None:
    import torch
    from safetensors.torch import save_file

    sd = torch.load(pt, mmap=True, weights_only=True)["model"]
    files, _, index = _split(sd)
    os.makedirs(out, exist_ok=True)
    for name, keys in files.items():
        save_file({k: sd[k].contiguous() for k in keys}, os.path.join(out, name), metadata={"format": "pt"})
    if index is not None:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    shutil.copy(config, os.path.join(out, "config.json"))
    os.unlink(pt)  # a temporary file of this road, not part of its output


def _titan(dcp_dir: str, out: str, config: str, dtype: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.inference_mode():
        cfg = LlamaConfig.from_json_file(config)
        with torch.device("meta"):
            shapes = LlamaForCausalLM(cfg).state_dict()
        target = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}
        dcp.load({"model": target}, checkpoint_id=dcp_dir)
        files, to_file, _ = _split(target)
        index = {name: i for i, name in enumerate(sorted(files), start=1)}
        writer = HuggingFaceStorageWriter(path=out, save_distributed=True, enable_consolidation=True,
                                          thread_count_consolidation=5,
                                          fqn_to_index_mapping={k: index[f] for k, f in to_file.items()})
        if dtype == "bf16":
            target = {k: v.to(torch.bfloat16) for k, v in target.items()}
        dcp.save(target, storage_writer=writer)
    shutil.copy(config, os.path.join(out, "config.json"))


def _check(pairs_json: str) -> None:
    """For each [a, b, cast] of the list: exit 1 unless the safetensors files directly in folders a and b
    hold the same tensors, b's first cast to bfloat16 when cast is "bf16" (torch's rounding)."""
    import torch
    from safetensors import safe_open

    for a, b, cast in json.loads(pairs_json):
        print(f"{a} == {b}{' as bf16' if cast else ''}: {_same(a, b, cast, torch, safe_open)} tensors equal",
              flush=True)


def _same(a: str, b: str, cast: str, torch, safe_open) -> int:
    """The number of tensors, all equal in name, dtype, shape and bytes; SystemExit at the first that is not."""
    def index(folder):
        where = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                where.update(dict.fromkeys(h.keys(), f))
        return where

    x, y = index(a), index(b)
    if sorted(x) != sorted(y):
        raise SystemExit(f"{a} vs {b}: names differ: {sorted(set(x) ^ set(y))[:5]} ({len(x)} vs {len(y)} tensors)")
    for k in sorted(x):
        with safe_open(str(x[k]), "pt") as h:
            s = h.get_tensor(k)
        with safe_open(str(y[k]), "pt") as h:
            t = h.get_tensor(k)
        if cast == "bf16":
            t = t.to(torch.bfloat16)
        if s.dtype != t.dtype or s.shape != t.shape:
            raise SystemExit(f"{a} vs {b}: {k}: {s.dtype} {tuple(s.shape)} vs {t.dtype} {tuple(t.shape)}")
        if not torch.equal(s.contiguous().view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8)):
            raise SystemExit(f"{a} vs {b}: {k}: values differ")
    return len(x)


WORKERS = {"_make": lambda a: _make_rank(a[0], a[1]), "_torch1": lambda a: _torch_step1(*a),
           "_torch2": lambda a: _torch_step2(*a), "_titan": lambda a: _titan(*a), "_check": lambda a: _check(*a)}


# ----------------------------------------------------------------------------------------------------------
# the driver


def make_checkpoint(root: Path, params: int, ranks: int) -> Path:
    """root/ckpt_<params>_r<ranks>/dcp with config.json beside it; reused when complete."""
    shape = llama_shape(params)
    home = root / f"ckpt_{params // 10**6}M_r{ranks}"
    dcp_dir = home / "dcp"
    made = home / "made.json"
    if made.exists() and json.loads(made.read_text()).get("shape") == shape:
        print(f"reusing {dcp_dir}", file=sys.stderr)
        return dcp_dir
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", THIS, "_make",
           str(dcp_dir), json.dumps(shape)]
    t0 = time.perf_counter()
    m = run_measured(cmd, env=env, cwd=str(home))
    made.write_text(json.dumps({"shape": shape, "params": param_count(shape), "ranks": ranks,
                                "seconds": m.seconds, "peak_rss_mib": m.peak_rss / 2**20}, indent=2))
    print(f"made {dcp_dir}: {param_count(shape):,} parameters, {folder_bytes(str(dcp_dir)) / 2**30:.2f} GiB in "
          f"{time.perf_counter() - t0:.1f} s (peak RSS of the job {m.peak_rss / 2**30:.1f} GiB)", file=sys.stderr)
    return dcp_dir


def commands(name: str, dcp_dir: Path, out: Path, copy_src: Path) -> list:
    """The processes of a contender, run back to back, each [cmd]; its output goes to out/result."""
    config = str(dcp_dir.parent / "config.json")
    res = str(out / "result")
    if name in (PYCKPT, PYCKPT_BF16):
        extra = ["--dtype", "bf16"] if name == PYCKPT_BF16 else []
        return [[PY, "-m", "pyckpt", "export", str(dcp_dir), res] + extra]
    if name == TORCH:
        pt = str(out / "tmp.pt")
        return [[PY, THIS, "_torch1", str(dcp_dir), pt], [PY, THIS, "_torch2", pt, res, config]]
    if name in (TITAN, TITAN_BF16):
        return [[PY, THIS, "_titan", str(dcp_dir), res, config, "bf16" if name == TITAN_BF16 else "fp32"]]
    if name == COPY:
        return [["cp", "-r", str(copy_src), res]]
    raise ValueError(name)


def sync() -> None:
    os.sync()


def files_of(folder: Path) -> list:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def read_through(folder: Path) -> None:
    # A small buffer: a child's ru_maxrss starts from this process's peak (see the module's docstring).
    buf = bytearray(1 << 20)
    for f in files_of(folder):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def evict(folder: Path) -> None:
    # After a sync the pages are clean, so DONTNEED drops them: the next reader goes to the disk.
    for f in files_of(folder):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Unavailable(Exception):
    pass


def run_contender(name: str, dcp_dir: Path, out: Path, copy_src: Path, mode: str | None, work: Path) -> dict:
    """One timed run into a fresh ``out``; {"seconds", "steps", "peak_rss", "peak_disk", "output_bytes"}."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    inputs = [copy_src] if name == COPY else [dcp_dir]
    sync()
    for folder in inputs:
        if mode == "warm":
            read_through(folder)
        elif mode == "cold":
            evict(folder)
    steps = []
    for cmd in commands(name, dcp_dir, out, copy_src):
        try:
            m = run_measured(cmd, watch_dir=str(out), cwd=str(work))
        except RuntimeError as e:
            if name in (PYCKPT, PYCKPT_BF16):
                last = [line for line in str(e).splitlines() if line.strip()]
                raise Unavailable(last[-1] if last else str(e)) from None
            raise
        steps.append({"seconds": m.seconds, "peak_rss": m.peak_rss, "peak_disk": m.peak_disk})
    return {"seconds": sum(x["seconds"] for x in steps), "peak_rss": max(x["peak_rss"] for x in steps),
            "peak_disk": max(x["peak_disk"] for x in steps), "output_bytes": folder_bytes(str(out / "result")),
            "steps": steps}


def check(pairs: list, work: Path) -> None:
    """pairs: (folder a, folder b, "bf16" or ""), compared in one process (one import of torch)."""
    arg = json.dumps([[str(a), str(b), cast] for a, b, cast in pairs])
    p = subprocess.run([PY, THIS, "_check", arg], cwd=str(work), capture_output=True, text=True, check=False)
    for line in p.stdout.strip().splitlines():
        print(f"check: {line}", file=sys.stderr)
    if p.returncode != 0:
        raise SystemExit(f"check failed: {(p.stderr or p.stdout).strip().splitlines()[-1]}")


def stats(xs: list) -> dict:
    return {"per_round": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def bench_size(params: int, args, names: list) -> dict:
    root = args.root
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    dcp_dir = make_checkpoint(root, params, args.ranks)
    shape = llama_shape(params)
    unavailable = {}
    # Untimed runs: the bytecode caches filled, the outputs compared, the copy's source made.
    checked = work / "check"
    outs = {}
    # torch's road always runs once: the reference of the checks, and the copy's source while pyckpt cannot run.
    first = [n for n in ((PYCKPT, TORCH) if args.no_check else (PYCKPT, TORCH, TITAN, PYCKPT_BF16, TITAN_BF16))
             if n in names or n == TORCH]
    if COPY in names and PYCKPT not in first:
        first.insert(0, PYCKPT)
    for name in first:
        try:
            t0 = time.perf_counter()
            run_contender(name, dcp_dir, checked / name, Path("/nonexistent"), None, work)
            outs[name] = checked / name / "result"
            # Only the consolidated files are compared; the per-rank copies under sharded/ would hold
            # the model's bytes a second time on the disk until the checks end (8 GB at 1B, fp32 and bf16).
            shutil.rmtree(outs[name] / "sharded", ignore_errors=True)
            print(f"untimed {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        except Unavailable as e:
            unavailable[name] = str(e)
            print(f"{name}: unavailable ({e}); the other contenders still run", file=sys.stderr)
    if PYCKPT in unavailable and PYCKPT_BF16 in names and PYCKPT_BF16 not in unavailable:
        unavailable[PYCKPT_BF16] = unavailable[PYCKPT]
    checks = []
    if not args.no_check:
        pairs = [(PYCKPT, TORCH, ""), (PYCKPT, TITAN, ""), (TORCH, TITAN, ""), (PYCKPT_BF16, TITAN_BF16, "")]
        if TITAN_BF16 not in outs:
            pairs.append((PYCKPT_BF16, TORCH, "bf16"))
        pairs = [(a, b, cast) for a, b, cast in pairs if a in outs and b in outs]
        if pairs:
            check([(outs[a], outs[b], cast) for a, b, cast in pairs], work)
            checks = [f"{a} == {b}" + (" cast to bf16" if cast else "") for a, b, cast in pairs]
    copy_src = outs.get(PYCKPT, outs[TORCH])
    for name, folder in outs.items():
        if folder != copy_src:
            shutil.rmtree(folder.parent)
    timed = [n for n in names if n not in unavailable]
    shown = [n for n in timed if n != TORCH] + ([TORCH, TORCH_1, TORCH_2] if TORCH in timed else [])
    runs = {m: {n: [] for n in shown} for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            order = timed[r % len(timed):] + timed[:r % len(timed)]
            for name in order:
                res = run_contender(name, dcp_dir, work / "out", copy_src, mode, work)
                runs[mode][name].append(res)
                if name == TORCH:
                    for step, one in zip((TORCH_1, TORCH_2), res["steps"]):
                        runs[mode][step].append(dict(one, output_bytes=res["output_bytes"]))
                each = ", ".join(f"{x['seconds']:.2f}" for x in res["steps"])
                print(f"round {r} {mode:4s} {name:16s} {res['seconds']:8.2f} s  peak RSS "
                      f"{res['peak_rss'] / 2**20:8.0f} MiB  peak disk {res['peak_disk'] / 2**30:6.2f} GiB"
                      + (f"  (steps {each} s)" if len(res["steps"]) > 1 else ""), file=sys.stderr, flush=True)
                shutil.rmtree(work / "out")
    shutil.rmtree(work)
    point = {"params": param_count(shape), "config": shape, "ranks": args.ranks,
             "checkpoint": str(dcp_dir), "checkpoint_bytes": folder_bytes(str(dcp_dir)),
             "checkpoint_files": len(files_of(dcp_dir)), "checks": checks, "unavailable": unavailable,
             "made": json.loads((dcp_dir.parent / "made.json").read_text()), "modes": {}}
    for mode in args.modes:
        tools = {}
        for n, rs in runs[mode].items():
            if not rs:
                continue
            tools[n] = dict(stats([x["seconds"] for x in rs]), peak_rss_mib=max(x["peak_rss"] for x in rs) / 2**20,
                            peak_disk_gib=max(x["peak_disk"] for x in rs) / 2**30,
                            output_bytes=max(x["output_bytes"] for x in rs))
        ratios = {}
        sec = {n: [x["seconds"] for x in rs] for n, rs in runs[mode].items()}
        base = [n for n in BASELINES if sec.get(n)]
        if sec.get(PYCKPT):
            for b in base:
                ratios[f"{b} / {PYCKPT}"] = stats([o / p for o, p in zip(sec[b], sec[PYCKPT])])
            if base:
                ratios[f"fastest baseline / {PYCKPT}"] = stats(
                    [min(sec[b][i] for b in base) / p for i, p in enumerate(sec[PYCKPT])])
            if sec.get(COPY):
                ratios[f"{PYCKPT} / {COPY}"] = stats([p / c for p, c in zip(sec[PYCKPT], sec[COPY])])
        if sec.get(PYCKPT_BF16):
            if sec.get(TITAN_BF16):
                ratios[f"{TITAN_BF16} / {PYCKPT_BF16}"] = stats([o / p for o, p in zip(sec[TITAN_BF16],
                                                                                       sec[PYCKPT_BF16])])
            if sec.get(COPY):
                ratios[f"{PYCKPT_BF16} / {COPY} (half the bytes)"] = stats(
                    [p / c for p, c in zip(sec[PYCKPT_BF16], sec[COPY])])
        if not sec.get(PYCKPT) and sec.get(COPY) and base:
            ratios[f"fastest baseline / {COPY}"] = stats(
                [min(sec[b][i] for b in base) / c for i, c in enumerate(sec[COPY])])
        point["modes"][mode] = {"tools": tools, "ratios": ratios}
    return point


def verdicts(points: list) -> list:
    out = []
    for pt in points:
        for mode, m in pt["modes"].items():
            r, t = m["ratios"], m["tools"]
            size = f"{pt['params'] / 1e6:.0f}M {mode}"
            if f"fastest baseline / {PYCKPT}" in r:
                v = r[f"fastest baseline / {PYCKPT}"]["median"]
                out.append(f"{size}: fastest baseline / pyckpt = {v:.2f} (goal >= {GOALS['speedup']:g}): "
                           + ("met" if v >= GOALS["speedup"] else "missed"))
            if f"{PYCKPT} / {COPY}" in r:
                v = r[f"{PYCKPT} / {COPY}"]["median"]
                out.append(f"{size}: pyckpt / cp = {v:.2f} (goal <= {GOALS['vs_copy']:g}): "
                           + ("met" if v <= GOALS["vs_copy"] else "missed"))
            if PYCKPT in t:
                v = t[PYCKPT]["peak_rss_mib"]
                out.append(f"{size}: pyckpt peak RSS = {v:.0f} MiB (goal <= {GOALS['rss_mib']:g}): "
                           + ("met" if v <= GOALS["rss_mib"] else "missed"))
    rss = [(pt["params"], max(m["tools"][PYCKPT]["peak_rss_mib"] for m in pt["modes"].values()))
           for pt in points if all(PYCKPT in m["tools"] for m in pt["modes"].values())]
    if len(rss) > 1:
        (p0, r0), (p1, r1) = min(rss), max(rss)
        out.append(f"pyckpt peak RSS {r0:.0f} MiB at {p0 / 1e6:.0f}M, {r1:.0f} MiB at {p1 / 1e6:.0f}M "
                   f"({p1 / p0:.1f}x the parameters, {r1 / r0:.2f}x the RSS)")
    return out


def markdown(report: dict) -> str:
    lines = []
    for pt in report["points"]:
        head = (f"### {pt['params']:,} parameters, {pt['ranks']} ranks: {pt['checkpoint_bytes'] / 2**30:.2f} GiB "
                f"in {pt['checkpoint_files']} files")
        lines += ["", head, ""]
        for n, why in pt["unavailable"].items():
            lines.append(f"{n}: unavailable ({why})")
        lines += ["| cache | contender | median s | min-max s | peak RSS MiB | peak disk GiB | output GiB |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for mode, m in pt["modes"].items():
            for n, t in m["tools"].items():
                lines.append(f"| {mode} | {n} | {t['median']:.2f} | {t['min']:.2f}-{t['max']:.2f} | "
                             f"{t['peak_rss_mib']:.0f} | {t['peak_disk_gib']:.2f} | {t['output_bytes'] / 2**30:.2f} |")
        lines += ["", "| cache | ratio (same round) | per round | median |", "|---|---|---|---:|"]
        for mode, m in pt["modes"].items():
            for k, v in m["ratios"].items():
                lines.append(f"| {mode} | {k} | {', '.join(f'{x:.2f}' for x in v['per_round'])} | {v['median']:.2f} |")
    if report["verdicts"]:
        lines += [""] + [f"- {v}" for v in report["verdicts"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in WORKERS:
        WORKERS[argv[0]](argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="1B", help="model size (at least 500M; --quick: 20M)")
    p.add_argument("--second", default="200M",
                   help="a smaller size measured too, to show pyckpt's peak RSS flat ('' for none)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", help="page-cache states, comma list (default cold,warm; --quick: warm)")
    p.add_argument("--tools", help=f"contenders, comma list (default {','.join(CONTENDERS)}; --quick leaves out "
                   f"{TITAN_BF16}); torch's road always runs once untimed: the checks' reference")
    p.add_argument("--root", type=Path, default=Path("/tmp/pyckpt-dcp-import"),
                   help="checkpoints and outputs (on disk, not /dev/shm, unless you mean to measure that)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints made (reused by the next run)")
    p.add_argument("--no-check", action="store_true", help="skip the untimed runs' comparison of outputs")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: a ~20M model, one round, warm cache only, no second size (~1 minute)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    # As benchmarks/run.py: tools are measured with their bytecode cached, as installed packages are.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.quick:
        args.params, args.second, args.rounds = "20M", "", 1
        args.modes = args.modes or "warm"
        args.tools = args.tools or ",".join(n for n in CONTENDERS if n != TITAN_BF16)
    args.modes, args.tools = args.modes or ",".join(MODES), args.tools or ",".join(CONTENDERS)
    names = [n.strip() for n in args.tools.split(",") if n.strip()]
    bad = [n for n in names if n not in CONTENDERS]
    if bad:
        p.error(f"unknown contenders {bad}; known: {', '.join(CONTENDERS)}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in args.modes):
        p.error(f"--modes: {', '.join(MODES)}")
    sizes = [parse_count(args.params)] + ([parse_count(args.second)] if args.second else [])
    if not args.quick and sizes[0] < 500 * 10**6:
        p.error("--params: at least 500M (--quick for a smoke run)")
    args.root = args.root.resolve()
    args.root.mkdir(parents=True, exist_ok=True)
    points = []
    for params in sorted(sizes):
        try:
            points.append(bench_size(params, args, names))
        finally:
            if not args.keep:
                shutil.rmtree(args.root / f"ckpt_{params // 10**6}M_r{args.ranks}", ignore_errors=True)
    report = {"job": "DCP checkpoint (FSDP2, model + AdamW) -> Hugging Face safetensors folder",
              "rounds": args.rounds, "modes": args.modes, "root": str(args.root),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30},
              "goals": GOALS, "points": points,
              # The floor under every peak RSS above: a child's ru_maxrss counts from this process's peak.
              "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    report["verdicts"] = verdicts(points)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
