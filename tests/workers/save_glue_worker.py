"""Rank code for tests/deepspeed/save/test_save_glue.py, run in a dsharness launch through `call` tasks.

Every function trains a small engine on each rank and saves through `pyckpt.deepspeed.save_checkpoint`;
rank 0 returns what the test checks (each rank's outcome is gathered, so "every rank raised the same"
is checked too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time

import torch
import torch.distributed as tdist

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the harness (dsharness/), the helpers (helpers/) and the other workers
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]
import worker as W  # noqa: E402  (dsharness/worker.py, already imported by the supervisor)
from dsharness import compare_states  # noqa: E402
from hf_client_worker import build_tokenizer  # noqa: E402

import pyckpt.deepspeed as pd  # noqa: E402

MODEL_CONFIG = {"model_type": "pyckpt-test", "hidden_size": 8, "dtype": "float32"}


def _client_state(cfg: dict) -> dict:
    # as dsharness's run_save: the ZeRO checkpoint carries universal_checkpoint_info
    return {"universal_checkpoint_info": {}} if cfg["uc_info"] else {}


def _engine(cfg: dict, ws: int, rank: int, steps: int):
    engine = W.make_engine(cfg, ws)
    engine.train()
    for step in range(steps):
        W.train_step(engine, cfg, rank, step)
    return engine


def _gather(value) -> list:
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, value)
    return out


def _tokenizer(task: dict, rank: int):
    folder = os.path.join(task["root"], f"tokenizer-source-{rank}")
    return build_tokenizer(folder)


def _reload(cfg: dict, ws: int, root: str, tag=None):
    """A fresh engine resumed by DeepSpeed's own load_checkpoint: (its state, load path, client state)."""
    engine = W.make_engine(cfg, ws)
    state, path, client = W.resume(engine, root, tag=tag)
    return _with_extras(engine, state), path, client


def _with_extras(engine, state: dict) -> dict:
    """``state`` (W.state_after_load of ``engine``) with global_steps and the engine's extras; the engine is
    destroyed."""
    state["meta"]["global_steps"] = engine.global_steps
    state["engine"] = _engine_extras(engine)
    engine.destroy()
    return state


def _engine_extras(engine) -> dict:
    """What a load sets beyond the masters and moments, on this rank: the low-precision weights the
    module holds (ZeRO-3: this rank's partition), the loss scaler's and lr scheduler's state and the
    engine's counters."""
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None)
    plain = (bool, int, float, str, type(None))
    return {
        "lp": {n: _lp_elements(p) for n, p in engine.module.named_parameters()},
        "scaler": {k: v for k, v in vars(scaler).items() if isinstance(v, plain)} if scaler is not None else None,
        "lr": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "counters": [engine.global_steps, engine.global_samples, engine.skipped_steps],
    }


def _lp_elements(p):
    """The low-precision weights this rank holds of ``p``: all of it, or under ZeRO-3 its partition's
    elements of the parameter (a last partition's padding is not the parameter's: DeepSpeed's own load
    leaves whatever the allocator gave it there)."""
    part = getattr(p, "ds_tensor", None)
    if part is None:
        return p.detach().cpu().clone()
    start = tdist.get_rank() * part.numel()
    return part.detach().cpu().flatten()[:max(0, min(part.numel(), p.ds_numel - start))].clone()


def _extras_differ(a: dict, b: dict) -> list:
    """What differs between two _engine_extras (tensors exactly, dtype included)."""
    out = [k for k in ("scaler", "lr", "counters") if a[k] != b[k]]
    if a["lp"].keys() != b["lp"].keys():
        return out + ["lp names"]
    return out + [f"lp/{n}" for n in a["lp"] if a["lp"][n].dtype != b["lp"][n].dtype
                  or not torch.equal(a["lp"][n], b["lp"][n])]


def equal(task: dict, rank: int, ws: int) -> dict:
    """A bare engine.save_checkpoint and the glue's save of the same state, then a resume from the glue's."""
    from pyckpt.deepspeed.save.space import estimate_rank_bytes

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 2)
    client = {**_client_state(cfg), "note": "from the test"}
    engine.save_checkpoint(os.path.join(root, "bare"), tag="t", client_state=dict(client))
    estimate = estimate_rank_bytes(engine)
    ok = pd.save_checkpoint(engine, os.path.join(root, "glue"), tag="t", tokenizer=_tokenizer(task, rank),
                            model_config=MODEL_CONFIG, client_state=dict(client))
    saved = W.gather_state(engine)
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    engine.destroy()
    loaded, path, client_loaded = _reload(cfg, ws, os.path.join(root, "glue"))
    return {"ok": _gather(ok), "estimates": _gather(estimate), "problems": compare_states(saved, loaded),
            "load_path": str(path), "client_note": client_loaded.get("note"), "lrs": lrs,
            "global_steps": loaded["meta"]["global_steps"]}


