"""Which checkpoint a resume reads: the newest one recoverable from the memory tiers of the live nodes,
or ``save_dir``'s when that is newer, and how the nodes get the files they lack.

A memory checkpoint is a set of node shares (:mod:`.node_manifest`), one per node that saved it, each
held by its own node, by the node its replica went to, or by both. Only the shares of the job's own run
and save dir count (:mod:`.job_identity`), and only where the step a share claims is the step its
model-state file records (the one share holding DeepSpeed's model-state file of model-parallel rank 0
vouches for the save's step, as that file does for a checkpoint in ``save_dir``). A checkpoint is
*recoverable* when every share of one save (the same save id, so never two saves of one step) is whole
on at least one live node, its step vouched for. The newest recoverable save by step wins; at equal steps memory wins over ``save_dir`` (it is
the faster read, and the files are the same). Then every live node needs every share on its own
memory: a share it lacks is sent to it by a node that holds it (the holders taken in turn), through
the replica protocol, verified before it counts.

Everything here is a pure function of what the nodes report, so every rank computes the same
choice from the same gathered inventory; the caller agrees on it before any state changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .checkpoint_record import FIRST_MODEL_STATES, read_checkpoint
from .job_identity import owns
from .memory_root import node_folders
from .node_manifest import replica_folders, shares


@dataclass(frozen=True)
class Choice:
    tier: str  # "memory" or "durable"
    load_dir: str  # the folder holding `latest` and the tag folder
    tag: str
    step: int


def _pointed(load_dir: str, tier: str) -> Optional[Choice]:
    from ...zero.discovery import follow_pointer

    if not os.path.isfile(os.path.join(load_dir, "latest")) or os.path.islink(os.path.join(load_dir, "latest")):
        return None
    try:
        folder = follow_pointer(load_dir, "latest")
    except Exception:  # a pointer that names nothing readable: not a checkpoint of this tier
        return None
    record = read_checkpoint(folder)
    if record is None:
        return None
    return Choice(tier, load_dir, os.path.basename(folder), record.step)


def durable(save_dir: str) -> Optional[Choice]:
    """The checkpoint ``save_dir/latest`` names, where it is a readable DeepSpeed checkpoint."""
    return _pointed(os.fspath(save_dir), "durable")


def durable_step(save_dir: str) -> Optional[int]:
    found = durable(save_dir)
    return None if found is None else found.step


@dataclass(frozen=True)
class Holding:
    """One whole node share a node holds in its memory root."""

    key: tuple  # the manifest's key(): the save it belongs to
    origin: int  # the node whose ranks wrote it
    step: int
    tag: str
    nodes: int  # how many nodes saved
    world_size: int
    path: str  # its tag folder on the holder
    vouched: bool = False  # it holds the model-state file of mp rank 0, which records its step
    run: str = ""  # the job's run that saved it


def inventory(root: str, identity, run: Optional[str] = None, refused: Optional[List[str]] = None) -> List[Holding]:
    """Every whole share of ``identity``'s checkpoints (a :class:`~.job_identity.Identity`: its job folder
    and save dir), of ``run``'s where one is given, under ``root``: in each of the job's node folders
    (this node's, and those left by an earlier run in which this host was another node), its own shares
    and the replicas it keeps. A share that holds the model-state file of mp rank 0 counts only where
    that file records the step the share claims; ``refused`` gets one line for each that does not."""
    out: List[Holding] = []
    for _, node_folder in node_folders(root, identity.job):
        for folder in [node_folder] + replica_folders(node_folder):
            for path, m in shares(folder):
                if not owns(m, identity, run):
                    continue
                names = {name for name, _, _ in m.files}
                vouched = any(name in names for name in FIRST_MODEL_STATES)
                if vouched:
                    record = read_checkpoint(path)
                    if record is None or record.step != m.step:
                        if refused is not None:
                            says = "is not readable" if record is None else f"records step {record.step}"
                            refused.append(f"{path} claims step {m.step}, its model-state file {says}: not recovered")
                        continue
                out.append(Holding(m.key(), m.node, m.step, m.tag, m.nodes, m.world_size, path, vouched, m.run))
    return out


@dataclass(frozen=True)
class RecoveryPlan:
    """The memory checkpoint to recover and where each share of it is."""

    key: tuple
    step: int
    tag: str
    nodes: int  # nodes that saved it
    world_size: int  # ranks that saved it
    holders: Dict[int, Tuple[int, ...]]  # origin node -> live nodes holding its share

    def fetches(self, live: int) -> List[Tuple[int, int, int]]:
        """(holder, origin, to) for each share a live node lacks, taking each share's holders in turn
        so no one node sends everything."""
        out = []
        for to in range(live):
            for origin in range(self.nodes):
                have = self.holders[origin]
                if to not in have:
                    out.append((have[(to + origin) % len(have)], origin, to))
        return out

    def story(self, live: int) -> str:
        """Where the shares come from, for the log line."""
        moved = [f"node {o}'s files from the copy on node {h[0]}" for o, h in sorted(self.holders.items())
                 if o not in h]
        fetched = sorted({to for _, _, to in self.fetches(live)})
        parts = moved + ([f"sent to node(s) {', '.join(map(str, fetched))}"] if fetched else [])
        return "; ".join(parts) if parts else "every node's own files"


def recoverable(held: Dict[int, List[Holding]], exclude=frozenset()) -> Optional[RecoveryPlan]:
    """The newest save every share of which some live node holds (``held``: live node -> its
    holdings) and whose step a model-state file vouches for, or None; saves whose key is in ``exclude``
    (ones that could not be put together) are passed over."""
    by_key: Dict[tuple, Dict[int, set]] = {}
    sample: Dict[tuple, Holding] = {}
    vouched = set()
    for node, holdings in held.items():
        for h in holdings:
            by_key.setdefault(h.key, {}).setdefault(h.origin, set()).add(node)
            sample[h.key] = h
            if h.vouched:
                vouched.add(h.key)
    complete = [k for k, origins in by_key.items()
                if k not in exclude and k in vouched and set(origins) == set(range(sample[k].nodes))]
    if not complete:
        return None
    best = max(complete, key=lambda k: (sample[k].step, k[0]))
    h = sample[best]
    holders = {o: tuple(sorted(nodes)) for o, nodes in by_key[best].items()}
    return RecoveryPlan(best, h.step, h.tag, h.nodes, h.world_size, holders)


def local_share(holdings: List[Holding], key: tuple, origin: int) -> Optional[str]:
    """This node's copy of one share, if it holds one."""
    for h in holdings:
        if h.key == key and h.origin == origin:
            return h.path
    return None
