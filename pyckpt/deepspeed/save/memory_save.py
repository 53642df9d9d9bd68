"""A save into the memory tier (``save_checkpoint(..., memory=MemoryTier(...))``), its persistence,
and the end of a job.

The checkpoint goes to each node's own folder of the job's memory root (tmpfs) instead of
``save_dir``: the job folder of the job saving to ``save_dir`` (:mod:`..tiers.job_identity`: its own
id, or, for a job that names none, a folder named after the save dir), recorded there as its run's
(refused, and saved to ``save_dir`` with one line, where another save dir's job holds it), through the same save as a durable one (synchronous or asynchronous: DeepSpeed's own
files, staged, agreed on every rank, published atomically with ``latest``; written in place by one
copy from the state, over the tier's free slot, :mod:`.slot_save`), each node's leader publishing its
node's share (:mod:`.node_share`); the newest ``keep`` stay there, a node holding ``max(keep, 2)``
checkpoints of the run at most (:mod:`..tiers.free_slot`). With several
nodes each share is then copied to the next node's memory in the background (:mod:`..tiers.links`).
Before anything is written the ranks agree on whether it fits, node by node: each node's tmpfs free
space (less a spare share: its pages are the node's memory) and the tier's byte limit, against the
estimates of that node's ranks. A checkpoint that does not fit is said so in one line and saved to
``save_dir`` instead; never half-written to memory, never a cause of an out-of-memory kill.

Every ``persist_every``-th memory checkpoint (or one saved with ``persist=True``) is then copied to
``save_dir`` in the background once its memory copy is published (:mod:`.persistence`); a failed
persistence is logged, the memory copy stays.

A process that saved to the tier and ends without an uncaught exception leaves no memory checkpoint
behind (unless ``keep_at_exit``): at exit the node leaders join the saves, persist the newest memory
checkpoint of the job's run where ``save_dir`` holds an older one, and remove the job's memory folder,
while its record is still the job's own. A crash leaves it for the restart; ``pyckpt clean --memory
JOB`` removes one by hand.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
from typing import Optional

from ...errors import SaveError
from ...execution.distributed import TorchRanks, describe_failure
from ...execution.leftovers import remove_path
from ..tiers import free_slot
from ..tiers import node_manifest as nm
from ..tiers.folder_names import RESTORE
from ..tiers.job_identity import agreed_run, any_foreign, bound, new_run, owns, read_record
from ..tiers.links import nodes
from ..tiers.memory_root import budget, fits
from ..tiers.nodes import this_node
from ..tiers.policy import MemoryTier
from .arrival import Arrival, _default_store
from .background import AsyncSave
from .collective_save import save_collectively
from .in_flight import begin_persistence, join_all
from .node_share import NodeShare
from .persistence import persist_checkpoint
from .request import SaveRequest, check_tag
from .space import estimate_rank_bytes

log = logging.getLogger("pyckpt")

# how long leaders wait for one another during a persistence at exit (the job is ending)
EXIT_TIMEOUT = 120.0


def tier_view(tier) -> dict:
    """What a rank knows of ``tier`` before a save or its preparation, for the ranks' one gather: its node,
    the job folder's record, the folder, or the failure that kept it from learning them (``error``)."""
    mine = {"error": None, "node": None, "record": None, "folder": None}
    try:
        mine["node"] = this_node()
        mine["record"] = read_record(tier.root_path, tier.job_name)
        mine["folder"] = tier.folder()
    except Exception as exc:
        mine["error"] = describe_failure(exc)
    return mine


def view_problem(pre: list, identity, tier) -> Optional[str]:
    """Why the gathered :func:`tier_view` of every rank keeps ``tier`` from this save (a line), or None:
    a rank's failure, or a job folder another job's record holds. The root is opened only where no rank
    failed (a root that fails to open is one of those failures)."""
    errors = "; ".join(f"rank {r}: {p['error']}" for r, p in enumerate(pre) if p["error"])
    return errors or any_foreign([p["record"] for p in pre], identity, tier.root_path)