@contextlib.contextmanager
def _fault(kind: str, active: bool):
    """One rank's save breaks: an exception from torch.save, a file-size limit, a folder it may not write."""
    if not active:
        yield
        return
    if kind == "exception":
        real = torch.save

        def failing_save(*args, **kwargs):
            raise RuntimeError("injected failure in torch.save")

        torch.save = failing_save
        try:
            yield
        finally:
            torch.save = real
    elif kind == "fsize":
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        # above the rank's log file (stdout), below the optimizer shard it is about to write
        limit = os.fstat(1).st_size + (1 << 20)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    elif kind == "readonly":
        # Permission bits do not stop root: the rank writes as nobody (as under NFS root squashing),
        # so the staging folder rank 0 made is read-only to it. The launch's rendezvous file (the
        # process group's store) stays usable to it, as a TCP store would be.
        import json

        store = json.load(open(sys.argv[1]))["store"]
        os.chmod(os.path.dirname(store), 0o711)
        os.chmod(store, 0o666)
        os.setegid(65534)
        os.seteuid(65534)
        try:
            yield
        finally:
            os.seteuid(0)
            os.setegid(0)
    else:
        raise ValueError(kind)


def _listing(root: str) -> list:
    return sorted(os.listdir(root))


def under_enable_save(task: dict, rank: int, ws: int) -> dict:
    """pyckpt's own saves (to save_dir, asynchronous, to the memory tier) and prepare_memory_tier while
    enable(save="atomic") routes DeepSpeed's save_checkpoint through pyckpt: each is one save, not a save
    nested in another, and the checkpoint is DeepSpeed's own files."""
    from pyckpt.deepspeed.tiers import free_slot

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    tier = pd.MemoryTier(root=os.path.join(root, "mem"), job="e", keep=2)
    with pd.enable(save="atomic"):
        ok = [bool(pd.save_checkpoint(engine, os.path.join(root, "d"), tag="sync")),
              bool(pd.save_checkpoint(engine, os.path.join(root, "d"), tag="async", async_save=True).wait())]
        kind = pd.prepare_memory_tier(engine, os.path.join(root, "d"), save_tier=tier)
        free_slot.settle()
        ok.append(bool(pd.save_checkpoint(engine, os.path.join(root, "d"), tag="mem", save_tier=tier)))
    engine.save_checkpoint(os.path.join(root, "stock"), tag="sync")
    engine.destroy()
    folders = {tag: _listing(os.path.join(root, "d", tag)) for tag in ("sync", "async")}
    folders["mem"] = _listing(os.path.join(tier.folder(), "mem"))
    return {"ok": _gather(ok), "kind": kind, "folders": folders, "stock": _listing(os.path.join(root, "stock", "sync")),
            "top": _listing(os.path.join(root, "d"))}


def fault(task: dict, rank: int, ws: int) -> dict:
    """A good save, a save that fails on rank 1, one more training step, a good save; then the first loads."""
    from pyckpt.deepspeed.save import SaveError

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    first = pd.save_checkpoint(engine, root, tag="good", client_state=_client_state(cfg))
    good = W.gather_state(engine)
    before = _listing(root)
    W.train_step(engine, cfg, rank, 1)
    error = None
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("pyckpt").addHandler(handler)
    with _fault(task["fault"], rank == 1):
        try:
            result = pd.save_checkpoint(engine, root, tag="bad", client_state=_client_state(cfg),
                                        on_error=task["on_error"])
        except SaveError as exc:
            result, error = "raised", str(exc)
    logging.getLogger("pyckpt").removeHandler(handler)
    after = _listing(root)
    latest_after = open(os.path.join(root, "latest")).read()
    loss = W.train_step(engine, cfg, rank, 2)
    last = pd.save_checkpoint(engine, root, tag="next", client_state=_client_state(cfg))
    latest_last = open(os.path.join(root, "latest")).read()
    engine.destroy()
    loaded, path, _ = _reload(cfg, ws, root, tag="good")
    return {"first": first, "results": _gather(result), "errors": _gather(error), "warned": _gather(warned), "before": before, "after": after,
            "latest_after": latest_after, "loss_after": loss, "last": _gather(last), "latest_last": latest_last,
            "final": _listing(root), "problems": compare_states(good, loaded), "load_path": str(path)}


