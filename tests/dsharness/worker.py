"""What the DeepSpeed ranks run.

Usage: python worker.py JOB.json

One invocation is one "launch": a supervisor process imports torch and DeepSpeed once and then
forks `world_size` ranks, which saves the ~1-2 s of interpreter + torch import that every rank
would otherwise pay (on 2 cores, 4 ranks importing in parallel cost ~4 s of wall time). The
supervisor itself never runs a torch op, so no OpenMP/intra-op thread pool exists at fork time.

Each rank runs the job's tasks in order, all inside one process group, so several checkpoint
configurations with the same world size share one launch. Rank 0 writes each task's result
dict with torch.save; the parent test process reads it back.
"""

import time

START = time.perf_counter()

import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

# The worker is started as a script, not as a package module, so its sibling must be found by path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import models  # noqa: E402

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def skip_shm_comm_op() -> None:
    """Stop DeepSpeed from JIT-compiling its shared-memory comm op.

    On the CPU accelerator, every TorchBackend construction (deepspeed.init_distributed) calls
    build_shm_op(), which ninja-compiles deepspeed_shm_comm into TORCH_EXTENSIONS_DIR: ~35 s on
    2 cores, per fresh extensions dir, and it needs a C++ compiler. The op only backs
    inference_all_reduce; training, ZeRO and checkpointing use torch.distributed (gloo).
    build_shm_op() skips the build when deepspeed.ops.__compatible_ops__ says the op is not
    compatible; that dict is computed lazily on first access (probing every op, which can run
    compiler subprocesses too), so pre-seeding it skips the probing as well. Nothing else in
    DeepSpeed 0.19.8 reads it.
    """
    if os.environ.get("DSHARNESS_BUILD_SHM_OP") == "1":
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)


def warm_up() -> None:
    """Import, once in the supervisor, what DeepSpeed otherwise imports lazily in every rank.

    The first deepspeed.initialize() in a process spends ~2 s importing torch._dynamo and
    inductor (torch.optim.Optimizer.__init__ and DeepSpeed's Muon module touch them) and the
    ZeRO optimizers; doing it before the fork makes that a one-time cost per launch instead of
    per rank. Only module imports happen here: no threads exist yet at fork time.
    """
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.bf16_optimizer  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import torch._dynamo  # noqa: F401


