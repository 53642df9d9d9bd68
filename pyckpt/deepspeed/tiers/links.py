"""The job's nodes, reachable from one another: who leads each node, where its replica receiver
listens, the job's token, and the ring's sender (:mod:`.ring_sender`) that keeps a peer's copy of this
node's newest memory checkpoint.

One :class:`Nodes` per process and job, made collectively (every rank calls :func:`nodes`): the ranks
gather which node each runs on (torchrun's numbering, :func:`~.nodes.this_node`), each node's
lowest rank leads it, and where there is more than one node, rank 0 draws the job's token (32 random
bytes, sent to the other ranks over the job's own process group, never over a replica connection)
and each leader starts a :class:`~.replica_receiver.ReplicaReceiver` on its node's memory folder, whose
address every rank learns. Nothing here outlives the process: a restarted worker makes them again,
and the files the last one published are what carries over.

Placement (a ring, :func:`~.nodes.replica_target`) and the layout of ranks on nodes live in
:mod:`.nodes`; the receivers' retention of the replicas they keep is here, with their start.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ...execution.distributed import describe_failure
from . import free_slot
from .node_manifest import prune
from .nodes import layout, this_node
from .replica_receiver import ReplicaReceiver
from .ring_sender import Sender

ENV_HOST = "PYCKPT_REPLICA_HOST"


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
