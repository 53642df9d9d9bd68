"""Make real DeepSpeed ZeRO checkpoints on CPU, convert them with DeepSpeed's own
ds_to_universal.py, and load Universal checkpoints back with DeepSpeed's loader.

Everything DeepSpeed-related runs in subprocesses (see worker.py), so importing this package
does not import DeepSpeed, and a crash or hang in DeepSpeed cannot take the test process down.

State dicts (`Checkpoint.reference` and what `load_universal` returns) look like:
    {"fp32": {name: full fp32 tensor in the param's shape},   # frozen params: module value .float()
     "exp_avg": {name: ...}, "exp_avg_sq": {name: ...},        # trainable params only
     "step": float,                                            # torch Adam's step (a float tensor in DS)
     "param_names": [...],                                     # named_parameters(): tied params once
     "frozen": [...],                                          # names with requires_grad=False
     "buffers": {name: tensor},                                # module buffers, their own dtype
     "meta": {...}}                                            # optimizer classes, timings, losses
AutoEP (model="moe"): each expert tensor `<layer>.experts.w1/w2/w3` is in fp32/exp_avg/exp_avg_sq
with all experts, [num_experts, ...] in global expert order (gathered across the EP ranks), and
meta adds ep_size, ep_rank_of_rank, num_experts, autoep_layers, expert_params.
AutoTP (model="llama"/"llama_kv2", tp_size > 1): every tensor is the full logical one, gathered
across the TP group from the layout AutoTP recorded on each parameter; meta["tp_size"] is the TP
degree (1 without AutoTP) and meta adds autotp_layouts (per parameter: partition_dim,
partition_sizes, sub_param_shard_widths, ... as rank 0 sees them; None = left whole) and
local_shapes (rank 0's shard shapes).
DeepSpeed's universal loader restores neither frozen parameters nor buffers (it never loads
`module`); see NOTES.md. `compare_states` therefore compares only what the loader restores.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

__all__ = [
    "Checkpoint",
    "Config",
    "make_checkpoint",
    "make_checkpoints",
    "run_ds_to_universal",
    "run_ds_to_universal_many",
    "load_universal",
    "load_universal_many",
    "ds_env",
    "compare_states",
    "LAUNCH_LOG",
]

_HERE = Path(__file__).resolve().parent
_WORKER = _HERE / "worker.py"
# Generous: a launch normally takes seconds; this only bounds a hung gloo collective.
DEFAULT_TIMEOUT_S = 300
# models.TinyMoE's expert count and models.LLAMA_MODELS (kept here so that this module never
# imports the worker side).
MOE_NUM_EXPERTS = 8
LLAMA_MODELS = ("llama", "llama_kv2")

# (description, world_size, seconds, detail) per worker launch / converter run, for timing
# reports; detail is the worker's phase split ("startup=.. warm_up=.. ranks=..") or "".
LAUNCH_LOG: list[tuple[str, int, float, str]] = []


@dataclass(frozen=True)
class Config:
    stage: int  # 1, 2, 3
    dtype: str  # "fp32" or "bf16"
    world_size: int  # ranks: dp degree * tp_size (pp = 1)
    # "tiny" | "wide" (tiny at page scale, 1M parameters) | "frozen_tied" | "moe" (AutoEP, Mixtral layout; needs ep_size) | "llama" (AutoTP) |
    # "llama_kv2" (AutoTP, 2 KV heads: tp 4 leaves ranks without attention shards)
    model: str = "tiny"
    sub_group_size: int | None = None  # ZeRO-3 only
    steps: int = 3
    uc_info: bool = True  # client_state={"universal_checkpoint_info": {}} at save
    # "fp32" with bf16 + stage 1 makes DeepSpeed use BF16_Optimizer (a different shard layout:
    # no zero_stage key, fp32 partitions saved with padding); None = DeepSpeed's default (model dtype).
    grad_accum_dtype: str | None = None
    # AutoEP (model="moe" only): expert_parallel.autoep_size, and the top-level
    # use_data_before_expert_parallelism (D+E: EP rank = rank // (world/ep) instead of rank % ep).
    ep_size: int | None = None
    use_data_before_expert_parallelism: bool = False
    # AutoTP (model in LLAMA_MODELS only): tensor_parallel.autotp_size. None or 1 = no AutoTP (DeepSpeed
    # applies it only above 1); the data-parallel degree is world_size // tp_size.
    tp_size: int | None = None
    # model="tiny" only: two optimizer param groups, the weights (the config's Adam settings) and the
    # biases (their own lr, betas and weight decay), so per-group hyper-parameters are observable
    # and a small second group leaves some ranks' ZeRO-1/2 partition all padding (dp 4: 10 real of 16).
    groups: bool = False
    # State a load restores beside the optimizer's, for comparisons that would otherwise hold None or
    # nothing on both sides: a DeepSpeed WarmupDecayLR scheduler (its iteration and every group's lr
    # move each step; under `groups` each group warms up to its own lr), and a client_state entry
    # "trainer" (worker.client_payload: nested containers, ints, floats, strings, None, bools and
    # small int64/bf16 tensors) saved beside universal_checkpoint_info. Off by default: other tests'
    # checkpoints stay as they were.
    lr_scheduler: bool = False
    client_payload: bool = False
    # ZeRO-Offload to host memory: zero_optimization.offload_optimizer.device "cpu" (ZeRO-3: the
    # parameters too). DeepSpeed then keeps the fp32 partitions and the optimizer state on the host
    # and steps them there; with the config's torch_adam that is torch's Adam (no compiled op).
    offload: bool = False

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, not {self.stage}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', not {self.dtype!r}")
        if self.model not in ("tiny", "wide", "frozen_tied", "moe", *LLAMA_MODELS):
            raise ValueError(f"unknown model {self.model!r}")
        if self.model == "moe":
            if self.ep_size is None or self.ep_size < 1 or MOE_NUM_EXPERTS % self.ep_size:
                raise ValueError(f"model='moe' needs ep_size dividing {MOE_NUM_EXPERTS}, not {self.ep_size}")
            if self.world_size % self.ep_size:
                raise ValueError(f"ep_size {self.ep_size} does not divide world_size {self.world_size}")
            if not self.uc_info:
                # AutoEP writes universal_checkpoint_info itself; there is no checkpoint without it.
                raise ValueError("uc_info=False is meaningless for model='moe'")
        elif self.ep_size is not None or self.use_data_before_expert_parallelism:
            raise ValueError("ep_size and use_data_before_expert_parallelism need model='moe'")
        if self.tp_size is not None:
            if self.model not in LLAMA_MODELS:
                raise ValueError(f"tp_size needs model in {LLAMA_MODELS}")
            if self.tp_size < 1 or self.world_size % self.tp_size:
                raise ValueError(f"tp_size {self.tp_size} does not divide world_size {self.world_size}")
            if self.tp_size > 1 and not self.uc_info:
                # AutoTP publishes universal_checkpoint_info itself.
                raise ValueError("uc_info=False is meaningless for an AutoTP config")
        if self.grad_accum_dtype not in (None, "fp32", "bf16"):
            raise ValueError(f"grad_accum_dtype must be None, 'fp32' or 'bf16', not {self.grad_accum_dtype!r}")
        if self.groups and self.model != "tiny":
            raise ValueError("groups needs model='tiny'")
        if self.world_size < 1 or self.steps < 1:
            raise ValueError("world_size and steps must be positive")

    @property
    def id(self) -> str:
        """A short name, usable as a pytest id or a directory name."""
        parts = [f"z{self.stage}", self.dtype, f"ws{self.world_size}", self.model]
        if self.sub_group_size:
            parts.append(f"sg{self.sub_group_size}")
        if self.steps != 3:
            parts.append(f"st{self.steps}")
        if not self.uc_info:
            parts.append("nouc")
        if self.grad_accum_dtype:
            parts.append(f"acc{self.grad_accum_dtype}")
        if self.ep_size is not None:
            parts.append(f"ep{self.ep_size}")
        if self.use_data_before_expert_parallelism:
            parts.append("dbe")
        if self.tp_size is not None:
            parts.append(f"tp{self.tp_size}")
        if self.groups:
            parts.append("groups")
        if self.lr_scheduler:
            parts.append("sched")
        if self.client_payload:
            parts.append("client")
        return "-".join(parts)


@dataclass
class Checkpoint:
    root: Path  # save_dir (contains `latest`)
    tag: str  # e.g. "global_step3"
    tag_dir: Path  # root / tag
    config: Config
    reference: dict  # the state at save time


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_env(tmp: Path) -> dict:
    """Environment for DeepSpeed subprocesses.

    The worker rendezvouses through a file store, so MASTER_PORT is there only for anything
    else that insists on env:// (a fresh free port at call time).
    """
    tmp = Path(tmp)
    ext = tmp / "torch_extensions"
    ext.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # Under scripts/sanitize.sh only pyckpt is the code under test: DeepSpeed's processes make the
    # reference data and need no instrumented allocator.
    env.pop("LD_PRELOAD", None)
    env.update({
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(ext),
        # One thread per rank: ranks already outnumber the cores, more threads only thrash.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
        # Keeps transformers/HF from reaching for the network if anything imports it.
        "HF_HUB_OFFLINE": "1",
    })
    return env


def _launch(world_size: int, tasks: list[dict], env: dict | None, what: str, timeout_s: float) -> list[dict]:
    """One worker launch running `tasks` in order on `world_size` ranks; returns rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="dsharness-") as tmp:
        tmp = Path(tmp)
        if env is None:
            env = ds_env(tmp)
        for i, task in enumerate(tasks):
            task["out"] = str(tmp / f"result{i}.pt")
        job = {
            "world_size": world_size,
            "store": str(tmp / "store"),
            "log_dir": str(tmp),
            "timeout_s": int(timeout_s),
            "tasks": tasks,
        }
        job_file = tmp / "job.json"
        job_file.write_text(json.dumps(job, indent=1))
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(_WORKER), str(job_file)],
                                env=env,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # The ranks share the supervisor's session: one killpg takes all of them.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"{what}: timed out after {timeout_s}s\n{_logs(tmp, world_size)}")
        except BaseException:
            # e.g. Ctrl-C in pytest: do not leave ranks running behind.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        elapsed = time.perf_counter() - t0
        text = out.decode(errors="replace")
        phases = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("DSHARNESS-TIMING ")]
        LAUNCH_LOG.append((what, world_size, elapsed, phases[-1] if phases else ""))
        if proc.returncode != 0:
            raise RuntimeError(f"{what}: worker failed with exit code {proc.returncode}\n"
                               f"{text}\n{_logs(tmp, world_size)}")
        # The worker writes only tensors, numbers, strings and plain containers, all of which
        # weights_only accepts; anything else showing up there would be a harness bug.
        return [torch.load(t["out"], weights_only=True) for t in tasks]