def partial(task: dict, rank: int, ws: int) -> dict:
    """The save called on rank 0 only, then on rank 1 only, then on both."""
    from pyckpt.deepspeed.save import CollectiveCallError

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    errors = {}
    for alone in (0, 1):
        if rank == alone:
            try:
                pd.save_checkpoint(engine, root, tag=f"only{alone}", arrival_timeout=3)
                errors[alone] = None
            except CollectiveCallError as exc:
                errors[alone] = str(exc)
        tdist.barrier()
    listing = _listing(root) if os.path.isdir(root) else []
    if rank == 0:  # what a save killed earlier would have left: the next save removes it
        os.makedirs(os.path.join(root, ".global_step9.pyckpt-tmp-deadhost-123-0abc", "zero"))
    tdist.barrier()
    both = pd.save_checkpoint(engine, root, tag="both", client_state=_client_state(cfg))
    engine.destroy()
    return {"errors": _gather(errors), "listing": listing, "both": _gather(both), "final": _listing(root)}


def no_space(task: dict, rank: int, ws: int) -> dict:
    """The filesystem says it has 1000 bytes free."""
    import pyckpt.deepspeed.save.preflight as cs
    from pyckpt.deepspeed.save import SaveError

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    real = cs.free_bytes
    cs.free_bytes = lambda path: 1000
    try:
        pd.save_checkpoint(engine, root, tag="big")
        error = None
    except SaveError as exc:
        error = str(exc)
    finally:
        cs.free_bytes = real
    engine.destroy()
    return {"errors": _gather(error), "listing": _listing(root)}


def converted(task: dict, rank: int, ws: int) -> dict:
    """A save that the ranks then convert together to Universal and export for Hugging Face."""
    cfg = task["cfg"]
    engine = _engine(cfg, ws, rank, 2)
    ok = pd.save_checkpoint(engine, task["root"], tag="t", model_config=MODEL_CONFIG, client_state=_client_state(cfg),
                            universal=True, export="hf")
    engine.destroy()
    return {"ok": _gather(ok)}


@contextlib.contextmanager
def _slow_background_write(delay_s: float):
    """The background write starts only after `delay_s` (the test's training steps run meanwhile)."""
    from pyckpt.deepspeed.save import async_save, background

    real = background.write_files

    def slow(*args, **kwargs):
        import time

        time.sleep(delay_s)
        return real(*args, **kwargs)

    async_save.write_files = slow
    try:
        yield
    finally:
        async_save.write_files = real


def async_equal(task: dict, rank: int, ws: int) -> dict:
    """DeepSpeed's own save and an asynchronous save of the same state; training steps run while the
    asynchronous one is written; then a resume from it."""
    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 2)
    # DeepSpeed's MoE save reserves universal_checkpoint_info for itself
    client = {**(_client_state(cfg) if cfg["model"] != "moe" else {}), "note": "from the test"}
    engine.save_checkpoint(os.path.join(root, "bare"), tag="t", client_state=dict(client))
    saved = W.gather_state(engine)
    steps_before = engine.global_steps
    with _slow_background_write(2.0):
        handle = pd.save_checkpoint(engine, os.path.join(root, "async"), tag="t", client_state=dict(client),
                                    async_save=True, snapshot_limit=task.get("snapshot_limit"))
        done_at_return = handle.done()
        losses = [W.train_step(engine, cfg, rank, 2 + s) for s in range(2)]
        done_after_steps = handle.done()
        published_early = os.path.exists(os.path.join(root, "async", "latest"))
        ok = handle.wait()
    held = engine._pyckpt_arena.held
    after = W.gather_state(engine)
    # whether DeepSpeed took its ZeRO-Offload path (host-resident partitions and optimizer state)
    offloaded = bool(getattr(engine.optimizer, "offload_optimizer" if cfg["stage"] == 3 else "cpu_offload", False))
    engine.destroy()
    loaded, path, client_loaded = _reload(cfg, ws, os.path.join(root, "async"))
    return {"ok": _gather(ok), "done_at_return": _gather(done_at_return), "done_after_steps": done_after_steps,
            "published_early": published_early, "problems": compare_states(saved, loaded),
            "changed": compare_states(saved, after) != [], "load_path": str(path),
            "client_note": client_loaded.get("note"), "global_steps": loaded["meta"]["global_steps"],
            "steps_before": steps_before, "losses": losses,
            "snapshot_held": held, "offloaded": offloaded}


