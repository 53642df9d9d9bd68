"""Rank code for tests/deepspeed/load/test_load_backend.py, run in a dsharness launch through `call` tasks.

`run`: every rank builds an engine and loads a universal folder with DeepSpeed's own loader, takes a
snapshot of everything the load restores (per rank, not gathered: flat fp32 partitions with their
padding, every optimizer state tensor, steps, hyper-parameters, loss-scaler fields, low-precision
parameters, fragment views, counters, scheduler and client state), takes one more training step
and snapshots again; then the same with pyckpt's backend enabled. Each rank compares the two and
rank 0 returns every rank's differences. `truth`: the same snapshot of a run trained one step
further without a checkpoint, for the fields where pyckpt corrects DeepSpeed.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the harness (dsharness/), the helpers (helpers/) and the other workers
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]
import worker as W  # noqa: E402  (dsharness/worker.py, already imported by the supervisor)
from pagecache import evict, resident_bytes  # noqa: E402


def _t(x):
    return x.detach().cpu().clone() if torch.is_tensor(x) else x


def snapshot(engine) -> dict:
    """Everything a universal load restores on this rank, keyed by a readable path."""
    opt = engine.optimizer
    base = opt.optimizer
    snap = {}
    index = {}
    for gi, group in enumerate(base.param_groups):
        snap[f"group{gi}/hyper"] = {k: v for k, v in group.items() if k != "params"}
        for pi, p in enumerate(group["params"]):
            index[p] = f"group{gi}/param{pi}"
    stage3 = hasattr(opt, "fp32_partitioned_groups_flat")
    flats = opt.fp32_partitioned_groups_flat if stage3 else [g["params"][0] for g in base.param_groups]
    for fi, flat in enumerate(flats):
        # ZeRO-3 empties its groups' "params" between steps (and the load does too): name by sub-group.
        name = f"flat{fi}" if stage3 else index.get(flat, f"flat{fi}")
        snap[f"{name}/fp32"] = _t(flat)
        for key, value in base.state.get(flat, {}).items():
            snap[f"{name}/state/{key}"] = _t(value)
    if stage3:
        for gi, flat in enumerate(opt.fp16_partitioned_groups_flat):
            snap[f"lp_flat{gi}"] = _t(flat)
        for name, p in engine.module.named_parameters():
            q = p.ds_tensor.numel()
            rank = tdist.get_rank(group=opt._get_param_partition_group(p))
            real = max(0, min(q, p.ds_numel - rank * q))
            snap[f"mask/ds_tensor/{name}"] = torch.arange(q) < real
            # A frozen parameter's padding is uninitialised memory that no load touches.
            snap[f"ds_tensor/{name}"] = _t(p.ds_tensor if p.requires_grad else p.ds_tensor.view(-1)[:real])
        # Which elements of each sub-group's flat are real (the rest is per-parameter padding,
        # uninitialised memory in a run that never loaded a checkpoint).
        for gi, group in enumerate(opt.fp16_groups):
            parts = []
            for p in group:
                world = tdist.get_world_size(group=opt._get_param_partition_group(p))
                rank = tdist.get_rank(group=opt._get_param_partition_group(p))
                q = p.ds_tensor.numel()
                real = max(0, min(q, p.ds_numel - rank * q))
                parts += [torch.ones(real, dtype=torch.bool), torch.zeros(q - real, dtype=torch.bool)]
                assert q * world >= p.ds_numel
            mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
            flat = opt.fp32_partitioned_groups_flat[gi]
            snap[f"mask/flat{gi}"] = torch.cat([mask, torch.zeros(flat.numel() - mask.numel(), dtype=torch.bool)])
    else:
        buffers = {v.untyped_storage().data_ptr() for st in base.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0}
        for name, p in engine.module.named_parameters():
            snap[f"lp/{name}"] = _t(p)
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                snap[f"hp_fragment/{name}"] = _t(mapping.get_hp_fragment())
                for key, view in (mapping.optim_fragment or {}).items():
                    snap[f"optim_fragment/{name}/{key}"] = _t(view)
                    # a view into the group's state buffer, not a copy of it
                    snap[f"optim_fragment_is_view/{name}/{key}"] = view.untyped_storage().data_ptr() in buffers
    scaler = getattr(opt, "loss_scaler", None)
    snap["loss_scaler"] = (type(scaler).__name__, dict(vars(scaler))) if scaler is not None else None
    for attr in ("clip_grad", "overflow", "dynamic_loss_scale"):
        snap[attr] = getattr(opt, attr, None)
    snap["global_steps"] = engine.global_steps
    snap["global_samples"] = engine.global_samples
    snap["scheduler"] = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return snap


def own_bytes(engine) -> int:
    """This rank's share of the universal files: 4 bytes x 3 states x the real elements its
    partitions hold."""
    opt = engine.optimizer
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_partitioned_groups_flat"):
        n = 0
        for group in opt.fp16_groups:
            for p in group:
                rank = tdist.get_rank(group=opt._get_param_partition_group(p))
                q = p.ds_tensor.numel()
                n += max(0, min(q, p.ds_numel - rank * q))
    else:
        n = sum(p._hp_mapping.lp_fragment_address.numel for p in engine.module.parameters()
                if getattr(p, "_hp_mapping", None) is not None)
    return 12 * n


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def diff(a: dict, b: dict, skip=()) -> list:
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key.startswith(s) or key.endswith(s) for s in skip):
            continue
        if key not in a or key not in b:
            out.append(f"{key}: only in {'stock' if key in a else 'pyckpt'}")
            continue
        x, y = a[key], b[key]
        if torch.is_tensor(x) or torch.is_tensor(y):
            # bits, not values: a ZeRO-3 partition's padding is uninitialised memory that may hold a
            # NaN pattern, which torch.equal calls unequal to itself
            if not (torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape
                    and _bits(x) == _bits(y)):
                out.append(f"{key}: {x!r} != {y!r}"[:300])
        elif x != y:
            out.append(f"{key}: {x!r} != {y!r}"[:300])
    return out


def flatten(value, prefix: str = "", out: dict | None = None) -> dict:
    """A nested value as {path: leaf}, for a field-by-field diff: containers leave their type and
    length (a dict its keys in order), tensors are compared whole (dtype, shape, bits), any other leaf
    as (type name, repr) so that 1, 1.0 and True, or 0.0 and -0.0, differ."""
    out = {} if out is None else out
    if isinstance(value, dict):
        out[f"{prefix}<dict>"] = (type(value).__name__, [repr(k) for k in value])
        for k, v in value.items():
            flatten(v, f"{prefix}{k if isinstance(k, str) else repr(k)}/", out)
    elif isinstance(value, (list, tuple)):
        out[f"{prefix}<seq>"] = (type(value).__name__, len(value))
        for i, v in enumerate(value):
            flatten(v, f"{prefix}{i}/", out)
    elif torch.is_tensor(value):
        out[prefix.rstrip("/")] = _t(value)
    else:
        out[prefix.rstrip("/")] = (type(value).__name__, repr(value))
    return out


def _file_mappings(path: str) -> list:
    """The address ranges this process maps from `path` (/proc/self/maps)."""
    real = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].strip() == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


class ModelStateReads:
    """Every torch.load of a model-state file while the block runs, DeepSpeed's and pyckpt's alike
    (both call it through the module attribute): its path, whether it was memory-mapped and
    weights-only, and how many of the `module` tensors it returned hold bytes outside a mapping of
    that file (read into memory: materialised) out of how many hold any."""

    def __enter__(self):
        self.reads = []
        self._load = torch.load

        def load(f, *args, **kwargs):
            out = self._load(f, *args, **kwargs)
            if isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith("_model_states.pt"):
                ranges = _file_mappings(os.fspath(f))
                tensors = [t for t in (out.get("module") or {}).values() if torch.is_tensor(t) and t.nbytes]
                inside = [any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ranges)
                          for t in tensors]
                self.reads.append({"path": os.path.realpath(f), "mmap": bool(kwargs.get("mmap")),
                                   "weights_only": kwargs.get("weights_only"), "module_tensors": len(tensors),
                                   "materialised": inside.count(False)})
            return out

        torch.load = load
        return self

    def __exit__(self, *exc):
        torch.load = self._load
        return False


def poison_optimizer_state(engine) -> int:
    """NaN into every optimizer-state tensor the engine holds before a load (its initial zero
    moments): pyckpt refills those buffers instead of allocating new ones, so an element its gather
    failed to write would otherwise keep a plausible zero. Returns the tensors poisoned."""
    n = 0
    for state in engine.optimizer.optimizer.state.values():
        for key, value in state.items():
            if key != "step" and torch.is_tensor(value) and value.is_floating_point() and value.numel():
                value.fill_(float("nan"))
                n += 1
    return n


def correct_zero3_load(engine, root: str, tag: str, names: list) -> None:
    """Undo the two things DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong, the rest of its load
    left as it is: it hands every sub-group one shared `step` tensor (the next step advances it once
    per sub-group), and every param group group 0's saved hyper-parameters. Each sub-group gets its
    own copy of the step, each group its own saved hyper-parameters (zero/optimizer_state.pt, the
    test's own file) but `names`, the names the groups had before the load (an AutoEP expert group
    is named after its expert-parallel group in this run: "ep_size_4" loading a save whose group was
    "ep_size_2")."""
    opt = engine.optimizer
    state = opt.optimizer.state
    for flat in opt.fp32_partitioned_groups_flat:
        if "step" in state.get(flat, {}):
            state[flat]["step"] = state[flat]["step"].clone()
    saved = torch.load(os.path.join(root, tag, "zero", "optimizer_state.pt"), weights_only=False)
    groups = saved["optimizer_state_dict"]["param_groups"]
    assert len(groups) == len(opt.optimizer.param_groups), (len(groups), len(opt.optimizer.param_groups))
    for live, kept, name in zip(opt.optimizer.param_groups, groups, names):
        live.update({k: v for k, v in kept.items() if k != "params"})
        if name is None:
            live.pop("name", None)
        else:
            live["name"] = name


def _load(cfg, world_size: int, rank: int, root: str, tag: str, backend: bool, correct: bool = False, **kw):
    import pyckpt.deepspeed
    from pyckpt.deepspeed.load import hooks

    engine = W.make_engine(cfg, world_size, load_universal=True)
    if backend and kw.get("load_optimizer_states", True):  # a module-only load leaves them as they are
        poison_optimizer_state(engine)
    names = [g.get("name") for g in engine.optimizer.optimizer.param_groups]
    handle = pyckpt.deepspeed.enable() if backend else None
    try:
        with ModelStateReads() as reads:
            path, client = engine.load_checkpoint(root, tag=tag, **kw)
    finally:
        if handle is not None:
            pyckpt.deepspeed.disable()
    if correct:
        correct_zero3_load(engine, root, tag, names)
    return _observe(engine, cfg, rank, client, dict(hooks.last_load) if backend else {}, reads.reads)


def _observe(engine, cfg, rank: int, client, info: dict, reads: list) -> dict:
    """After a load: the snapshot, the snapshot after one more step and its loss, the client state
    flattened (flatten) and against the payload that was saved, and `info` with this rank's own
    bytes, the optimizer class and the model-state reads."""
    info.update(own_bytes=own_bytes(engine), optimizer=type(engine.optimizer).__name__, reads=reads)
    before = snapshot(engine)
    engine.train()
    loss = W.train_step(engine, cfg, rank, engine.global_steps)
    after = snapshot(engine)
    engine.destroy()
    client = client or {}
    payload = diff(flatten(W.client_payload()), flatten(client.get("trainer"))) if cfg.get("client_payload") \
        else None
    return {"before": before, "after": after, "loss": loss, "client": flatten(client), "payload": payload,
            "info": info}


def _everyone(value):
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, value)
    return out


def run(task: dict, rank: int, world_size: int) -> dict:
    cfg = task["cfg"]
    skip = tuple(task.get("skip", ()))
    kw = task.get("load_kwargs", {})
    s = _load(cfg, world_size, rank, task["root"], task["tag"], False, task.get("correct", False), **kw)
    p = _load(cfg, world_size, rank, task["root"], task["tag"], True, **kw)
    mine = {
        "before": diff(s["before"], p["before"], skip),
        "after": diff(s["after"], p["after"], skip + tuple(task.get("skip_after", ()))),
        "loss": (s["loss"], p["loss"]),
        "client": diff(s["client"], p["client"]),
        "client_keys": len(s["client"]),
        "payload": (s["payload"], p["payload"]),
        "scheduler": (s["before"]["scheduler"], s["after"]["scheduler"]),
        "info": p["info"],
        "stock_info": s["info"],
        "keys": len(s["before"]),
    }
    result = {"ranks": _everyone(mine)}
    if task.get("keep"):
        result["pyckpt_before"] = _everyone({k: v for k, v in p["before"].items() if any(x in k for x in task["keep"])})
        result["stock_before"] = _everyone({k: v for k, v in s["before"].items() if any(x in k for x in task["keep"])})
    return result


def truth(task: dict, rank: int, world_size: int) -> dict:
    """A run trained `steps + 1` steps without a checkpoint: the snapshot before and after its last step."""
    cfg = task["cfg"]
    engine = W.make_engine(cfg, world_size)
    engine.train()
    for step in range(cfg["steps"]):
        W.train_step(engine, cfg, rank, step)
    before = snapshot(engine)
    loss = W.train_step(engine, cfg, rank, cfg["steps"])
    after = snapshot(engine)
    engine.destroy()
    return {"ranks": _everyone({"before": before, "after": after, "loss": loss})}


def with_backend(task: dict, rank: int, world_size: int) -> dict:
    """Load with pyckpt only; snapshot before and after one more step."""
    cfg = task["cfg"]
    got = _load(cfg, world_size, rank, task["root"], task["tag"], True)
    return {"ranks": _everyone({k: got[k] for k in ("before", "after", "loss", "info")})}


def _failing(task: dict, world_size: int, how: str = "pyckpt", rank: int = 0) -> dict:
    """One load expected to fail: this rank's exception, and which fields of the engine's state
    changed on the way. `how`: "pyckpt" (enable() on the universal folder), "stock" (DeepSpeed's own
    loader on it), "direct" (pyckpt.deepspeed.load_checkpoint on the ZeRO checkpoint in root). A rank
    listed in task["rank_roots"] loads its own copy (a checkpoint that differs between ranks); the
    tag comes from its latest_universal when task["tag"] is None. DeepSpeed's own loader sets the
    counters and the scheduler before the optimizer load fails, so those are not compared for it."""
    import pyckpt.deepspeed

    cfg = task["cfg"]
    root = task.get("rank_roots", {}).get(str(rank), task["root"])
    engine = W.make_engine(cfg, world_size, load_universal=how not in ("direct", "plain", "plain_off", "plain_mixed"))
    before = snapshot(engine)
    error = None
    try:
        if how == "direct":
            pyckpt.deepspeed.load_checkpoint(engine, root)
        elif how in ("plain", "plain_off"):  # enable() and the load a training script makes, no load_universal
            with pyckpt.deepspeed.enable(reshard=how == "plain"):
                engine.load_checkpoint(root)
        elif how == "plain_mixed":  # ranks that disagree on the load's options
            with pyckpt.deepspeed.enable():
                engine.load_checkpoint(root, load_optimizer_states=rank == 0)
        elif how == "stock":
            engine.load_checkpoint(root, tag=task["tag"])
        else:
            with pyckpt.deepspeed.enable():
                engine.load_checkpoint(root, tag=task["tag"])
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        error = (type(exc).__name__, str(exc))
    changed = diff(before, snapshot(engine), skip=("global_steps", "global_samples", "scheduler")
                   if how in ("stock", "plain_off") else ())
    engine.destroy()
    return {"error": error, "changed": changed}


def failing(task: dict, rank: int, world_size: int) -> dict:
    """Load a damaged universal folder with pyckpt: every rank's exception, and whether any of its
    state changed on the way (this rank's exception is caught: its process goes on, as a training
    script's that catches it would)."""
    return {"ranks": _everyone(_failing(task, world_size, rank=rank))}


def failing_each_way(task: dict, rank: int, world_size: int) -> dict:
    """The same failing load in these ranks by each of task["ways"] ("stock", "pyckpt", "direct";
    stock first: DeepSpeed's loader fails on every rank at the same check, before any collective of
    the load); per rank, {way: _failing's result}."""
    return {"ranks": _everyone({how: _failing(task, world_size, how, rank) for how in task["ways"]})}


class PyckptLog:
    """The lines logged under the "pyckpt" logger while in the block."""

    def __enter__(self):
        import logging

        self.lines = []
        self._handler = logging.Handler()
        self._handler.emit = lambda record: self.lines.append(record.getMessage())
        logging.getLogger("pyckpt").addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        import logging

        logging.getLogger("pyckpt").removeHandler(self._handler)


def _load_direct(cfg, world_size: int, rank: int, root: str, how: str):
    """Resume from the plain ZeRO checkpoint in `root` (its `latest`): through
    pyckpt.deepspeed.load_checkpoint on an engine without load_universal ("api"), through
    engine.load_checkpoint(root, tag) with load_universal and pyckpt enabled ("enable"; tag None
    where no latest_universal lies in root), or through a plain engine.load_checkpoint(root) under
    enable() on an engine as configured for training, no load_universal ("reshard": the checkpoint
    was saved at another topology)."""
    import pyckpt.deepspeed
    from pyckpt.deepspeed.load import hooks

    log = []
    if how == "reshard":
        engine = W.make_engine(cfg, world_size)
        poison_optimizer_state(engine)
        with pyckpt.deepspeed.enable(), ModelStateReads() as reads, PyckptLog() as logged:
            path, client = engine.load_checkpoint(root)
        assert not engine.load_universal_checkpoint(), "the engine's flag is restored"
        log = logged.lines
    elif how == "api":
        engine = W.make_engine(cfg, world_size)
        poison_optimizer_state(engine)
        with ModelStateReads() as reads:
            path, client = pyckpt.deepspeed.load_checkpoint(engine, root)
        assert not pyckpt.deepspeed.enabled(), "the hooks are removed again"
        assert not engine.load_universal_checkpoint(), "the engine's flag is restored"
    else:
        engine = W.make_engine(cfg, world_size, load_universal=True)
        poison_optimizer_state(engine)
        # with no latest_universal beside it, DeepSpeed's own tag resolution finds nothing: pyckpt
        # follows `latest`; with one (a converted folder), the ZeRO tag has to be named
        has_universal = os.path.exists(os.path.join(root, "latest_universal"))
        tag = open(os.path.join(root, "latest")).read().strip() if has_universal else None
        with pyckpt.deepspeed.enable(), ModelStateReads() as reads:
            path, client = engine.load_checkpoint(root, tag=tag)
    return _observe(engine, cfg, rank, client, dict(hooks.last_load, path=path, log=log), reads.reads)


def direct(task: dict, rank: int, world_size: int) -> dict:
    """Convert-then-load (pyckpt's backend on DeepSpeed's converted folder) against resuming from
    the ZeRO checkpoint directly, both ways in."""
    cfg = task["cfg"]
    skip = tuple(task.get("skip", ()))
    u = _load(cfg, world_size, rank, task["root"], task["tag"], True)
    out = {}
    for how in ("api", "enable", "reshard"):
        d = _load_direct(cfg, world_size, rank, task.get("direct_root", task["root"]), how)
        u_client = u["client"]
        if "direct_root" in task:  # saved without universal_checkpoint_info: the one key it lacks
            u_client = {k: v for k, v in u_client.items() if not k.startswith("universal_checkpoint_info")}
            u_client["<dict>"] = (u_client["<dict>"][0], [k for k in u_client["<dict>"][1]
                                                          if k != repr("universal_checkpoint_info")])
        client = diff(u_client, d["client"])
        out[how] = {"before": diff(u["before"], d["before"], skip), "after": diff(u["after"], d["after"], skip),
                    "loss": (u["loss"], d["loss"]), "info": d["info"], "payload": d["payload"],
                    "scheduler": (d["before"]["scheduler"], d["after"]["scheduler"]),
                    # the top-level client_state keys that differ anywhere inside
                    "client_diff": sorted({c.split(":", 1)[0].split("/", 1)[0] for c in client}),
                    "client": client, "client_keys": len(d["client"]), "keys": len(u["before"])}
    return {"ranks": _everyone(out)}


def plain_same(task: dict, rank: int, world_size: int) -> dict:
    """A plain engine.load_checkpoint(root) at the topology the checkpoint was saved at, without and
    with enable(): the state before and after one more step must be the same, and pyckpt must have
    left the load to DeepSpeed (no load of its own recorded, nothing logged)."""
    import pyckpt.deepspeed
    from pyckpt.deepspeed.load import hooks

    cfg = task["cfg"]
    out = {}
    for how in ("stock", "enabled"):
        engine = W.make_engine(cfg, world_size)
        hooks.last_load.clear()
        with PyckptLog() as logged:
            if how == "enabled":
                with pyckpt.deepspeed.enable():
                    path, client = engine.load_checkpoint(task["root"])
            else:
                path, client = engine.load_checkpoint(task["root"])
        out[how] = _observe(engine, cfg, rank, client, dict(hooks.last_load, log=logged.lines, path=path), [])
    s, p = out["stock"], out["enabled"]
    return {"ranks": _everyone({"before": diff(s["before"], p["before"]), "after": diff(s["after"], p["after"]),
                                "loss": (s["loss"], p["loss"]), "info": p["info"]})}


def pages(task: dict, rank: int, world_size: int) -> dict:
    """The pages of the state files each rank's gather brings into the page cache. The ranks gather in
    turn (the planners' apply step wrapped with barriers: every rank reaches it), each after evicting
    the files, and count with mincore what its own gather added. `how`: "universal" (enable() on the
    universal folder) or "direct" (pyckpt.deepspeed.load_checkpoint on the ZeRO checkpoint)."""
    import glob

    import pyckpt.deepspeed
    from pyckpt.deepspeed.load import hooks
    from pyckpt.deepspeed.load import stage3_restore as zero3
    from pyckpt.deepspeed.load import stage12_restore as zero12

    cfg, root, how = task["cfg"], task["root"], task["how"]
    pattern = os.path.join(root, task["tag"], "zero", "*", "*.pt") if how == "universal" else \
        os.path.join(root, open(os.path.join(root, "latest")).read().strip(), "*_optim_states.pt")
    files = sorted(glob.glob(pattern))
    assert files, pattern
    seen = {}

    def in_turn(apply):
        def run(workers: int = 0):
            nbytes = None
            for turn in range(world_size):
                tdist.barrier()
                if turn == rank:
                    for f in files:
                        evict(f)
                    seen["baseline"] = sum(resident_bytes(f) for f in files)
                    nbytes = apply(workers)
                    seen["touched"] = sum(resident_bytes(f) for f in files) - seen["baseline"]
                tdist.barrier()
            return nbytes

        return run

    plans = zero12.plan, zero3.plan
    zero12.plan = lambda *a, **k: in_turn(plans[0](*a, **k))
    zero3.plan = lambda *a, **k: in_turn(plans[1](*a, **k))
    try:
        if how == "universal":
            engine = W.make_engine(cfg, world_size, load_universal=True)
            with pyckpt.deepspeed.enable():
                engine.load_checkpoint(root, tag=task["tag"])
        else:
            engine = W.make_engine(cfg, world_size)
            pyckpt.deepspeed.load_checkpoint(engine, root)
    finally:
        zero12.plan, zero3.plan = plans
    seen.update(own_bytes=own_bytes(engine), gathered=hooks.last_load["bytes_read"], files=len(files),
                file_bytes=sum(os.path.getsize(f) for f in files))
    engine.destroy()
    return {"ranks": _everyone(seen)}