def _logs(tmp: Path, world_size: int, tail: int = 6000) -> str:
    parts = []
    for rank in range(world_size):
        log = tmp / f"rank{rank}.log"
        text = log.read_text(errors="replace") if log.exists() else "<no log>"
        parts.append(f"----- rank {rank} (last {tail} chars) -----\n{text[-tail:]}")
    return "\n".join(parts)


def make_checkpoints(items: Iterable[tuple[Config, Path]],
                     env: dict | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Checkpoint]:
    """Train and save several configurations; one launch per distinct world size.

    Sharing a launch saves the process start-up (imports, gloo rendezvous), which is most of
    the cost of a tiny-model run. Results come back in the order of `items`.
    """
    items = [(cfg, Path(root)) for cfg, root in items]
    by_ws: dict[int, list[int]] = {}
    for i, (cfg, _) in enumerate(items):
        by_ws.setdefault(cfg.world_size, []).append(i)
    results: list[Checkpoint | None] = [None] * len(items)
    for ws, idxs in by_ws.items():
        tasks = []
        for i in idxs:
            cfg, root = items[i]
            root.mkdir(parents=True, exist_ok=True)
            tasks.append({"kind": "save", "cfg": dataclasses.asdict(cfg), "root": str(root)})
        what = "save " + ",".join(items[i][0].id for i in idxs)
        states = _launch(ws, tasks, env, what, timeout_s)
        for i, state in zip(idxs, states):
            cfg, root = items[i]
            tag = (root / "latest").read_text().strip()
            if tag != state["tag"]:
                raise RuntimeError(f"{root}/latest says {tag!r}, the engine saved {state['tag']!r}")
            results[i] = Checkpoint(root=root, tag=tag, tag_dir=root / tag, config=cfg, reference=state)
    return results  # type: ignore[return-value]