@contextlib.contextmanager
def _background_fault(kind: str, active: bool):
    """One rank's background write breaks: an exception from the writer, a file-size limit, a SIGKILL."""
    from pyckpt.deepspeed.save import async_save, background

    if not active:
        yield
        return
    real = background.write_files

    def broken(*args, **kwargs):
        import signal
        import time

        time.sleep(0.5)  # the caller has gone on training by now
        if kind == "exception":
            raise RuntimeError("injected failure in the background write")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    async_save.write_files = broken
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if kind == "fsize":  # above the rank's log file, below the shard it is about to write
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.fstat(1).st_size + (1 << 20), limits[1]))
    try:
        yield
    finally:
        async_save.write_files = real


def _restore_fsize():
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def async_fault(task: dict, rank: int, ws: int) -> dict:
    """A good asynchronous save; one whose background write fails on rank 1 while training goes on;
    the next save joins it (the failure surfaces there), then saves; keep_last=1 throughout."""
    from pyckpt.deepspeed.save import SaveError

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    first = pd.save_checkpoint(engine, root, tag="good", client_state=_client_state(cfg), async_save=True,
                               keep_last=1).wait()
    good = W.gather_state(engine)
    before = _listing(root)
    with _background_fault(task["fault"], rank == 1):
        handle = pd.save_checkpoint(engine, root, tag="bad", client_state=_client_state(cfg), async_save=True,
                                    on_error=task["on_error"], keep_last=1)
        returned = handle.done() is False
        W.train_step(engine, cfg, rank, 1)
        while not handle.done():  # the outcome is reached in the background, without a join
            import time

            time.sleep(0.05)
    _restore_fsize()
    after = _listing(root)
    latest_after = open(os.path.join(root, "latest")).read()
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("pyckpt").addHandler(handler)
    error = None
    try:  # the next save joins the failed one first
        last = pd.save_checkpoint(engine, root, tag="next", client_state=_client_state(cfg), async_save=True,
                                  on_error=task["on_error"], keep_last=1)
    except SaveError as exc:
        error = str(exc)
        last = pd.save_checkpoint(engine, root, tag="next", client_state=_client_state(cfg), async_save=True,
                                  on_error=task["on_error"], keep_last=1)
    logging.getLogger("pyckpt").removeHandler(handler)
    ok_last = last.wait()
    after_next = _listing(root)
    engine.destroy()
    return {"first": first, "returned": _gather(returned), "errors": _gather(error), "warned": _gather(warned),
            "before": before, "after": after, "latest_after": latest_after, "last": _gather(ok_last),
            "latest_last": open(os.path.join(root, "latest")).read(), "final": after_next,
            "handle_ok": _gather(handle.ok), "good": good if rank == 0 else None}


def async_killed(task: dict, rank: int, ws: int) -> dict:
    """A good asynchronous save, then one during whose background write rank 1 is killed."""
    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    pd.save_checkpoint(engine, root, tag="good", client_state=_client_state(cfg), async_save=True, keep_last=1).wait()
    good = W.gather_state(engine)  # collective
    if rank == 0:
        torch.save(good, os.path.join(task["state_dir"], "good.pt"))
    tdist.barrier()
    with _background_fault("kill", rank == 1):
        handle = pd.save_checkpoint(engine, root, tag="bad", client_state=_client_state(cfg), async_save=True,
                                    keep_last=1)
        W.train_step(engine, cfg, rank, 1)
        handle.wait()  # rank 1 dies in there; the supervisor then kills rank 0
    return {}


def async_after_kill(task: dict, rank: int, ws: int) -> dict:
    """A new job after the killed one: resume from `latest`, then save asynchronously."""
    cfg = task["cfg"]
    root = task["root"]
    listing = _listing(root)
    latest = open(os.path.join(root, "latest")).read()
    loaded, path, _ = _reload(cfg, ws, root)
    good = torch.load(os.path.join(task["state_dir"], "good.pt"), weights_only=False)
    engine = _engine(cfg, ws, rank, 0)
    engine.load_checkpoint(root)
    ok = pd.save_checkpoint(engine, root, tag="next", client_state=_client_state(cfg), async_save=True,
                            keep_last=1).wait()
    engine.destroy()
    return {"listing": listing, "latest": latest, "problems": compare_states(good, loaded), "load_path": str(path),
            "ok": _gather(ok), "final": _listing(root)}


def async_destroy_joins(task: dict, rank: int, ws: int) -> dict:
    """An asynchronous save left in flight; engine.destroy() joins it."""
    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    with _slow_background_write(1.0):
        handle = pd.save_checkpoint(engine, root, tag="t", client_state=_client_state(cfg), async_save=True)
        in_flight = not handle.done()
        engine.destroy()
    return {"in_flight": _gather(in_flight), "done": _gather(handle.done()), "ok": _gather(handle.ok),
            "listing": _listing(root), "arena": getattr(engine, "_pyckpt_arena", None) is None}


