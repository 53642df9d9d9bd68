"""The job's nodes, reachable from one another: who leads each node, where its replica receiver
listens, the job's token, and the background sender that keeps a peer's copy of this node's newest
memory checkpoint.

One :class:`Nodes` per process and job, made collectively (every rank calls :func:`nodes`): the ranks
gather which node each runs on (torchrun's numbering, :func:`~.memory_root.this_node`), each node's
lowest rank leads it, and where there is more than one node, rank 0 draws the job's token (32 random
bytes, sent to the other ranks over the job's own process group, never over a replica connection)
and each leader starts a :class:`~.replica_receiver.ReplicaReceiver` on its node's memory folder, whose
address every rank learns. Nothing here outlives the process: a restarted worker makes them again,
and the files the last one published are what carries over.

Placement: node ``n`` keeps its replica on node ``(n + 1) % N`` (a ring), so each node holds its own
files and one neighbour's, and losing any one node loses no checkpoint. Sending is
newest-wins: the sender thread always takes the newest published checkpoint not yet sent; one saved
while an older one is still on the way waits for that one, and an intermediate one is skipped rather
than queued (training never waits for replication).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ...execution.distributed import describe_failure
from .memory_root import this_node
from . import free_slot
from .node_manifest import prune
from .replica_receiver import ReplicaReceiver
from .replica_sender import send_folder

log = logging.getLogger("pyckpt")

ENV_HOST = "PYCKPT_REPLICA_HOST"


def replica_target(node: int, nodes: int) -> Optional[int]:
    """The node that keeps ``node``'s replica: the next one in a ring; None on one node."""
    return None if nodes < 2 else (node + 1) % nodes


def _listen_host() -> Tuple[str, str]:
    """(bind address, address the peers connect to). ``$PYCKPT_REPLICA_HOST`` when set; else the
    address this host reaches ``$MASTER_ADDR`` from (the interface the job's own traffic takes),
    loopback when the job runs on this host alone."""
    explicit = os.environ.get(ENV_HOST)
    if explicit:
        return explicit, explicit
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        infos = socket.getaddrinfo(master, int(os.environ.get("MASTER_PORT", "29500")), type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)  # no packet is sent: this only picks the route
            host = probe.getsockname()[0]
    except OSError:
        host = "127.0.0.1"
    return host, host


@dataclass
class Nodes:
    """The job's nodes as this process sees them (see the module's docstring)."""

    rank: int
    node: int
    count: int  # number of nodes
    leaders: List[int]  # leaders[n]: the lowest rank of node n
    ranks: List[Tuple[int, int]]  # ranks[n]: (first rank, rank count) of node n
    token: Optional[bytes] = None
    addresses: List[Optional[Tuple[str, int]]] = field(default_factory=list)
    receiver: Optional[ReplicaReceiver] = None
    sender: Optional["Sender"] = None
    key: tuple = ()
    model: Optional[str] = None  # the model digest of the latest save (the replicas' retention)
    # whether a share (its manifest) is one of the job's run's, as of the latest save (the same retention)
    owner: Optional[Callable] = None

    @property
    def leader(self) -> bool:
        return self.leaders[self.node] == self.rank

    def node_of(self, rank: int) -> int:
        for n, (first, count) in enumerate(self.ranks):
            if first <= rank < first + count:
                return n
        raise ValueError(f"rank {rank} is on none of the {self.count} nodes")

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()


def layout(nodes_of_ranks: List[int]) -> Tuple[List[int], List[Tuple[int, int]]]:
    """Leaders and rank ranges from every rank's node, checked: nodes numbered 0..N-1, each holding a
    contiguous block of ranks (as torchrun places them). A ValueError says what is wrong."""
    count = max(nodes_of_ranks) + 1
    ranges: Dict[int, List[int]] = {}
    for rank, node in enumerate(nodes_of_ranks):
        ranges.setdefault(node, []).append(rank)
    if sorted(ranges) != list(range(count)):
        raise ValueError(f"the ranks' node numbers ({sorted(ranges)}) are not 0 to {count - 1}: set torchrun's "
                         f"GROUP_RANK / LOCAL_WORLD_SIZE consistently on every node")
    leaders, spans = [], []
    for n in range(count):
        ranks = ranges[n]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"node {n} holds ranks {ranks}, not one contiguous block; the memory tier expects "
                             f"torchrun's placement (node = rank // LOCAL_WORLD_SIZE)")
        leaders.append(ranks[0])
        spans.append((ranks[0], len(ranks)))
    return leaders, spans


_NODES: Dict[tuple, Nodes] = {}