def make_checkpoint(cfg: Config, root: Path, env: dict | None = None) -> Checkpoint:
    return make_checkpoints([(cfg, root)], env)[0]


def _ds_to_universal_script() -> Path:
    # find_spec on the top-level package locates it without executing deepspeed/__init__.py.
    spec = importlib.util.find_spec("deepspeed")
    return Path(list(spec.submodule_search_locations)[0]) / "checkpoint" / "ds_to_universal.py"


def run_ds_to_universal(input_folder: Path,
                        output_folder: Path,
                        *extra_args: str,
                        env: dict | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run DeepSpeed's ds_to_universal.py on a tag folder.

    ds_to_universal also writes `<dirname(output_folder)>/latest_universal`, so the output
    folder's parent becomes a loadable universal root with tag = output_folder.name.
    """
    cmd = [
        sys.executable,
        str(_ds_to_universal_script()), "--input_folder",
        str(input_folder), "--output_folder",
        str(output_folder), *extra_args
    ]
    label = f"ds_to_universal {Path(input_folder).name} {' '.join(extra_args)}".strip()
    return _run_converter(lambda tmp: cmd, label, "ds_to_universal", env, timeout_s)


def _run_converter(make_cmd, label: str, what: str, env: dict | None, timeout_s: float) -> subprocess.CompletedProcess:
    """One converter subprocess, logged in LAUNCH_LOG; `make_cmd(tmp)` may put files in its temp folder."""
    with tempfile.TemporaryDirectory(prefix="dsharness-conv-") as tmp:
        cmd = make_cmd(Path(tmp))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd,
                              env=env if env is not None else ds_env(Path(tmp)),
                              capture_output=True,
                              text=True,
                              timeout=timeout_s)
        LAUNCH_LOG.append((label, 1, time.perf_counter() - t0, ""))
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
                           f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


def run_ds_to_universal_many(jobs: Sequence[tuple[Path, Path]],
                             *extra_args: str,
                             env: dict | None = None,
                             timeout_s: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess:
    """ds_to_universal on several (input_folder, output_folder) pairs in one subprocess.

    Same DeepSpeed code path as run_ds_to_universal (parse_arguments + main), minus the
    per-conversion interpreter start-up. `extra_args` apply to every job.
    """
    jobs = [(str(i), str(o), list(extra_args)) for i, o in jobs]

    def make_cmd(tmp: Path):
        job_file = tmp / "jobs.json"
        job_file.write_text(json.dumps(jobs, indent=1))
        return [sys.executable, str(_HERE / "convert_many.py"), str(job_file)]

    label = f"ds_to_universal x{len(jobs)} {' '.join(extra_args)}".strip()
    return _run_converter(make_cmd, label, f"ds_to_universal (batched) on {jobs}", env, timeout_s)


def load_universal_many(requests: Sequence[tuple[Config, Path, str, int]],
                        env: dict | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Several universal loads `(cfg, universal_root, tag, world_size)`; one launch per world size.

    For AutoEP, `cfg.ep_size` is the autoep_size of the loading engine: pass
    `dataclasses.replace(ckpt.config, world_size=ws, ep_size=n)` to load at another EP size
    (Config checks ep_size against its own world_size, which the load otherwise ignores).
    Likewise `cfg.tp_size` is the loading engine's autotp_size (AutoTP, model="llama"; 1 or None
    loads into the plain, unsharded model).
    """
    by_ws: dict[int, list[int]] = {}
    for i, req in enumerate(requests):
        cfg, ws = req[0], req[3]
        if cfg.ep_size is not None and ws % cfg.ep_size:
            raise ValueError(f"{cfg.id}: ep_size {cfg.ep_size} does not divide the load world size {ws}")
        if cfg.tp_size is not None and ws % cfg.tp_size:
            raise ValueError(f"{cfg.id}: tp_size {cfg.tp_size} does not divide the load world size {ws}")
        by_ws.setdefault(ws, []).append(i)
    results: list[dict | None] = [None] * len(requests)
    for ws, idxs in by_ws.items():
        tasks = []
        for i in idxs:
            cfg, root, tag, _ = requests[i]
            tasks.append({
                "kind": "load",
                "cfg": dataclasses.asdict(cfg),
                "universal_root": str(root),
                "tag": tag
            })
        what = f"load@ws{ws} " + ",".join(requests[i][0].id for i in idxs)
        for i, state in zip(idxs, _launch(ws, tasks, env, what, timeout_s)):
            results[i] = state
    return results  # type: ignore[return-value]


def load_universal(cfg: Config,
                   universal_root: Path,
                   tag: str,
                   world_size: int,
                   env: dict | None = None,
                   ep_size: int | None = None,
                   tp_size: int | None = None) -> dict:
    """DeepSpeed `load_universal` at `world_size` ranks; returns the restored state.

    The engine is built from `cfg`'s model, stage, dtype, sub_group_size, grad_accum_dtype,
    ep_size and use_data_before_expert_parallelism (its world_size, steps and uc_info play no
    part), with "checkpoint": {"load_universal": true}, then
    `engine.load_checkpoint(universal_root, tag=tag)`. `ep_size` overrides `cfg.ep_size` (AutoEP:
    load at another autoep_size), `tp_size` overrides `cfg.tp_size` (AutoTP: load at another
    autotp_size; the state comes back TP-gathered, as in the reference). `universal_root` holds
    the `tag` folder written by ds_to_universal. The worker then runs one more training step and
    fails unless its loss is finite.
    """
    if ep_size is not None:
        cfg = dataclasses.replace(cfg, ep_size=ep_size, world_size=world_size)
    if tp_size is not None:
        cfg = dataclasses.replace(cfg, tp_size=tp_size, world_size=world_size)
    return load_universal_many([(cfg, Path(universal_root), tag, world_size)], env)[0]


def compare_states(reference: dict, loaded: dict, keys: Sequence[str] = ("fp32", "exp_avg", "exp_avg_sq")) -> list[str]:
    """Differences between two state dicts, exact (torch.equal, same dtype); [] when equal.

    Covers what DeepSpeed's universal loader restores: the tensors under `keys`, `step` and
    `param_names`. Buffers are not compared (the loader never restores them); frozen params
    are, but they match trivially after a load, since the loader leaves them at their
    (seeded, identical) init values and they never change in training.
    """
    problems = []
    if reference["param_names"] != loaded["param_names"]:
        problems.append(f"param_names {reference['param_names']} != {loaded['param_names']}")
    if reference["step"] != loaded["step"]:
        problems.append(f"step {reference['step']} != {loaded['step']}")
    for key in keys:
        a, b = reference[key], loaded[key]
        if a.keys() != b.keys():
            problems.append(f"{key}: names {sorted(a)} != {sorted(b)}")
        for name in sorted(a.keys() & b.keys()):
            x, y = a[name], b[name]
            if x.dtype != y.dtype or x.shape != y.shape:
                problems.append(f"{key}/{name}: {x.dtype}{tuple(x.shape)} != {y.dtype}{tuple(y.shape)}")
            elif not torch.equal(x, y):
                diff = (x.double() - y.double()).abs().max().item()
                problems.append(f"{key}/{name}: values differ (max abs diff {diff:g})")
    return problems