def async_fallback(task: dict, rank: int, ws: int) -> dict:
    """async_save=True where the state cannot be captured byte-equal (torch's legacy serialization):
    a warning, then the synchronous save."""
    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    engine.checkpoint_engine.zipfile_serialization = False
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("pyckpt").addHandler(handler)
    try:
        handle = pd.save_checkpoint(engine, root, tag="t", client_state=_client_state(cfg), async_save=True)
    finally:
        logging.getLogger("pyckpt").removeHandler(handler)
    done = handle.done()
    ok = handle.wait()
    saved = W.gather_state(engine)
    engine.destroy()
    loaded, path, _ = _reload(cfg, ws, root)
    legacy = not open(os.path.join(root, "t", "mp_rank_00_model_states.pt"), "rb").read(2) == b"PK"
    return {"warned": _gather(warned), "done": _gather(done), "ok": _gather(ok), "legacy": legacy,
            "problems": compare_states(saved, loaded), "listing": _listing(root)}


def refusals(task: dict, rank: int, ws: int) -> dict:
    """What a save must refuse before it writes, on every rank alike, and what keep_last must spare:
    a tag or conversion folder that is someone's, arguments that differ between ranks, a user folder
    that looks like a checkpoint, a checkpoint touched after newer ones."""
    from pyckpt.deepspeed.save import SaveError

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    if rank == 0:
        os.makedirs(os.path.join(root, "notes"))
        with open(os.path.join(root, "notes", "important.txt"), "w") as f:
            f.write("mine")
        os.makedirs(os.path.join(root, "analysis"))
        with open(os.path.join(root, "analysis", "expert_counts.pt"), "w") as f:
            f.write("mine")
        os.makedirs(os.path.join(root, "s1_hf"))
        with open(os.path.join(root, "s1_hf", "results.csv"), "w") as f:
            f.write("mine")
    tdist.barrier()

    def attempt(**kwargs):
        try:
            out = pd.save_checkpoint(engine, root, client_state=_client_state(cfg), **kwargs)
            return ("returned", bool(out.wait()) if hasattr(out, "wait") else bool(out))
        except (SaveError, ValueError) as exc:
            return ("raised", str(exc))

    outcomes = {}
    listings = {}
    for name, kwargs in {"tag-async": dict(tag="notes", async_save=True),
                         "tag-sync": dict(tag="notes"),
                         "latest-tag": dict(tag="latest"),
                         "async-differs": dict(tag="d1", async_save=rank == 0),
                         "keep-last-differs": dict(tag="d2", keep_last=1 if rank == 0 else 2),
                         "export-differs": dict(tag="d3", export="hf" if rank == 1 else None),
                         "hf-folder-is-someones": dict(tag="s1", export="hf")}.items():
        outcomes[name] = _gather(attempt(**kwargs))
        listings[name] = _listing(root)
        W.train_step(engine, cfg, rank, 1)  # a training collective after each: no rank was left behind
    # keep_last counts this job's checkpoints only, by the steps they record
    saved = {}
    for tag in ("s2", "s3"):
        W.train_step(engine, cfg, rank, 2)
        out = pd.save_checkpoint(engine, root, tag=tag, client_state=_client_state(cfg), keep_last=2,
                                 async_save=tag == "s3")
        saved[tag] = out.wait() if tag == "s3" else out
    if rank == 0:
        os.utime(os.path.join(root, "s2"))  # touched: the newest folder by time, not by step
    tdist.barrier()
    W.train_step(engine, cfg, rank, 3)
    saved["s4"] = pd.save_checkpoint(engine, root, tag="s4", client_state=_client_state(cfg), keep_last=2,
                                     async_save=True).wait()
    engine.destroy()
    with open(os.path.join(root, "notes", "important.txt")) as f:
        notes = f.read()
    return {"outcomes": outcomes, "listings": listings, "saved": _gather(saved), "final": _listing(root),
            "notes": notes, "latest": open(os.path.join(root, "latest")).read()}