def ds_config(cfg: dict, world_size: int, load_universal: bool = False) -> dict:
    zero = {"stage": cfg["stage"]}
    if cfg["stage"] == 3 and cfg.get("sub_group_size"):
        zero["sub_group_size"] = cfg["sub_group_size"]
    config = {
        "train_micro_batch_size_per_gpu": models.MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": models.MICRO_BATCH * world_size,
        # torch_adam avoids DeepSpeed's FusedAdam/CPUAdam, both of which need a compiled op;
        # "Adam" would silently become torch.optim.AdamW unless adam_w_mode is switched off.
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True,
                "adam_w_mode": False
            }
        },
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }
    if cfg["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    elif cfg["dtype"] != "fp32":
        raise ValueError(f"unsupported dtype {cfg['dtype']!r}")
    if cfg.get("grad_accum_dtype"):
        config["data_types"] = {"grad_accum_dtype": cfg["grad_accum_dtype"]}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def make_engine(cfg: dict, world_size: int, load_universal: bool = False):
    model = models.build_model(cfg["model"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=trainable,
                                           config=ds_config(cfg, world_size, load_universal))
    return engine


def train_step(engine, cfg: dict, rank: int, step: int) -> float:
    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    loss = engine(*models.batch(cfg["model"], rank, step, dtype))
    engine.backward(loss)
    engine.step()
    value = loss.item()
    if not math.isfinite(value):
        raise RuntimeError(f"rank {rank}: non-finite loss {value} at step {step}")
    return value


def optimizer_step(engine):
    """The Adam step count, which ZeRO keeps once per flat group; all of them must agree."""
    steps = set()
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            s = state["step"]
            steps.add(s.item() if torch.is_tensor(s) else s)
    if len(steps) != 1:
        raise RuntimeError(f"expected one optimizer step value, got {sorted(steps)}")
    return steps.pop()


def gather_state(engine) -> dict:
    """Full (unpartitioned) fp32 masters and Adam moments for every parameter.

    Collective under every stage (all-reduce for ZeRO-1/2, all-gather for ZeRO-3), so all
    ranks must call it in the same order; named_parameters() order is identical on all ranks.
    """
    stage3 = engine.zero_optimization_partition_weights()
    module = engine.module
    fp32 = {}
    moments = {k: {} for k in OPTIM_KEYS}
    names, frozen = [], []
    # named_parameters() yields a tied tensor once, under the name it was first registered as.
    for name, p in module.named_parameters():
        names.append(name)
        if p.requires_grad:
            fp32[name] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for k in OPTIM_KEYS:
                moments[k][name] = safe_get_full_optimizer_state(p, k).detach().cpu().clone()
        else:
            # A frozen parameter has no master copy; its module value (exact in fp32) is the
            # only state there is.
            frozen.append(name)
            if stage3:
                with deepspeed.zero.GatheredParameters([p]):
                    fp32[name] = p.data.detach().float().cpu().clone()
            else:
                fp32[name] = p.detach().float().cpu().clone()
    buffers = {name: b.detach().cpu().clone() for name, b in module.named_buffers()}
    return {
        "fp32": fp32,
        "exp_avg": moments["exp_avg"],
        "exp_avg_sq": moments["exp_avg_sq"],
        "step": optimizer_step(engine),
        "param_names": names,
        "frozen": frozen,
        "buffers": buffers,
        "meta": {
            "optimizer_class": type(engine.optimizer).__name__,
            "base_optimizer_class": type(engine.optimizer.optimizer).__name__,
            "global_steps": engine.global_steps,
            "world_size": tdist.get_world_size(),
        },
    }


def run_save(task: dict, rank: int, world_size: int) -> dict:
    cfg = task["cfg"]
    engine = make_engine(cfg, world_size)
    engine.train()
    losses = [train_step(engine, cfg, rank, step) for step in range(cfg["steps"])]
    client_state = {"universal_checkpoint_info": {}} if cfg["uc_info"] else {}
    engine.save_checkpoint(task["root"], client_state=client_state)
    state = gather_state(engine)
    state["tag"] = f"global_step{engine.global_steps}"
    state["meta"]["losses"] = losses
    engine.destroy()
    return state


def run_load(task: dict, rank: int, world_size: int) -> dict:
    cfg = task["cfg"]
    engine = make_engine(cfg, world_size, load_universal=True)
    load_path, _ = engine.load_checkpoint(task["universal_root"], tag=task["tag"])
    if load_path is None:
        raise RuntimeError(f"load_checkpoint found nothing under {task['universal_root']} tag {task['tag']}")
    state = gather_state(engine)
    # The restored state must also be trainable: one more step, loss checked in train_step.
    engine.train()
    state["meta"]["loss_after_load"] = train_step(engine, cfg, rank, engine.global_steps)
    engine.destroy()
    return state


def run_fail(task: dict, rank: int, world_size: int) -> dict:
    """Harness self-test: one rank dies while the others wait in a collective."""
    if rank == task["rank"]:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    tdist.barrier()
    return {}


def run_rank(job: dict, rank: int) -> None:
    world_size = job["world_size"]
    os.environ.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
    })
    # A file store instead of MASTER_PORT: nothing to collide with when launches overlap.
    tdist.init_process_group("gloo",
                             init_method="file://" + job["store"],
                             rank=rank,
                             world_size=world_size,
                             timeout=datetime.timedelta(seconds=job["timeout_s"]))
    deepspeed.init_distributed(dist_backend="gloo")
    for task in job["tasks"]:
        t0 = time.perf_counter()
        run = {"save": run_save, "load": run_load, "fail": run_fail}[task["kind"]]
        state = run(task, rank, world_size)
        state.setdefault("meta", {})["seconds"] = time.perf_counter() - t0
        tdist.barrier()
        if rank == 0:
            torch.save(state, task["out"] + ".tmp")
            os.replace(task["out"] + ".tmp", task["out"])
    tdist.barrier()
    tdist.destroy_process_group()


def child(job: dict, rank: int) -> None:
    log = os.open(os.path.join(job["log_dir"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 0
    try:
        run_rank(job, rank)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # _exit: the inherited interpreter state (atexit hooks, gloo threads) must not run twice.
    os._exit(code)


def supervise(job: dict) -> int:
    pids = {}
    for rank in range(job["world_size"]):
        pid = os.fork()
        if pid == 0:
            child(job, rank)
        pids[pid] = rank
    status = 0
    while pids:
        pid, wstatus = os.wait()
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(wstatus)
        if code != 0 and status == 0:
            status = 1
            print(f"rank {rank} exited with {code}; killing the other ranks", file=sys.stderr)
            # The surviving ranks would otherwise sit in a collective until the gloo timeout.
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return status


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    skip_shm_comm_op()
    t0 = time.perf_counter()
    warm_up()
    t1 = time.perf_counter()
    status = supervise(job)
    # Phase timings for the launch log: where a launch's wall time goes.
    print(f"DSHARNESS-TIMING startup={t0 - START:.2f} warm_up={t1 - t0:.2f} ranks={time.perf_counter() - t1:.2f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
