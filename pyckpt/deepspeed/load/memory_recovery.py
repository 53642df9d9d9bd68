"""A resume under ``enable(memory=...)``: the newest checkpoint across every node's memory tier and
``save_dir``, with the files each node lacks sent to it, before DeepSpeed's load reads anything.

Every rank calls :func:`recover` from ``load_checkpoint`` (a collective call). Each node's leader
reports its job folder's record (:mod:`..tiers.job_identity`: the run and save dir its checkpoints
belong to) and the shares of that save dir its memory root holds (:func:`..tiers.resume_choice.inventory`),
and every rank what ``save_dir/latest`` names; from that one gather every rank computes the same run
and the same choice (:func:`..tiers.resume_choice.recoverable`). Where memory wins, the leaders holding a
share that another node lacks send it there through the replica protocol (verified there before it
counts), then each leader links the shares into ``<node folder>/restore/<tag>`` (hard links: no second
copy of the bytes; ``restore`` checked as the root is, never followed) with a ``latest`` beside it,
reads every linked file once for its CRC-32 against the one recorded at the save (or takes the CRC-32
read while the engine was built: :mod:`..tiers.prechecked`), and every rank loads
from its own node's folder through the direct resume (each rank's byte ranges of the shards copied
into its partitions and moments), at the topology it was saved at (:func:`.hooks._memory_load`:
DeepSpeed's own load where that cannot serve it, said in one line) as at another. A checkpoint that
cannot be put together (a share that cannot be sent, a file whose bytes changed in memory) is passed over on every rank for the next newest, or ``save_dir``'s, with one
line saying why; any other failure stops every rank before any state changes. The assembly is removed
by the next memory save.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
from typing import List, Optional, Tuple

from ...errors import MemoryRootError, RankLoadError, printable
from ...execution.distributed import describe_failure
from ...execution.publisher import Publisher
from ..tiers import node_manifest as nm
from ..tiers import prechecked, resume_events
from ..tiers.folder_names import RESTORE, node_folder
from ..tiers.job_identity import agreed_run, bound, foreign, read_record
from ..tiers.links import nodes
from ..tiers.memory_root import default_root, level
from ..tiers.nodes import this_node
from ..tiers.resume_choice import RecoveryPlan, durable, inventory, local_share, recoverable
from ..tiers.replica_sender import send_folder

log = logging.getLogger("pyckpt")

# What the last recovery on this rank did, for tests and benchmarks: seconds, step, shares sent.
last_recovery: dict = {}


class Alone:
    """The ranks of a job of one process, as a recovery's gathers take them."""

    rank, size = 0, 1

    def all_gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj, src: int = 0):
        return obj


def raise_failures(results: list, what: str) -> None:
    """RankLoadError naming every rank whose entry of ``results`` (one per rank) is a failure, if any is."""
    bad = {r: e for r, e in enumerate(results) if e}
    if bad:
        raise RankLoadError(what, bad, len(results))