def _resume(cfg: dict, ws: int, root: str, memory):
    """A fresh engine resumed under enable(memory=...) by a load naming no tag: (its state, path, log)."""
    engine = W.make_engine(cfg, ws)
    lines = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("pyckpt").addHandler(handler)
    from pyckpt.deepspeed.load import hooks

    try:
        with pd.enable(memory=memory):
            path, client = engine.load_checkpoint(root)
    finally:
        logging.getLogger("pyckpt").removeHandler(handler)
    state = _with_extras(engine, W.state_after_load(engine))
    # which load read it: pyckpt's direct one (no DeepSpeed load of the optimizer shards) or DeepSpeed's
    state["load"] = {"backend": hooks.last_load.get("backend"), "direct": bool(hooks.last_load.get("direct")),
                     "lp_filled": bool(hooks.last_load.get("lp_filled")), "client": client}
    return state, str(path), lines


def _same_files(a: str, b: str) -> list:
    """Names whose bytes differ between two checkpoint folders (or that only one holds)."""
    names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
    out = []
    for n in names:
        pa, pb = os.path.join(a, n), os.path.join(b, n)
        if not (os.path.isfile(pa) and os.path.isfile(pb)) or open(pa, "rb").read() != open(pb, "rb").read():
            out.append(n)
    return out


def _shared_writable_inodes() -> list:
    """The inodes of the files this process has mapped writable and shared (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[1].startswith("rw") and parts[1].endswith("s") and parts[4] != "0":
                out.append(int(parts[4]))
    return out


def memory_tier(task: dict, rank: int, ws: int) -> dict:
    """Five saves to a memory tier (keep 2, every 2nd persisted, async every other one), then a new
    engine resumes under enable(memory=...) from the save folder: it must take the newest step, from
    memory, equal to DeepSpeed's own load of that memory checkpoint and to the state at the save."""
    from pyckpt.deepspeed.save.in_flight import join_persistence

    cfg = task["cfg"]
    root = task["root"]
    durable = os.path.join(root, "durable")
    tier = pd.MemoryTier(root=os.path.join(root, "mem"), job="job1", keep=2, persist_every=2)
    engine = _engine(cfg, ws, rank, 1)
    results = []
    ahead = premapped = None
    inodes = []  # per save, the inode of each of DeepSpeed's files in the memory folder
    folder = tier.folder()
    # before training: the first save's files made in a free slot, each rank its own, allocated and mapped
    from pyckpt.deepspeed.tiers import free_slot

    prepared = pd.prepare_memory_tier(engine, durable, save_tier=tier)
    free_slot.settle()
    tdist.barrier()  # every rank's files made
    slot, spare = free_slot.path(folder), free_slot.next_path(folder)
    made = {n: os.stat(os.path.join(slot, n)) for n in sorted(os.listdir(slot))}
    made_next = {n: os.stat(os.path.join(spare, n)) for n in sorted(os.listdir(spare))}
    first = {"kind": prepared, "made": {n: (st.st_ino, st.st_size) for n, st in made.items()},
             "made_next": {n: (st.st_ino, st.st_size) for n, st in made_next.items()},
             "mapped": sorted(set(_shared_writable_inodes()) & {st.st_ino for st in made.values()}),
             "mapped_next": sorted(set(_shared_writable_inodes()) & {st.st_ino for st in made_next.values()})}
    for s in range(1, 6):
        W.train_step(engine, cfg, rank, s)
        out = pd.save_checkpoint(engine, durable, tag=f"s{s}", client_state=_client_state(cfg), memory=tier,
                                 async_save=s % 2 == 0, keep_last=1)
        results.append(bool(out.wait()) if hasattr(out, "wait") else bool(out))
        tag_dir = os.path.join(folder, f"s{s}")
        inodes.append({n: os.stat(os.path.join(tag_dir, n)).st_ino for n in sorted(os.listdir(tag_dir))
                       if n.endswith(".pt")})
        if s == 1:
            first["s1"] = {n: (os.stat(os.path.join(tag_dir, n)).st_ino, os.stat(os.path.join(tag_dir, n)).st_size)
                           for n in sorted(os.listdir(tag_dir)) if n.endswith(".pt")}
        if s == 1 and rank == 0:  # the node's leader made the second save's slot ahead, from s1's layout
            from pyckpt.deepspeed.tiers import free_slot

            free_slot.settle(folder)
            slot = free_slot.path(folder)
            ahead = {n: os.stat(os.path.join(slot, n)).st_ino for n in sorted(os.listdir(slot)) if n.endswith(".pt")}
        if s == 2:  # the third save writes over s1's files: each rank has mapped its own of them ahead
            from pyckpt.deepspeed.tiers import free_slot

            free_slot.settle()
            premapped = sorted(set(_shared_writable_inodes()) & set(inodes[0].values()))
    from pyckpt import _core

    mapped = _core.output_maps_info()["count"]  # this rank's files written over through a kept mapping
    at_save = W.gather_state(engine)
    at_save["meta"]["global_steps"] = engine.global_steps
    persisted = join_persistence(engine)
    # DeepSpeed's own save of the same step: the memory checkpoint's files are its files, byte for byte
    stock_dir = os.path.join(root, "stock")
    engine.save_checkpoint(stock_dir, tag="s5", client_state=_client_state(cfg))
    engine.destroy()
    vs_deepspeed = _same_files(os.path.join(stock_dir, "s5"), os.path.join(folder, "s5"))
    listing = {"memory": _listing(folder), "durable": _listing(durable)}
    differ = _same_files(os.path.join(durable, "s4"), os.path.join(folder, "s4"))
    mode = oct(os.stat(os.path.join(root, "mem")).st_mode & 0o777)
    resumed, path, log = _resume(cfg, ws, durable, tier)
    stock, stock_path, stock_client = _reload(cfg, ws, folder, tag="s5")
    return {"loaded_by": _gather([resumed["load"]["backend"], resumed["load"]["direct"],
                                  resumed["load"]["lp_filled"]]),
            "extras_vs_stock": _gather(_extras_differ(stock["engine"], resumed["engine"])),
            "client_vs_stock": _gather(repr(resumed["load"]["client"]) == repr(stock_client)),
            "results": _gather(results), "persisted": persisted, "listing": listing, "differ": differ,
            "mode": mode, "path": path, "log": _gather(log), "stock_path": str(stock_path),
            "vs_stock": compare_states(stock, resumed), "vs_save": compare_states(at_save, resumed),
            "latest_durable": open(os.path.join(durable, "latest")).read(), "inodes": inodes,
            "vs_deepspeed": vs_deepspeed, "mapped": _gather(mapped), "ahead": ahead,
            "premapped": _gather(premapped), "first": _gather(first)}