def save_to_memory(engine, request: SaveRequest, memory: MemoryTier, persist: bool):
    """The collective save into ``memory``'s node folders (its destination a :class:`~.node_share.NodeShare`),
    or into ``request.save_dir`` when it does not fit; then the persistence. Returns what the save returns."""
    group = TorchRanks()
    save_dir = request.save_dir
    memory, identity = bound(memory, save_dir)
    if request.universal or request.export:
        raise ValueError("universal= and export= convert a durable checkpoint: a memory checkpoint is converted "
                         "once persisted (convert save_dir/<tag> with `pyckpt convert` / `pyckpt export`)")
    tag = check_tag(str(request.tag if request.tag is not None else f"global_step{engine.global_steps}"))
    # The previous asynchronous save is joined before this one's arrival, as every save does: its
    # background thread waits on the same store client, and a blocking wait there from this thread
    # would deadlock the two (each holds the client while it waits for the other rank's key).
    # One persistence at a time, and never of a checkpoint this save's pruning could remove: the
    # previous one is joined next (the leaders hold it; a failure was logged there).
    join_all(engine)
    free_slot.settle()  # the slot a previous save's leader was making: its pages count as reusable below
    # The same arrival as every save: ranks that disagree on memory= meet here and in the one gather
    # below, which the others take for their preflight; both sides then see the difference and stop.
    arrival = Arrival("save", group.rank, group.size)
    arrival.wait(request.arrival_timeout, "pyckpt.deepspeed.save_checkpoint")
    mine = dict(tier_view(memory), memory=True, need=0, budget=None, run=new_run() if group.rank == 0 else None)
    if mine["error"] is None:
        try:
            mine["need"] = estimate_rank_bytes(engine)
            mine["budget"] = budget(memory.root_path, memory.job_name, memory.limit_bytes)
            mine["reusable"] = free_slot.size(mine["folder"])  # the free slot's pages: the save writes over them
        except Exception as exc:
            mine["error"] = describe_failure(exc)
    pre = group.all_gather(mine)
    arrival.done()
    if any(not (isinstance(p, dict) and p.get("memory")) for p in pre):
        raise SaveError("the ranks called save_checkpoint with different memory= settings (some with a memory "
                        f"tier, some without); checkpoint {tag} was not saved, nothing was written", published=False)
    problem = view_problem(pre, identity, memory) or _fits_by_node(pre)
    if problem:
        if group.rank == 0:
            log.warning("pyckpt: checkpoint %s goes to %s, not to memory: %s", tag, save_dir, problem)
        return save_collectively(engine, dataclasses.replace(request, tag=tag))
    folder = pre[group.rank]["folder"]
    # the job's run: the one its folder records (on the first node that has a record), else drawn now
    run = agreed_run([p["record"] for p in pre], identity) or pre[0]["run"]
    if group.rank == 0 and identity.derived and pre[0]["record"] is None:
        log.info("pyckpt: this job names no job id of its own ($PYCKPT_JOB_ID, torchrun's --rdzv-id): its memory "
                 "checkpoints go to %s, named after its save dir %s", os.path.dirname(folder), identity.save_dir)
    model = nm.model_digest(engine)
    links = nodes(group, memory.folder, memory.keep, memory.job_name)
    links.model = model
    links.owner = lambda m: owns(m, identity, run)
    share = NodeShare(links, identity, run, model, memory.keep, memory.root_path, group.size, memory.limit_bytes)
    if links.leader:
        _leave_at_exit(memory, links, folder, save_dir, request.fsync, identity, run)
        restore = os.path.join(folder, RESTORE)
        if os.path.lexists(restore):  # a recovery's assembly (links to the files): every rank has loaded since
            remove_path(restore)
        _retire_before(folder, share, tag, memory.keep)
    count = getattr(engine, "_pyckpt_memory_saves", 0) + 1
    engine._pyckpt_memory_saves = count
    durable_keep = request.keep_last
    result = save_collectively(engine, dataclasses.replace(request, save_dir=folder, tag=tag, keep_last=None), share)
    if links.leader and (persist or (memory.persist_every and count % memory.persist_every == 0)):
        store = _default_store()
        timeout = request.agree_timeout
        begin_persistence(engine, AsyncSave(f"persisting checkpoint {tag} to {save_dir}", "warn", 0).start(
            lambda handle: persist_checkpoint(result, links, folder, save_dir, tag, durable_keep, request.fsync,
                                              store, timeout, share.save_id)))
    return result


def _retire_before(folder: str, share: NodeShare, tag: str, keep: int) -> None:
    """Before a save (each node's leader): the run's oldest shares beyond what the node may hold with
    the new one (``max(keep, 2)``) leave the tier now, the first as the free slot the save writes
    over; never the newest complete one. A failure here only costs the reuse."""
    try:
        free_slot.retire_before_save(folder, share.mine, share.model, keep, protect=tag)
    except Exception as exc:
        log.warning("pyckpt: the memory tier could not free a slot in %s: %s", folder, describe_failure(exc))


