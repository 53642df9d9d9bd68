"""A save into the memory tier (``save_checkpoint(..., memory=MemoryTier(...))``), and its persistence.

The checkpoint goes to this node's folder of the job's memory root (tmpfs) instead of ``save_dir``,
through the same save as a durable one (synchronous or asynchronous: DeepSpeed's own files, staged,
agreed on every rank, published atomically with ``latest``); the newest ``keep`` stay there
(:mod:`.retention`, which removes only this job's checkpoints). Before anything is written the ranks
agree on whether it fits: the tmpfs's free space (less a spare share: its pages are the node's
memory) and the tier's byte limit, against every rank's estimate. A checkpoint that does not fit is
said so in one line and saved to ``save_dir`` instead; never half-written to memory, never a cause
of an out-of-memory kill.

Every ``persist_every``-th memory checkpoint (or one saved with ``persist=True``) is then copied to
``save_dir`` in the background, once its memory copy is published, with the durable save's rules: a
hidden staging folder, an atomic rename, ``latest`` last, an existing tag replaced only when it is a
checkpoint of the same model, ``keep_last`` after. A failed persistence is logged; the memory copy
stays.

A process that saved to the tier and ends without an uncaught exception leaves no memory checkpoint
behind (unless ``keep_at_exit``): at exit rank 0 joins the saves, persists the newest memory
checkpoint where ``save_dir`` holds an older one, and removes the job's memory folder. A crash leaves
it for the restart; ``pyckpt clean --memory JOB`` removes one by hand.

This version serves a job on one node (torchrun's ``LOCAL_WORLD_SIZE`` ranks = the world): its
ranks share the memory folder. Several nodes, each with its own folder and a replica on a peer, are
refused with a message saying so.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
from typing import Optional

from ...errors import SaveError
from ...execution.distributed import TorchRanks, describe_failure
from ...execution.publish import Publisher
from ..tiers.memory_root import budget, fits
from ..tiers.policy import MemoryTier
from .arrival import Arrival
from .background import AsyncSave
from .retention import keep_last as prune
from .retention import read_checkpoint, replace_problem
from .space import estimate_rank_bytes

log = logging.getLogger("pyckpt")


def _nodes(world: int) -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return -(-world // int(local)) if local and local.isdigit() and int(local) > 0 else 1


def save_to_memory(save, engine, save_dir: str, tag: Optional[str], memory: MemoryTier, persist: bool, kwargs: dict):
    """``save`` (pyckpt's save_checkpoint) into ``memory``'s folder, or into ``save_dir`` when it does
    not fit; then the persistence. Returns what ``save`` returns."""
    group = TorchRanks()
    if kwargs.get("universal") or kwargs.get("export"):
        raise ValueError("universal= and export= convert a durable checkpoint: a memory checkpoint is converted "
                         "once persisted (convert save_dir/<tag> with `pyckpt convert` / `pyckpt export`)")
    if _nodes(group.size) > 1:
        raise ValueError(f"the memory tier serves a job on one node in this version; this job has {group.size} "
                         f"ranks on {_nodes(group.size)} nodes (LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')})")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    # The previous asynchronous save is joined before this one's arrival, as every save does: its
    # background thread waits on the same store client, and a blocking wait there from this thread
    # would deadlock the two (each holds the client while it waits for the other rank's key).
    previous = getattr(engine, "_pyckpt_async_save", None)
    if previous is not None:
        engine._pyckpt_async_save = None
        previous.wait()
    # One persistence at a time, and never of a checkpoint this save's pruning could remove: the
    # previous one is joined first (rank 0 holds it; a failure was logged there).
    wait_for_persistence(engine)
    # The same arrival as every save: ranks that disagree on memory= meet here and in the one gather
    # below, which the others take for their preflight; both sides then see the difference and stop.
    arrival = Arrival("save", group.rank, group.size)
    arrival.wait(kwargs.get("arrival_timeout", 300.0), "pyckpt.deepspeed.save_checkpoint")
    mine = {"memory": True, "error": None, "need": 0, "budget": None, "folder": None}
    try:
        mine["folder"] = memory.folder()
        mine["need"] = estimate_rank_bytes(engine)
        mine["budget"] = budget(memory.root_path, memory.job_name, memory.limit_bytes)
    except Exception as exc:
        mine["error"] = describe_failure(exc)
    pre = group.all_gather(mine)
    arrival.done()
    if any(not (isinstance(p, dict) and p.get("memory")) for p in pre):
        raise SaveError("the ranks called save_checkpoint with different memory= settings (some with a memory "
                        f"tier, some without); checkpoint {tag} was not saved, nothing was written", published=False)
    errors = [(r, p["error"]) for r, p in enumerate(pre) if p["error"]]
    problem = None
    if errors:
        problem = "; ".join(f"rank {r}: {e}" for r, e in errors)
    else:
        problem = fits(sum(p["need"] for p in pre), pre[0]["budget"])
    if problem:
        if group.rank == 0:
            log.warning("pyckpt: checkpoint %s goes to %s, not to memory: %s", tag, save_dir, problem)
        return save(engine, save_dir, tag, **kwargs)
    folder = pre[group.rank]["folder"]
    if group.rank == 0:
        _leave_at_exit(memory, folder, save_dir, kwargs.get("fsync", False))
    count = getattr(engine, "_pyckpt_memory_saves", 0) + 1
    engine._pyckpt_memory_saves = count
    durable_keep = kwargs.pop("keep_last", None)
    result = save(engine, folder, tag, keep_last=memory.keep, **kwargs)
    if persist or (memory.persist_every and count % memory.persist_every == 0):
        if group.rank == 0:
            engine._pyckpt_persist = AsyncSave(f"persisting checkpoint {tag} to {save_dir}", "warn", 0).start(
                lambda handle: _persist(result, folder, save_dir, tag, durable_keep, kwargs.get("fsync", False)))
    return result


# What the exit handler needs, by memory folder: (tier, save_dir, fsync) of the latest save there.
_AT_EXIT: dict = {}
_CRASHED = []


def _leave_at_exit(memory: MemoryTier, folder: str, save_dir: str, fsync: bool) -> None:
    if not _AT_EXIT:
        previous = sys.excepthook

        def excepthook(kind, value, tb):  # an uncaught exception: a crash, whose restart needs the tier
            _CRASHED.append(kind)
            previous(kind, value, tb)

        sys.excepthook = excepthook
        atexit.register(_leave)
    _AT_EXIT[folder] = (memory, save_dir, fsync)


def _leave() -> None:
    """At a normal exit (rank 0): join, persist the newest memory checkpoint where save_dir's is older,
    remove the job's memory folder. Anything that fails leaves the folder, saying why."""
    if _CRASHED:
        return
    from .background import wait_for_saves
    from ..tiers.memory_root import remove_job
    from ..tiers.recovery import candidates

    for folder, (memory, save_dir, fsync) in list(_AT_EXIT.items()):
        if memory.keep_at_exit:
            continue
        try:
            wait_for_saves()
            newest = candidates(save_dir, folder)
            mem = [c for c in newest if c.tier == "memory"]
            durable = [c for c in newest if c.tier == "durable"]
            if mem and (not durable or durable[0].step < mem[0].step):
                ok, message = _persist(True, folder, save_dir, mem[0].tag, None, fsync)
                if not ok:
                    raise RuntimeError(message)
            remove_job(memory.root_path, memory.job_name)
            log.info("pyckpt: removed the memory tier of job %s (its newest checkpoint is in %s)", memory.job_name,
                     save_dir)
        except Exception as exc:
            log.warning("pyckpt: the memory tier of job %s stays at %s: %s", memory.job_name, folder,
                        describe_failure(exc))
    _AT_EXIT.clear()


def _persist(saved, folder: str, save_dir: str, tag: str, keep: Optional[int], fsync: bool) -> tuple:
    """Rank 0, in the background: the published memory checkpoint copied to ``save_dir/<tag>``."""
    if isinstance(saved, AsyncSave):
        if saved._thread is not None:
            saved._thread.join()  # its outcome, without taking its report from the caller's join
        ok = bool(saved.ok)
    else:
        ok = bool(saved)
    if not ok:
        return False, f"checkpoint {tag} was not persisted to {save_dir}: its memory save did not succeed"
    source = os.path.join(folder, tag)
    record = read_checkpoint(source)
    try:
        with Publisher(os.path.join(save_dir, tag), overwrite=True, fsync=fsync, pointer="latest") as out:
            problem = replace_problem(out.output, reference=record)
            if problem:
                return False, f"checkpoint {tag} was not persisted: {problem}"
            _copy_tree(source, out.staging, fsync)
            out.publish()
    except Exception as exc:
        return False, f"persisting checkpoint {tag} to {save_dir} failed: {describe_failure(exc)}"
    if keep:
        try:
            prune(save_dir, keep, newest=tag)
        except Exception as exc:
            log.warning("pyckpt: keep_last=%d could not prune %s: %s", keep, save_dir, describe_failure(exc))
    log.info("pyckpt: persisted %s to %s", tag, os.path.join(save_dir, tag))
    return True, None


def _copy_tree(source: str, dest: str, fsync: bool) -> None:
    """The memory checkpoint's files into the staging folder (the kernel copies: copy_file_range /
    sendfile, the GIL released); links are not followed (a published checkpoint holds none)."""
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        target = os.path.join(dest, entry.name)
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(target)
            _copy_tree(entry.path, target, fsync)
        elif entry.is_file(follow_symlinks=False):
            shutil.copyfile(entry.path, target, follow_symlinks=False)
            if fsync:
                fd = os.open(target, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


def wait_for_persistence(engine) -> bool:
    """Joins ``engine``'s persistence in flight (rank 0); True when none failed."""
    pending = getattr(engine, "_pyckpt_persist", None)
    engine._pyckpt_persist = None
    return True if pending is None else bool(pending.wait())