def memory_prepare_cases(task: dict, rank: int, ws: int) -> dict:
    """prepare_memory_tier where it must do nothing (a budget the files exceed; a job folder another save
    dir's job holds), and where it made a slot that no save took before a normal end."""
    from pyckpt.deepspeed.save import memory_save
    from pyckpt.deepspeed.tiers import free_slot

    cfg = task["cfg"]
    root = task["root"]
    engine = _engine(cfg, ws, rank, 1)
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("pyckpt")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    mem = os.path.join(root, "mem")
    try:
        # before the first training step the optimizer may not have made its state: nothing is prepared
        steps, engine.global_steps = engine.global_steps, 0
        early = pd.prepare_memory_tier(engine, os.path.join(root, "a"), save_tier=pd.MemoryTier(root=mem, job="early"))
        engine.global_steps = steps
        early_made = os.path.exists(os.path.join(mem, "early"))
        # a root others can write: refused as a save refuses it, nothing made inside
        opened = os.path.join(root, "open")
        if rank == 0:
            os.makedirs(opened, mode=0o777)
            os.chmod(opened, 0o777)
        tdist.barrier()
        hostile = pd.prepare_memory_tier(engine, os.path.join(root, "a"), save_tier=pd.MemoryTier(root=opened, job="h"))
        hostile_listing = _listing(opened)
        small = pd.prepare_memory_tier(engine, os.path.join(root, "a"),
                                       save_tier=pd.MemoryTier(root=mem, job="small", limit_bytes=1000))
        small_listing = _listing(os.path.join(mem, "small"))
        # job "j" belongs to the job saving to root/a; the job saving to root/b must not put a slot there
        tier = pd.MemoryTier(root=mem, job="j", keep=2)
        assert pd.save_checkpoint(engine, os.path.join(root, "a"), tag="s1", save_tier=tier)
        free_slot.settle()
        foreign_before = _listing(tier.folder())
        foreign = pd.prepare_memory_tier(engine, os.path.join(root, "b"), save_tier=tier)
        foreign_listing = _listing(tier.folder())
        # a slot made for a first save that never comes: a normal end removes it, and the folders it leaves empty
        unused = pd.prepare_memory_tier(engine, os.path.join(root, "c"), save_tier=pd.MemoryTier(root=mem, job="c"))
        unused_listing = _listing(os.path.join(mem, "c"))
        c_folder = pd.MemoryTier(root=mem, job="c").folder()
        free_slot.settle()
        tdist.barrier()
        c_slot = free_slot.path(c_folder)
        slot_bytes = sum(os.path.getsize(os.path.join(c_slot, n)) for n in os.listdir(c_slot))  # the node's files
        both = sorted(os.listdir(c_folder))
        # room for one slot, not two: only the first save's is made
        one = pd.prepare_memory_tier(engine, os.path.join(root, "o"),
                                     save_tier=pd.MemoryTier(root=mem, job="one", limit_bytes=slot_bytes * 3 // 2))
        free_slot.settle()
        tdist.barrier()
        one_listing = sorted(os.listdir(os.path.join(mem, "one", "node0")))
        tdist.barrier()
        memory_save._discard_unused()  # what the exit handler runs first at a normal end
        tdist.barrier()
        after_exit = sorted(os.listdir(mem))
        kinds = [early, hostile, small, foreign, unused, one]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    engine.destroy()
    return {"kinds": _gather(kinds), "small_listing": small_listing, "early_made": early_made,
            "hostile_listing": hostile_listing, "both": both, "one_listing": one_listing,
            "foreign_listing": foreign_listing, "foreign_before": foreign_before, "unused_listing": unused_listing,
            "after_exit": after_exit, "said": _gather([line for line in said if "prepared" in line])}


def memory_refusals(task: dict, rank: int, ws: int) -> dict:
    """A memory tier whose budget a checkpoint exceeds, and one whose root is writable by others: each
    save says why in one line and goes to save_dir; nothing is written to memory."""
    cfg = task["cfg"]
    root = task["root"]
    durable = os.path.join(root, "durable")
    engine = _engine(cfg, ws, rank, 1)
    if rank == 0:
        os.makedirs(os.path.join(root, "open"), mode=0o777)
        os.chmod(os.path.join(root, "open"), 0o777)
    tdist.barrier()
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("pyckpt").addHandler(handler)
    small = pd.MemoryTier(root=os.path.join(root, "mem"), job="j", limit_bytes=1000)
    opened = pd.MemoryTier(root=os.path.join(root, "open"), job="j")
    try:
        full = pd.save_checkpoint(engine, durable, tag="full", client_state=_client_state(cfg), memory=small)
        hostile = pd.save_checkpoint(engine, durable, tag="hostile", client_state=_client_state(cfg), memory=opened)
    finally:
        logging.getLogger("pyckpt").removeHandler(handler)
    # Two asynchronous memory saves back to back, rank 0 a step's worth ahead: each is whole when its
    # call returns (one copy in the call, nothing in the background), keep=1 keeps the newest and the
    # free slot the next save writes over (b1's files)
    tier = pd.MemoryTier(root=os.path.join(root, "mem2"), job="j", keep=1)
    first = pd.save_checkpoint(engine, durable, tag="b1", client_state=_client_state(cfg), memory=tier,
                               async_save=True)
    first_done = first.done()
    b1 = {n: os.stat(os.path.join(tier.folder(), "b1", n)).st_ino for n in os.listdir(os.path.join(tier.folder(), "b1"))
          if n.endswith(".pt")}
    if rank == 0:
        time.sleep(0.5)
    second = pd.save_checkpoint(engine, durable, tag="b2", client_state=_client_state(cfg), memory=tier,
                                async_save=True)
    back_to_back = [first.wait(), second.wait()]
    slot = os.path.join(tier.folder(), ".pyckpt-slot")
    in_slot = {n: os.stat(os.path.join(slot, n)).st_ino for n in os.listdir(slot) if n.endswith(".pt")} \
        if os.path.isdir(slot) else {}
    engine.destroy()
    mem_files = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(os.path.join(root, "mem")) for f in fs]
    return {"ok": _gather([full, hostile]), "warned": _gather(warned), "durable": _listing(durable),
            "back_to_back": _gather(back_to_back), "mem2": _listing(tier.folder()), "first_done": first_done,
            "b1_in_slot": in_slot == b1 and bool(b1),
            "mem_files": mem_files, "open_listing": _listing(os.path.join(root, "open"))}


def stock_equals(task: dict, rank: int, ws: int) -> dict:
    """DeepSpeed's own load of task["root"]/task["tag"], compared with the state a resume wrote."""
    cfg = task["cfg"]
    stock, path, _ = _reload(cfg, ws, task["root"], tag=task["tag"])
    resumed = torch.load(task["resumed"], weights_only=False)  # the test's own file
    return {"problems": compare_states(stock, resumed["state"]), "path": str(path),
            "global_steps": stock["meta"]["global_steps"]}


def stock_step(task: dict, rank: int, ws: int) -> dict:
    """DeepSpeed's own load of task["root"] (its latest): the step it resumes at."""
    state, path, _ = _reload(task["cfg"], ws, task["root"])
    return {"global_steps": state["meta"]["global_steps"], "path": str(path)}