def _fits_by_node(pre: list) -> Optional[str]:
    by_node: dict = {}
    for p in pre:
        by_node.setdefault(p["node"], []).append(p)
    for node in sorted(by_node):
        ranks = by_node[node]
        problem = fits(max(0, sum(p["need"] for p in ranks) - ranks[0].get("reusable", 0)), ranks[0]["budget"])
        if problem:
            return problem if len(by_node) == 1 else f"node {node}: {problem}"
    return None


# What the exit handler needs, by memory folder: (tier, links, save_dir, fsync, store, identity, run) of the
# latest save there.
_AT_EXIT: dict = {}
_UNUSED: set = set()  # node folders holding a slot made before a first save (discard_unused_at_exit)
_CRASHED = []
_WATCHING = []


def after_resume(memory: MemoryTier, links, folder: str, identity, run: str) -> None:
    """A job that resumed from memory ends as one that saved there does: at a normal end the newest
    memory checkpoint of its run is persisted where its save dir holds an older one, then the job's
    memory folder is removed (each node's leader; :mod:`..tiers.resume_events`)."""
    if links.leader and folder not in _AT_EXIT:
        _leave_at_exit(memory, links, folder, identity.save_dir, False, identity, run)


def _leave_at_exit(memory: MemoryTier, links, folder: str, save_dir: str, fsync: bool, identity, run: str) -> None:
    _watch_exit()
    _AT_EXIT[folder] = (memory, links, save_dir, fsync, _default_store(), identity, run)


def discard_unused_at_exit(folder: str) -> None:
    """A node folder where a free slot was made before the job's first save (each node's leader): a process
    that ends normally without saving there (nor resuming from it) removes that slot, and the node and
    job folders where nothing else is in them. A crash leaves it, as it leaves the tier, for the restart."""
    _watch_exit()
    _UNUSED.add(folder)


def _watch_exit() -> None:
    if _WATCHING:
        return
    _WATCHING.append(True)
    previous = sys.excepthook

    def excepthook(kind, value, tb):  # an uncaught exception: a crash, whose restart needs the tier
        _CRASHED.append(kind)
        previous(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_leave)


def _leave() -> None:
    """At a normal exit (each node's leader): join, persist the newest memory checkpoint of the job's
    run where save_dir's is older (the leaders together), remove the job's memory folder while its
    record is still the job's run's. Anything that fails leaves the folder, saying why."""
    if _CRASHED:
        return
    _discard_unused()
    from .background import wait_for_saves
    from ..tiers.links import forget_all
    from ..tiers.memory_root import remove_job
    from ..tiers.resume_choice import durable_step

    for folder, (memory, links, save_dir, fsync, store, identity, run) in list(_AT_EXIT.items()):
        if memory.keep_at_exit:
            continue
        try:
            wait_for_saves()
            free_slot.settle()
            if links.sender is not None:
                links.sender.flush(EXIT_TIMEOUT)
            record = read_record(memory.root_path, memory.job_name)
            if record is None or (record.run, record.save_dir) != (run, identity.save_dir):
                raise RuntimeError(f"its record {'is gone' if record is None else 'names another run or save dir'}: "
                                   f"the folder is not this run's to persist from or remove")
            newest = max(((m.step, m.save, path) for path, m in nm.shares(folder) if owns(m, identity, run)),
                         default=None)
            durable = durable_step(save_dir)
            if newest is not None and (durable is None or durable < newest[0]):
                ok, message = persist_checkpoint(True, links, folder, save_dir, os.path.basename(newest[2]), None,
                                                 fsync, store, EXIT_TIMEOUT, save_id=newest[1])
                if not ok:
                    raise RuntimeError(message)
            remove_job(memory.root_path, memory.job_name)
            log.info("pyckpt: removed the memory tier of job %s (its newest checkpoint is in %s)", memory.job_name,
                     save_dir)
        except Exception as exc:
            log.warning("pyckpt: the memory tier of job %s stays at %s: %s", memory.job_name, folder,
                        describe_failure(exc))
    _AT_EXIT.clear()
    forget_all()


def _discard_unused() -> None:
    """The slots made before a first save that never came: removed, with the folders they leave empty."""
    for folder in sorted(_UNUSED - set(_AT_EXIT)):
        try:
            free_slot.settle()
            free_slot.discard(folder)
            free_slot.discard_next(folder)
            for empty in (folder, os.path.dirname(folder)):
                os.rmdir(empty)  # only where nothing else is left (a record, another node's folder: kept)
        except OSError:
            pass
        except Exception as exc:
            log.warning("pyckpt: the free slot made in %s stays: %s", folder, describe_failure(exc))
    _UNUSED.clear()