def recover(tier, load_dir: str, ranks=None, save_dir: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """``(folder, tag)`` to load from this node's memory, or None where ``load_dir``'s own checkpoint
    is the newest (or no tier holds one), or where ``load_dir`` lies in this node's ``restore/``
    folder on every rank (an assembly made since the last memory save: it is loaded as it is). Only
    the memory checkpoints of the job saving to ``save_dir`` (default: ``load_dir``) count: those of its
    own job folder (:func:`..tiers.job_identity.identify`), its recorded run and that save dir."""
    import time

    t0 = time.perf_counter()
    last_recovery.clear()
    group = ranks or Alone()
    tier, identity = bound(tier, load_dir if save_dir is None else save_dir)
    links = nodes(group, tier.folder, tier.keep, tier.job_name)
    mine = {"node": links.node, "held": None, "durable": None, "error": None, "assembled": False, "record": None,
            "refused": []}
    try:
        mine["assembled"] = _assembled(tier, load_dir)
        found = durable(load_dir)
        mine["durable"] = None if found is None else (found.tag, found.step)
        if links.leader and not mine["assembled"]:
            try:
                mine["record"] = read_record(tier.root_path, tier.job_name)
            except MemoryRootError as exc:  # whose the folder is, is unknown: none of it is taken
                mine["refused"].append(str(exc))
            else:
                mine["held"] = inventory(tier.root_path, identity, refused=mine["refused"])
    except Exception as exc:
        mine["error"] = describe_failure(exc)
    pre = group.all_gather(mine)
    raise_failures([p["error"] for p in pre], "looking for the newest checkpoint in the memory tier")
    assembled = {p["assembled"] for p in pre}
    if assembled == {True}:  # put together by a recovery just now (resume_point): read as it is
        return None
    if len(assembled) > 1:
        raise RankLoadError("loading the memory checkpoint a recovery put together",
                            {r: "its folder is not in its node's restore/ folder, other ranks' are"
                             for r, p in enumerate(pre) if not p["assembled"]}, len(pre))
    if len({p["durable"] for p in pre}) > 1:
        raise RankLoadError(f"agreeing on the checkpoint in {printable(load_dir)}",
                            {r: f"it sees {p['durable']!r}, rank 0 {pre[0]['durable']!r}" for r, p in enumerate(pre)
                             if p["durable"] != pre[0]["durable"]}, len(pre))
    on_disk = pre[0]["durable"]
    # the run every node's record names for this save dir (the first, in node order); another save dir's
    # record (two jobs given one id) makes nothing of that folder this job's
    records = [p["record"] for p in pre if p["held"] is not None]
    run = agreed_run(records, identity)
    # a folder inside the job's save dir (the Trainer's checkpoint-N) is that job's own, not another job
    notes = list(dict.fromkeys([foreign(r, identity, tier.root_path) for r in records
                                if foreign(r, identity, tier.root_path)
                                and not identity.save_dir.startswith(r.save_dir.rstrip("/") + "/")]
                               + [line for p in pre for line in p["refused"]]))
    held = {p["node"]: [h for h in p["held"] if h.run == run] for p in pre if p["held"] is not None}
    folder = None  # this node's folder: made only once there is something to put together in it
    passed: List[tuple] = []  # (key, why) of the checkpoints that could not be put together
    while True:
        plan = recoverable(held, exclude={line[0] for line in passed})
        if plan is None or (on_disk is not None and on_disk[1] > plan.step):
            if (passed or notes) and group.rank == 0:
                log.warning("pyckpt: resuming from %s, not from memory: %s", printable(load_dir),
                            "; ".join([why for _, why in passed] + notes))
            return None
        fetches = plan.fetches(links.count)
        own = held.get(links.node, [])
        # Each leader sends what it holds that others lack, then (once all sends are done: one
        # gather) puts the checkpoint together; a failure anywhere passes this checkpoint over on
        # every rank for the next newest one (or save_dir's), as a checkpoint no live node holds whole.
        sent = group.all_gather(_send(plan, fetches, links, own) if links.leader and fetches else None)
        bad = {r: e for r, e in enumerate(sent) if e}
        if not bad:
            folder = folder or tier.folder()
            built = group.all_gather(_assemble(plan, tier, folder, identity, run) if links.leader else None)
            bad = {r: e for r, e in enumerate(built) if e}
        if not bad:
            break
        passed.append((plan.key, f"step {plan.step} ({plan.tag}) could not be put together ("
                       + "; ".join(f"rank {r}: {e}" for r, e in sorted(bad.items())) + ")"))
    if group.rank == 0:
        where = printable(load_dir)
        why = (f"{where} holds none" if on_disk is None else
               f"the same step as in {where}, read from memory" if on_disk[1] == plan.step else
               f"newer than step {on_disk[1]} in {where}")
        size = "" if plan.world_size == group.size else f", world size {plan.world_size} -> {group.size}"
        passed_over = "".join(f"; {why}, passed over" for _, why in passed) + "".join(f"; {n}" for n in notes)
        log.warning("pyckpt: resuming step %d from memory (%s)%s, %s%s", plan.step, plan.story(links.count), size, why,
                    passed_over)
    last_recovery.update(seconds=time.perf_counter() - t0, step=plan.step, sent=len(fetches))
    if links.leader:  # at a normal end the job persists what it resumed, as a job that saved does
        resume_events.resumed(tier, links, folder, identity, run)
    return os.path.join(folder, RESTORE), plan.tag


def _assembled(tier, load_dir: str) -> bool:
    """Whether ``load_dir`` lies in this node's ``restore/`` folder of a job under the tier's root: an
    assembly of the newest memory checkpoint made since the last memory save
    (:func:`pyckpt.deepspeed.resume_point` makes it before the Hugging Face Trainer's load, in the folder
    of the job saving to the Trainer's output_dir), which a second recovery would only make again. Only
    paths are compared: nothing is created (``tier.folder()`` would make the node's folder on every
    load)."""
    root = os.path.realpath(os.path.abspath(tier.root or default_root()))
    parts = os.path.relpath(os.path.realpath(load_dir), root).split(os.sep)
    return len(parts) >= 3 and parts[0] not in ("", ".", "..") and parts[1:3] == [node_folder(this_node()), RESTORE]


def _send(plan: RecoveryPlan, fetches: List[Tuple[int, int, int]], links, own) -> Optional[str]:
    """This leader's part of the fetches: the shares it holds that other nodes lack, sent at once."""
    mine = [(origin, to) for holder, origin, to in fetches if holder == links.node]
    if not mine:
        return None

    def one(origin: int, to: int) -> None:
        path = local_share(own, plan.key, origin)
        if path is None:
            raise RuntimeError(f"node {links.node} no longer holds node {origin}'s share of {plan.tag}")
        send_folder(path, origin, plan.tag, links.addresses[to], links.token)

    try:
        with concurrent.futures.ThreadPoolExecutor(min(8, len(mine)), thread_name_prefix="pyckpt-fetch") as pool:
            for f in [pool.submit(one, o, t) for o, t in mine]:
                f.result()
    except Exception as exc:
        return describe_failure(exc)
    return None


def _assemble(plan: RecoveryPlan, tier, folder: str, identity, run: str) -> Optional[str]:
    """This node's leader: every share of the save linked into ``restore/<tag>``, each linked file's
    bytes read once for its CRC-32 against the manifest's, then ``latest`` naming it. ``restore`` is made
    or opened as the root is (a link there, another user's folder or one others can write is refused:
    nothing is written through it)."""
    try:
        held = inventory(tier.root_path, identity, run)
        restore = level(folder, RESTORE, "the recovery's folder")
        with Publisher(os.path.join(restore, plan.tag), overwrite=True, pointer="latest") as out:
            os.chmod(out.staging, 0o700)  # as private as the shares it links
            taken = set()
            linked = []  # (target, size, crc, origin, name)
            for origin in range(plan.nodes):
                source = local_share(held, plan.key, origin)
                manifest = nm.read(source) if source else None
                if manifest is None or manifest.key() != plan.key:
                    return f"node {origin}'s share of {plan.tag} is not whole on this node"
                for name, size, crc in manifest.files:
                    if name in taken:
                        return f"{name!r} is in two nodes' shares of {plan.tag}"
                    taken.add(name)
                    target = os.path.join(out.staging, name)
                    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
                    link_or_copy(os.path.join(source, name), target)
                    linked.append((target, size, crc, origin, name))
            # the files DeepSpeed will read, each read once: a byte that changed in memory since the
            # save (the CRC-32 recorded then) passes this checkpoint over
            found = prechecked.crcs([(target, size) for target, size, _, _, _ in linked])
            for (target, size, want, origin, name), (got, _) in zip(linked, found):
                if got != want:
                    return (f"{name} of node {origin}'s share of {plan.tag}: the CRC-32 of its {size} bytes is "
                            f"{got:08x}, the save recorded {want:08x} (its memory copy is damaged)")
            out.publish()
    except Exception as exc:
        return describe_failure(exc)
    return None


def link_or_copy(source: str, target: str) -> None:
    """``target`` a hard link to ``source`` (never following a link), or a copy where no link can be made."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:  # another filesystem (a root spread over mounts): a copy, then
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        import shutil

        shutil.copyfile(source, target, follow_symlinks=False)
