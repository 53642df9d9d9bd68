"""pyckpt's memory tier, DLRover's Flash Checkpoint (to MEMORY) and DeepSpeed's own save to disk, side by side.

    bash benchmarks/peers/setup_dlrover.sh          # once: .venv-dlrover, all three in one environment
    .venv-dlrover/bin/python benchmarks/memory_vs_dlrover.py /tmp/mvd --params 100M --nproc 2 --rounds 2 \\
        --steps 3 --json benchmarks/results/memory_vs_dlrover_z2_100M_dp2.json
    .venv-dlrover/bin/python benchmarks/memory_vs_dlrover.py /tmp/mvd --quick      # smoke run, tiny model

One job, the benchmarks' Linear stack (make_real_checkpoint.py's model and DeepSpeed config), ZeRO-2 fp32 Adam,
``--nproc`` ranks under torchrun on CPU (gloo). This driver runs, per round and per way (order rotating each
round), a *training* job and, after SIGKILLing that job's whole process group, *restart* jobs (a new torchrun of
the same job, same ``--rdzv-id``). The ways:

- ``pyckpt_sync`` / ``pyckpt_async``: ``pyckpt.deepspeed.save_checkpoint(engine, OUT, save_tier=MemoryTier(root=...,
  keep=2), async_save=False/True)``, after ``pyckpt.deepspeed.prepare_memory_tier(engine, OUT, save_tier=tier)`` once
  after the warm-up step (its call timed as ``prepare_call``, then one more untimed step; ``--unprepared``
  leaves both out); the restart
  builds the engine under ``pyckpt.deepspeed.enable(resume_tier=tier)``, calls ``engine.load_checkpoint(OUT)``, then
  ``prepare_memory_tier`` again (in the first step's phase).
- ``dlrover``: DLRover 0.6.1's ``DeepSpeedCheckpointer.save_checkpoint(OUT, tag=step,
  storage_type=StorageType.MEMORY)`` (DLRover's memory save is synchronous; its asynchronous part is the copy
  from memory to storage, which a MEMORY save does not make). DLRover keeps the shared memory alive across a
  worker restart in its elastic agent (``dlrover-run``), which crashes on torch 2.13; this driver plays that
  agent's part: a process of its own runs ``AsyncCheckpointSaver.start_async_saving_ckpt()`` (what the agent
  runs) for the whole round, and torchrun runs the workers with ``--role dlrover-trainer`` (its ``ROLE_NAME``:
  so they do not start a saver of their own, which would die with them). DLRover's local master is started as
  dlrover-run would start it (``python -m dlrover.python.master.main --platform local``), its address in
  ``DLROVER_MASTER_ADDR``. The restart loads with ``load_checkpoint(OUT)`` as DLRover documents
  it (no tag: ``dlrover_load_no_tag``), then again naming the saved step's tag (``dlrover``: the timed load),
  and once more the same way after that restart's steps and failed save (``dlrover_second_restart``: a second
  crash; its optimizer state is compared with the saved one, ``same_moments``, as every restart's is).
  Two wrappers adapt DLRover's ``AsyncCheckpointAgent.save/load`` to the keywords DeepSpeed 0.19.8's
  ``TorchCheckpointEngine`` passes to ``torch.save`` (``_use_new_zipfile_serialization``) and ``torch.load``
  (``weights_only``); nothing else of DLRover is changed.
- ``deepspeed``: ``engine.save_checkpoint(OUT)`` to disk (ext4); the restart's ``engine.load_checkpoint(OUT)``
  once with OUT in the page cache (``deepspeed``) and once evicted (``deepspeed_evicted``: fsync +
  ``posix_fadvise(DONTNEED)`` on every file, mincore then counts what stayed resident).

Measured per way, the slowest rank's wall time unless said:

- training job: ``--steps`` plain steps, then ``--steps`` steps each followed by a save; the save call's wall time
  (the stall), step + call over a plain step (medians); the first save's call against the later ones'; memory
  held: bytes of tmpfs (st_blocks) the way's shared-memory files take, and the ranks' RSS growth (summed), after
  the first save and after the last; DLRover's saves that it skipped (its save returns without writing when
  the shared memory's lock is taken).
- restart: from the SIGKILL to the end of the first training step, in phases (each phase ends when the slowest
  rank ends it): worker start (kill -> torchrun -> the worker's first line), imports (torch, deepspeed and the
  way's package), rendezvous (``deepspeed.init_distributed``), engine build (``deepspeed.initialize`` and the
  way's checkpointer), load, first step. ``launch_to_first_step`` leaves out the kill (the driver's wait for the
  killed job's processes to end, which DLRover's timed restart, launched after its untimed one, does not have).
  The first step's own call and a second step's (after the timed phases) are recorded too. After the load: the
  step it resumed (``engine.global_steps``) and the float64 sum of the model's weights against the sum the
  training job recorded at its last save; after the first step one more memory save (does a save after a
  memory resume work?).
- ``--ballast-bytes N``: the DeepSpeed way runs with a file of N bytes in /dev/shm, DLRover's with N/2, so that
  every way runs with as much memory in use as pyckpt's two slots (pass the ``tmpfs_bytes_after_last_save``
  of a pyckpt way). On a VM that hands freed memory back to its host, memory a process touches first costs
  more the more the guest holds (benchmarks/README.md, "The first step after a load").

- ``restore_floor`` (restore_floor.py): after each pyckpt way's restart, while its tier still holds its two
  slots, ``--nproc`` processes copy by ``pread`` from tmpfs only the bytes any restore of this job must write
  (each rank's fp32 partition and the model's weights into memory it holds, its moments into new memory); the
  medians compare every way's load with it (``load_over_floor``). ``--no-floor`` leaves it out.
- after the round: what the way leaves in /dev/shm once its processes are gone (DLRover: after its agent is
  SIGTERMed; then removed by this driver: only entries named with this round's run id).

The memory root is ``/dev/shm/pyckpt-vs-dlrover-<pid>`` (removed at the end); OUT is emptied between ways.
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

T_SCRIPT = time.time()  # before any heavy import: the worker's own start

os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))  # pagecache: eviction and mincore

from restore_floor import floor  # noqa: E402 - after the path above; imports nothing heavy

ALL_WAYS = ["pyckpt_sync", "pyckpt_async", "dlrover", "deepspeed"]
WAYS = list(ALL_WAYS)
SHM = "/dev/shm"


# ----------------------------------------------------------------------------------------------- shared helpers
def _tree_bytes(path: str) -> int:
    """Bytes of memory a tmpfs path holds (st_blocks, so holes count nothing), a file or a folder."""
    if os.path.isfile(path):
        return os.stat(path).st_blocks * 512
    total = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _shm_bytes(prefix: str) -> dict:
    """/dev/shm entries whose name starts with ``prefix``: their names and the bytes they hold."""
    names = sorted(n for n in os.listdir(SHM) if n.startswith(prefix))
    return {"entries": names, "bytes": sum(_tree_bytes(os.path.join(SHM, n)) for n in names)}


# ----------------------------------------------------------------------------------------------------- worker
def worker(args) -> None:
    import psutil

    me = psutil.Process()
    t_created = me.create_time()
    import torch
    import torch.distributed as dist

    import deepspeed
    from make_real_checkpoint import build_model, ds_config, skip_shm_comm_op

    way = args.way
    if way.startswith("pyckpt"):
        import pyckpt.deepspeed as pd
    elif way == "dlrover":
        from dlrover.trainer.torch.flash_checkpoint.deepspeed import DeepSpeedCheckpointer, StorageType
    t_imports = time.time()

    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t_rdzv = time.time()

    out = os.path.abspath(args.out)
    tier = pd.MemoryTier(root=args.memory_root, job=args.job, keep=2) if way.startswith("pyckpt") else None
    if tier is not None and args.phase == "resume":
        pd.enable(resume_tier=tier)
    model, _ = build_model(args.params, args.width)
    cfg = ds_config(2, "fp32")
    if args.bucket:  # smaller buckets: less transient memory in a step, nothing else changes
        cfg["zero_optimization"].update(reduce_bucket_size=int(args.bucket), allgather_bucket_size=int(args.bucket))
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    checkpointer = None
    if way == "dlrover":
        checkpointer = DeepSpeedCheckpointer(engine, out)
        _adapt_dlrover_agent(checkpointer)
    t_engine = time.time()

    def gather(value):
        got = [None] * world
        dist.all_gather_object(got, value)
        return got

    def step(generator=None) -> float:
        x = torch.randn(1, args.width, generator=generator)
        t0 = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0

    def weights_sum() -> float:
        return float(sum(q.detach().double().sum() for q in engine.module.parameters()))

    def moments_sum() -> float:
        """float64 sum of this rank's optimizer state (its partition's Adam moments)."""
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        return float(sum(v.detach().double().sum() for st in inner.state.values() for v in st.values()
                         if torch.is_tensor(v) and v.numel() > 1))

    def save() -> tuple:
        """One save of the way; (its wall time, whether it wrote, the async handle or None)."""
        handle = None
        t0 = time.perf_counter()
        if way == "pyckpt_sync":
            wrote = bool(pd.save_checkpoint(engine, out, save_tier=tier, async_save=False))
        elif way == "pyckpt_async":
            handle = pd.save_checkpoint(engine, out, save_tier=tier, async_save=True)
            wrote = handle is not None
        elif way == "dlrover":
            before = checkpointer._async_save_engine._cached_step
            checkpointer.save_checkpoint(out, tag=engine.global_steps, storage_type=StorageType.MEMORY)
            wrote = checkpointer._async_save_engine._cached_step != before
        else:
            engine.save_checkpoint(out)
            wrote = True
        return time.perf_counter() - t0, wrote, handle

    def rss() -> int:
        return me.memory_info().rss

    def held() -> dict:
        """tmpfs bytes of the way's memory (rank 0 reads it) and the sum of the ranks' RSS."""
        tm = None
        if rank == 0:
            if tier is not None:
                tm = _tree_bytes(args.memory_root) if os.path.exists(args.memory_root) else 0
            elif way == "dlrover":
                tm = _shm_bytes(args.job)["bytes"]
        return {"tmpfs": tm, "rss_sum": sum(gather(rss()))}

    result: dict = {"way": way, "phase": args.phase, "world": world}
    if args.phase == "train":
        step()  # warm-up: the optimizer state exists from here
        # pyckpt: the tier readied for the first two saves where a job does it, after its first step; the call
        # is timed, and one more untimed step takes what it leaves for the next step
        prepared, prepare_call = None, 0.0
        if tier is not None and not args.unprepared:
            t0 = time.perf_counter()
            prepared = pd.prepare_memory_tier(engine, out, save_tier=tier)
            prepare_call = time.perf_counter() - t0
            step()
        plain = [step() for _ in range(args.steps)]
        dist.barrier()
        mem = {"before": held()}
        steps, calls, skipped, handles = [], [], 0, []
        for i in range(args.steps):
            steps.append(step())
            call, wrote, handle = save()
            calls.append(call)
            skipped += not wrote
            if handle is not None:
                handles.append(handle)
            if way == "deepspeed" and rank == 0:  # keep the disk to the newest checkpoint (untimed)
                newest = f"global_step{engine.global_steps}"
                for name in os.listdir(out):
                    if name.startswith("global_step") and name != newest:
                        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
            if i == 0:
                if handle is not None:
                    handle.wait()
                dist.barrier()
                mem["after_first_save"] = held()
        t0 = time.perf_counter()
        ok = all(h.wait() for h in handles) if handles else True
        drain = time.perf_counter() - t0
        dist.barrier()
        mem["after_last_save"] = held()
        every = gather({"plain": plain, "steps": steps, "calls": calls, "drain": drain, "skipped": skipped,
                        "ok": ok, "prepare_call": prepare_call, "moments": moments_sum()})

        def slowest(key, i):
            return max(e[key][i] for e in every)

        n = args.steps
        result.update(
            params=sum(q.numel() for q in engine.module.parameters()),
            plain_step=statistics.median(slowest("plain", i) for i in range(n)),
            save_step=statistics.median(slowest("steps", i) for i in range(n)),
            calls=[slowest("calls", i) for i in range(n)],
            step_with_save=statistics.median(max(e["steps"][i] + e["calls"][i] for e in every) for i in range(n)),
            drain=max(e["drain"] for e in every), saves_ok=all(e["ok"] for e in every),
            skipped_saves=sum(e["skipped"] for e in every), memory=mem,
            saved_step=engine.global_steps, saved_weights_sum=weights_sum(), prepared=prepared,
            saved_moments_sums=[e["moments"] for e in every],
            prepare_call=max(e["prepare_call"] for e in every))
        result["first_call"] = result["calls"][0]
        result["later_call"] = statistics.median(result["calls"][1:]) if n > 1 else None
        # from the third save on, a tier that keeps two checkpoints writes over the oldest one's files
        # (pyckpt) or its one buffer (DLRover): what a job saving every step pays for hours
        result["steady_call"] = statistics.median(result["calls"][2:]) if n > 2 else None
        result["stall"] = statistics.median(result["calls"])
        result["step_with_save_over_plain"] = result["step_with_save"] / result["plain_step"]
        if rank == 0:
            _write(args.result, result)
        # the driver SIGKILLs this job once the result is there (a crash with the memory saves only)
        while True:
            time.sleep(60)

    # ---- resume: a new torchrun of the job after its SIGKILL
    tag = None
    if way == "dlrover" and args.tag:
        tag = args.tag
    error = None
    try:
        if checkpointer is not None:
            placeholder = None
            if tag:
                # DeepSpeed 0.19.8's _load_checkpoint globs the tag folder for the model-state file and its
                # SDLoader asserts that the file exists; after memory saves only, DLRover removed that folder
                # (its state is in shared memory, and DLRover's torch.load stand-in returns it by the file's
                # suffix): an empty file of that name lets DeepSpeed's load reach DLRover's memory.
                placeholder = engine._get_ckpt_name(out, tag)
                if rank == 0 and not os.path.exists(placeholder):
                    os.makedirs(os.path.dirname(placeholder), exist_ok=True)
                    open(placeholder, "wb").close()
                dist.barrier()
            checkpointer.load_checkpoint(out, tag=tag)
        else:
            engine.load_checkpoint(out)
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        import traceback

        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    t_load = time.time()
    prepare_call = None  # pyckpt: the tier readied for the next save, after the load (part of the first step's phase)
    if tier is not None and error is None and not args.unprepared:
        t0 = time.perf_counter()
        result["prepared"] = pd.prepare_memory_tier(engine, out, save_tier=tier)
        prepare_call = time.perf_counter() - t0
    resumed_step = engine.global_steps
    loaded_sum = weights_sum()
    loaded_moments = moments_sum()  # (in the first step's phase with the weights' sum: every way pays both)
    first_step_call = step(torch.Generator().manual_seed(1234))
    t_step = time.time()
    second_step_call = step()  # after the timed restart: is the first step's extra time the first step's only?
    aliased = state_in_shared_memory(engine)
    save_error = None
    # (not after DLRover's untagged load, which resumes nothing: a save there would overwrite the memory copy
    # that the tagged restart after it loads)
    if way != "deepspeed" and error is None and not (way == "dlrover" and not tag):
        try:
            _, wrote, handle = save()
            if handle is not None:
                handle.wait()
        except Exception as exc:  # noqa: BLE001 - a report, not a check
            save_error = f"{type(exc).__name__}: {exc!r}"[:300]
    times = gather({"created": t_created, "script": T_SCRIPT, "imports": t_imports, "rdzv": t_rdzv,
                    "engine": t_engine, "load": t_load, "step": t_step, "error": error, "save_error": save_error,
                    "prepare_call": prepare_call, "first_step_call": first_step_call, "aliased": aliased,
                    "moments": loaded_moments,
                    "second_step_call": second_step_call})
    if rank == 0:
        result.update(resumed_step=resumed_step, loaded_weights_sum=loaded_sum, load_error=error,
                      prepare_call=None if prepare_call is None else max(t["prepare_call"] for t in times),
                      save_after_resume_error=[t["save_error"] for t in times],
                      first_step_call=max(t["first_step_call"] for t in times),
                      optimizer_state_in_shm=[t["aliased"] for t in times],
                      loaded_moments_sums=[t["moments"] for t in times],
                      second_step_call=max(t["second_step_call"] for t in times),
                      stamps={k: max(t[k] for t in times) for k in
                              ("created", "script", "imports", "rdzv", "engine", "load", "step")})
        _write(args.result, result)
    dist.barrier()
    os._exit(0)  # no exit handlers: a normal end would persist or clean up, which a crashed job never does


def state_in_shared_memory(engine) -> list:
    """[optimizer-state tensors whose memory lies in a mapping of a /dev/shm file, optimizer-state tensors]: a
    way whose load hands the optimizer views of its memory copy leaves the training steps writing into it."""
    import torch

    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith(SHM + "/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    hits = total = 0
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                total += 1
                p = value.data_ptr()
                hits += any(lo <= p < hi for lo, hi in spans)
    return [hits, total]


def _adapt_dlrover_agent(checkpointer) -> None:
    """DLRover's AsyncCheckpointAgent stands in for torch.save/torch.load during DeepSpeed's save and load, with
    the signatures of older DeepSpeed; DeepSpeed 0.19.8's TorchCheckpointEngine calls them with
    ``_use_new_zipfile_serialization=`` and ``weights_only=``: accept and drop those keywords."""
    agent = checkpointer._ckpt_agent
    save, load = agent.save, agent.load

    def save_wrapper(state_dict, path, **_ignored):
        return save(state_dict, path)

    def load_wrapper(path, map_location=None, **_ignored):
        return load(path, map_location=map_location)

    agent.save, agent.load = save_wrapper, load_wrapper


def _write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------- driver
def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launched process and every descendant: torchrun starts each worker in a session of its own,
    so a signal to torchrun's process group does not reach them."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
    proc.wait()


class Driver:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.work = self.out + "-work"
        self.memory_root = f"{SHM}/pyckpt-vs-dlrover-{os.getpid()}"
        self.port = 29400 + os.getpid() % 500
        os.makedirs(self.work, exist_ok=True)

    def torchrun(self, way: str, phase: str, job: str, result: str, tag: str = "", env=None) -> subprocess.Popen:
        a = self.args
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", job,
               os.path.abspath(__file__), self.out, "--worker", "--way", way, "--phase", phase, "--job", job,
               "--result", result, "--memory-root", self.memory_root, "--params", a.params,
               "--width", str(a.width), "--steps", str(a.steps)]
        if a.bucket:
            cmd += ["--bucket", str(a.bucket)]
        if a.unprepared:
            cmd += ["--unprepared"]
        if tag:
            cmd += ["--tag", tag]
        if way == "dlrover":  # torchrun sets ROLE_NAME from --role: DLRover's workers then start no saver
            cmd[cmd.index("--rdzv-id"):cmd.index("--rdzv-id")] = ["--role", "dlrover-trainer"]
        full = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // a.nproc)),
                    **(env or {}))
        log = open(os.path.join(self.work, os.path.basename(result)[:-5] + ".log"), "ab")
        return subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def dlrover_agent(self, job: str) -> subprocess.Popen:
        """The part of dlrover-run's elastic agent that keeps the shared memory across worker restarts."""
        code = ("import time\n"
                "from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver\n"
                "AsyncCheckpointSaver.start_async_saving_ckpt()\n"
                "while True: time.sleep(60)\n")
        log = open(os.path.join(self.work, f"{job}-agent.log"), "ab")
        return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, TORCHELASTIC_RUN_ID=job),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def dlrover_master(self, job: str) -> tuple:
        """DLRover's local job master, started as dlrover-run --standalone would start it
        (``dlrover.trainer.torch.elastic_run._launch_dlrover_local_master``); (the process, its address, whether it
        listened within 60 s). A single node's MEMORY saves do not call it; its saver reports failures to it."""
        import socket

        port = self.port + 1
        log = open(os.path.join(self.work, f"{job}-master.log"), "ab")
        proc = subprocess.Popen([sys.executable, "-u", "-m", "dlrover.python.master.main", "--port", str(port),
                                 "--node_num", "1", "--job_name", job, "--platform", "local"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc, f"127.0.0.1:{port}", True
            except OSError:
                time.sleep(0.5)
        return proc, f"127.0.0.1:{port}", False

    def train(self, way: str, job: str, env) -> tuple:
        result = os.path.join(self.work, f"{job}-train.json")
        proc = self.torchrun(way, "train", job, result, env=env)
        deadline = time.time() + self.args.timeout
        while not os.path.exists(result):
            if proc.poll() is not None or time.time() > deadline:
                _kill_tree(proc)
                raise RuntimeError(f"{way}: the training job ended without a result (see {self.work}/{job}-train.log)")
            time.sleep(0.2)
        t_kill = time.time()
        _kill_tree(proc)  # the whole job: torchrun and its workers
        with open(result) as f:
            return json.load(f), t_kill

    def resume(self, way: str, job: str, name: str, t_kill: float, tag: str = "", env=None) -> dict:
        result = os.path.join(self.work, f"{job}-{name}.json")
        t_launch = time.time()
        proc = self.torchrun(way, "resume", job, result, tag=tag, env=env)
        try:
            proc.wait(timeout=self.args.timeout)
        except subprocess.TimeoutExpired:
            pass
        _kill_tree(proc)  # workers that outlived torchrun, if any
        if not os.path.exists(result):
            return {"error": f"no result (rc {proc.returncode}; see {self.work}/{job}-resume.log)"}
        with open(result) as f:
            r = json.load(f)
        s = r.pop("stamps")
        r["phases"] = {"kill_to_launch": t_launch - t_kill, "worker_start": s["script"] - t_launch,
                       "imports": s["imports"] - s["script"], "rendezvous": s["rdzv"] - s["imports"],
                       "engine_build": s["engine"] - s["rdzv"], "load": s["load"] - s["engine"],
                       "first_step": s["step"] - s["load"]}
        r["kill_to_first_step"] = s["step"] - t_kill
        return r

    def hold_ballast(self, way: str):
        """With ``--ballast-bytes N``: a file of N bytes in /dev/shm (N/2 for DLRover, which holds one copy of the
        state where pyckpt holds two slots) for the DeepSpeed and DLRover ways' round, so that every way runs
        with the same memory in use; its path, or None."""
        n = int(self.args.ballast_bytes or 0)
        if way.startswith("pyckpt") or n <= 0:
            return None
        if way == "dlrover":
            n //= 2
        path = os.path.join(SHM, f"pyckpt-vs-dlrover-ballast-{os.getpid()}")
        chunk = b"\x01" * (64 << 20)  # written, not fallocated: every page touched, as a save touches them
        with open(path, "wb") as f:
            for _ in range(n // len(chunk)):
                f.write(chunk)
            f.write(chunk[:n % len(chunk)])
        return path

    def evict_out(self) -> int:
        from pagecache import evict, resident_bytes

        os.sync()
        files = [os.path.join(d, f) for d, _, fs in os.walk(self.out) for f in fs]
        for f in files:
            evict(f)
        return sum(resident_bytes(f) for f in files)

    def clear_out(self) -> None:
        shutil.rmtree(self.out, ignore_errors=True)
        os.makedirs(self.out)

    def one(self, way: str, r: int) -> dict:
        job = f"mvd{os.getpid()}r{r}{way.replace('_', '')}"
        self.clear_out()
        row: dict = {"way": way, "job": job}
        agent = master = None
        env = None
        if way == "dlrover":
            master, addr, row["dlrover_master_listening"] = self.dlrover_master(job)
            env = {"DLROVER_MASTER_ADDR": addr, "NODE_ID": "0", "NODE_RANK": "0",
                   "NODE_NUM": "1"}
            os.environ.update(env)  # the agent's too
            agent = self.dlrover_agent(job)
            time.sleep(2)  # the agent's socket servers
        ballast = self.hold_ballast(way)
        try:
            train, t_kill = self.train(way, job, env)
            row["train"] = train
            saved = train["saved_step"]
            if way == "dlrover":
                row["resume_no_tag"] = self.resume(way, job, "resume_no_tag", time.time(), env=env)
                t_kill = time.time()  # the timed restart starts from here (the workers are already gone)
                row["resume"] = self.resume(way, job, "resume", t_kill, tag=str(saved), env=env)
                # DLRover's save after that resume fails (every rank but 0), so its memory still names the saved
                # step: a second crash restores from it again (the resume's steps wrote its moments: above)
                row["resume_again"] = self.resume(way, job, "resume_again", time.time(), tag=str(saved), env=env)
            elif way == "deepspeed":
                row["resume"] = self.resume(way, job, "resume", t_kill)
                row["resident_after_eviction"] = self.evict_out()
                row["resume_evicted"] = self.resume(way, job, "resume_evicted", time.time())
            else:
                row["resume"] = self.resume(way, job, "resume", t_kill)
                if not self.args.no_floor:  # while the tier still holds its slots: the memory in use of its load
                    row["restore_floor"] = floor(train["params"], self.args.nproc)
            for key in ("resume", "resume_evicted", "resume_no_tag", "resume_again"):
                if key in row and "resumed_step" in row[key]:
                    got = row[key]
                    got["resumed_saved_step"] = got["resumed_step"] == saved
                    got["same_weights"] = got["loaded_weights_sum"] == train["saved_weights_sum"]
                    got["same_moments"] = got.get("loaded_moments_sums") == train.get("saved_moments_sums")
        finally:
            if ballast:
                os.remove(ballast)
            for name in ("DLROVER_MASTER_ADDR", "NODE_ID", "NODE_RANK", "NODE_NUM"):
                if env:
                    os.environ.pop(name, None)
            if master is not None:
                _kill_tree(master)
            if agent is not None:
                agent.terminate()
                try:
                    agent.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
                _kill_tree(agent)
        time.sleep(0.5)
        if way == "dlrover":
            left = _shm_bytes(job)
            row["left_in_dev_shm"] = left
            for name in left["entries"]:  # this round's run id names them: ours to remove
                path = os.path.join(SHM, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            shutil.rmtree(os.path.join("/tmp/ckpt_sock", job), ignore_errors=True)
        elif way.startswith("pyckpt"):
            row["left_in_dev_shm"] = {"entries": [self.memory_root], "bytes": _tree_bytes(self.memory_root)
                                      if os.path.exists(self.memory_root) else 0}
            shutil.rmtree(self.memory_root, ignore_errors=True)
        return row

    def run(self) -> dict:
        a = self.args
        rows = []
        for r in range(a.rounds):
            order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]
            for way in order:
                t0 = time.time()
                row = self.one(way, r)
                row["round"], row["wall_s"] = r, time.time() - t0
                rows.append(row)
                print(json.dumps(_brief(row)), flush=True)
                if a.json:  # what is measured so far, should a later way fail
                    with open(a.json, "w") as f:
                        json.dump({"rows": rows, "partial": True}, f, indent=1)
        shutil.rmtree(self.out, ignore_errors=True)
        return {"rows": rows, "medians": _medians(rows)}


def _brief(row: dict) -> dict:
    t, out = row.get("train", {}), {"round": row.get("round"), "way": row["way"]}
    for k in ("plain_step", "stall", "first_call", "later_call", "steady_call", "step_with_save_over_plain",
              "skipped_saves", "prepared", "prepare_call"):
        out[k] = t.get(k)
    for key in ("resume", "resume_evicted", "resume_no_tag", "resume_again"):
        if key in row:
            got = row[key]
            out[key] = {k: got.get(k) for k in ("kill_to_first_step", "resumed_step", "same_weights", "same_moments",
                                                "load_error", "save_after_resume_error")}
            out[key]["load"] = got.get("phases", {}).get("load")
    if "restore_floor" in row:
        out["restore_floor"] = row["restore_floor"]["repeats"]
    return out


def _medians(rows: list) -> dict:
    med: dict = {}
    names = ALL_WAYS + ["deepspeed_evicted", "dlrover_load_no_tag", "dlrover_second_restart"]
    for name in names:
        base = {"deepspeed_evicted": "deepspeed", "dlrover_load_no_tag": "dlrover",
                "dlrover_second_restart": "dlrover"}.get(name, name)
        key = {"deepspeed_evicted": "resume_evicted", "dlrover_load_no_tag": "resume_no_tag",
               "dlrover_second_restart": "resume_again"}.get(name, "resume")
        mine = [r for r in rows if r["way"] == base and "train" in r]
        if not mine:
            continue
        m: dict = {}
        if name == base:
            for k in ("plain_step", "stall", "first_call", "later_call", "steady_call", "step_with_save",
                      "step_with_save_over_plain", "prepare_call"):
                vals = [r["train"][k] for r in mine if r["train"].get(k) is not None]
                if vals:
                    m[k] = statistics.median(vals)
            for when in ("after_first_save", "after_last_save"):
                tm = [r["train"]["memory"][when]["tmpfs"] for r in mine if r["train"]["memory"][when]["tmpfs"] is not None]
                rss = [r["train"]["memory"][when]["rss_sum"] - r["train"]["memory"]["before"]["rss_sum"] for r in mine]
                if tm:
                    m[f"tmpfs_bytes_{when}"] = statistics.median(tm)
                m[f"rss_growth_{when}"] = statistics.median(rss)
            m["skipped_saves"] = sum(r["train"]["skipped_saves"] for r in mine)
            m["left_in_dev_shm_bytes"] = [r.get("left_in_dev_shm", {}).get("bytes") for r in mine]
        res = [r[key] for r in mine if key in r and "phases" in r[key]]
        if res:
            for ph in res[0]["phases"]:
                m[f"restart_{ph}"] = statistics.median(x["phases"][ph] for x in res)
            m["kill_to_first_step"] = statistics.median(x["kill_to_first_step"] for x in res)
            m["launch_to_first_step"] = statistics.median(x["kill_to_first_step"] - x["phases"]["kill_to_launch"]
                                                          for x in res)
            m["optimizer_state_in_shm"] = [x.get("optimizer_state_in_shm") for x in res]
            for k in ("first_step_call", "second_step_call"):
                vals = [x[k] for x in res if x.get(k) is not None]
                if vals:
                    m[f"restart_{k}"] = statistics.median(vals)
            m["resumed_saved_step"] = [x["resumed_saved_step"] for x in res]
            m["same_weights"] = [x["same_weights"] for x in res]
            m["same_moments"] = [x.get("same_moments") for x in res]
            m["save_after_resume_error"] = [x.get("save_after_resume_error") for x in res]
        floors = [r["restore_floor"]["median"] for r in mine if "restore_floor" in r and name == base]
        if floors:
            m["restore_floor"] = statistics.median(floors)
        med[name] = m
    # every way's load over the floor measured beside pyckpt's (restore_floor.py): what is left above the copy
    floors = [r["restore_floor"]["median"] for r in rows if "restore_floor" in r]
    if floors:
        low = statistics.median(floors)
        med["restore_floor"] = {"median": low, "load_over_floor": {
            name: m["restart_load"] / low for name, m in med.items() if "restart_load" in m}}
    return med


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="durable folder (emptied between ways, removed at the end); OUT-work holds logs")
    p.add_argument("--params", default="100M")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="plain steps, then steps with a save, per training job")
    p.add_argument("--bucket", type=float, default=None,
                   help="ZeRO reduce_bucket_size and allgather_bucket_size (elements; default DeepSpeed's 5e8)")
    p.add_argument("--unprepared", action="store_true",
                   help="pyckpt: no prepare_memory_tier before the first save (nor after the restart's load)")
    p.add_argument("--ways", default=",".join(ALL_WAYS))
    p.add_argument("--ballast-bytes", type=float, default=0,
                   help="hold this many bytes of tmpfs through the DeepSpeed way's round (half through DLRover's): "
                        "pyckpt's two slots, so that every way runs with the same memory in use")
    p.add_argument("--no-floor", action="store_true",
                   help="leave out restore_floor.py's figure after each pyckpt restart")
    p.add_argument("--timeout", type=float, default=900, help="seconds a job may take")
    p.add_argument("--quick", action="store_true", help="smoke run: 2M parameters, width 256, 1 round, 2 steps")
    p.add_argument("--json", default=None)
    # worker side (the driver passes these to torchrun)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--way", help=argparse.SUPPRESS)
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--memory-root", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.params, args.width, args.rounds, args.steps = "2M", 256, 1, 2
    WAYS[:] = [w for w in args.ways.split(",") if w]
    from measure import memory_headroom

    before = memory_headroom()
    t0 = time.time()
    result = Driver(args).run()
    result.update(memory_before=before, ballast_bytes=args.ballast_bytes, params_arg=args.params, width=args.width,
                  nproc=args.nproc, rounds=args.rounds, steps=args.steps,
                  bucket=args.bucket, cores=os.cpu_count(), wall_s=time.time() - t0,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(result["medians"], indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