def nodes(group, node_folder, keep: int, job: str, replicate: bool = True) -> Nodes:
    """The job's :class:`Nodes`, made on the first call (collective: every rank calls it, in the same
    order) and reused while the process group and the job stay the same. ``node_folder``: a callable
    returning this node's memory folder (only leaders call it). With ``replicate`` and several nodes,
    the leaders' receivers listen and every rank knows their addresses."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD) if dist.is_initialized() else None, group.size, job, replicate)
    found = _NODES.get(key)
    if found is not None:
        return found
    mine = this_node()
    gathered = group.all_gather(mine)
    leaders, spans = layout(gathered)
    out = Nodes(rank=group.rank, node=mine, count=len(leaders), leaders=leaders, ranks=spans, key=key)
    if replicate and out.count > 1:
        token = group.broadcast(os.urandom(32) if group.rank == 0 else None)
        address, error = None, None
        if out.leader:
            try:
                bind, shown = _listen_host()
                folder = node_folder()
                out.receiver = ReplicaReceiver(folder, token, host=bind, port=0,
                                               on_published=lambda replica_dir: _prune_replicas(replica_dir, keep, out),
                                               before_receive=lambda replica_dir: _retire_replicas(replica_dir, keep,
                                                                                                    out)).start()
                address = (shown, out.receiver.address[1])
            except Exception as exc:
                error = describe_failure(exc)
        everyone = group.all_gather((address, error))
        failed = [(r, e) for r, (_, e) in enumerate(everyone) if e]
        if failed:
            out.close()
            raise RuntimeError("the memory tier's replica receivers did not start: " +
                               "; ".join(f"rank {r}: {e}" for r, e in failed))
        out.token = token
        out.addresses = [everyone[leader][0] for leader in leaders]
        if out.leader:
            out.sender = Sender(out)
    _NODES[key] = out
    return out


def replicated(timeout: Optional[float] = None) -> bool:
    """Whether this node's newest memory checkpoint offered by this process has reached its peer,
    verified: every sender of this process (a node's leader has one per job on several nodes) flushed
    within one deadline of ``timeout`` seconds (None: no limit). True at once where there is none
    (a rank that leads no node, a job on one node, no memory save yet)."""
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    verdict = True
    for found in list(_NODES.values()):
        if found.sender is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            verdict = found.sender.flush(left) and verdict
    return verdict


def forget_all() -> None:
    """Closes every receiver and sender of this process (at exit, and in tests)."""
    for found in list(_NODES.values()):
        found.close()
    _NODES.clear()


def _prune_replicas(replica_dir: str, keep: int, links: Nodes) -> None:
    # nothing is removed before this process's first save has said whose shares are the job's
    if links.model is not None and links.owner is not None:
        free_slot.discard(replica_dir)  # what the replica just received did not take from it
        prune(replica_dir, keep, links.owner, links.model, remove=lambda path: free_slot.retire(replica_dir, path))


def _retire_replicas(replica_dir: str, keep: int, links: Nodes) -> None:
    """Before a replica is received: the oldest replicas beyond what the folder may hold with it
    (``max(keep, 2)``, as a node's own folder) leave, the first as the free slot it is written over."""
    if links.model is not None and links.owner is not None:
        free_slot.retire_before_save(replica_dir, links.owner, links.model, keep)


class Sender:
    """A leader's background replication of its node's newest memory checkpoint to the ring's next
    node; newest-wins (module docstring). :meth:`offer` never blocks; :meth:`flush` waits for the
    newest offered one to be sent or to fail (``pyckpt.deepspeed.wait_for_replication``, the end of a
    job)."""

    def __init__(self, links: Nodes):
        self.links = links
        self.target = replica_target(links.node, links.count)
        self._cond = threading.Condition()
        self._pending: Optional[Tuple[str, str]] = None
        self._busy = False
        self._closed = False
        self.sent: List[Tuple[str, float]] = []  # (tag, seconds) of each replica the peer verified
        self.failed: List[Tuple[str, str]] = []  # (tag, why)
        self.last: Optional[Tuple[bool, str]] = None  # (verified, tag) of the last one tried
        self._thread = threading.Thread(target=self._run, name="pyckpt-replicate", daemon=True)
        self._thread.start()

    def offer(self, tag_folder: str, tag: str) -> None:
        with self._cond:
            self._pending = (tag_folder, tag)
            self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (None: no limit) until nothing is pending or in flight. True
        when the newest checkpoint offered was verified by the peer (or none was offered); False when
        it failed, or is still pending or on its way at the timeout (a replica verified earlier does
        not stand for a newer one), or the sender was closed before sending it."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (self._pending is None and not self._busy), timeout)
            if self._pending is not None or self._busy:
                return False
            return self.last is None or self.last[0]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending is not None)
                if self._closed:
                    return
                folder, tag = self._pending
                self._pending = None
                self._busy = True
            try:
                sent = send_folder(folder, self.links.node, tag, self.links.addresses[self.target], self.links.token)
                with self._cond:
                    self.sent.append((tag, sent.seconds))
                    self.last = (True, tag)
            except Exception as exc:  # the checkpoint stays in this node's memory; the next one retries
                why = describe_failure(exc)
                with self._cond:
                    first = not self.failed or self.failed[-1][1] != why
                    self.failed.append((tag, why))
                    self.last = (False, tag)
                if first:
                    log.warning("pyckpt: replicating %s to node %d failed: %s", tag, self.target, why)
            finally:
                with self._cond:
                    self._busy = False
                    del self.sent[:-100], self.failed[:-100]
                    self._cond.notify_all()
