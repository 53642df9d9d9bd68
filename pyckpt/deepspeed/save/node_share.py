"""A memory save's destination: node-local folders, each node's leader staging, describing, publishing,
pruning and replicating its own node's files (a :class:`~.destination.Destination` for
:func:`.collective_save.save_collectively`).

Every rank writes DeepSpeed's files into its own node's memory folder under one staging name (rank
0's, so that DeepSpeed's tag check sees one tag); the ranks agree on every rank's outcome as for a
durable save; then each node's leader records its job folder as the job's run's
(:func:`..tiers.job_identity.claim`), adds the node manifest (:mod:`..tiers.node_manifest`: every file
with its size and CRC-32, read once here), renames its staging folder (made private) into place,
points its node's ``latest`` at it, keeps the tier's ``keep`` newest of the run's shares there, and
offers it to the ring's sender (:mod:`..tiers.links`). A node whose
publication fails says so, and every rank returns the same outcome; the nodes that did publish keep
their share, which recovery never takes without every other node's share of the same save.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, List, Optional, Tuple

from ...execution.distributed import describe_failure
from ...execution.leftovers import remove_path
from ...execution.publisher import Publisher
from ..tiers import free_slot
from ..tiers import node_manifest as nm
from ..tiers.job_identity import Identity, claim, owns
from ..tiers.links import Nodes
from ..tiers.memory_root import budget, fits, node_folders
from .destination import Destination
from .outcome import failed_ranks
from .request import SaveRequest
from .snapshot import capture_problem

log = logging.getLogger("pyckpt")


class NodeShare(Destination):
    """This node's folder of the job's memory root; every node agrees, each node's leader publishes."""

    by_node = True
    # one copy from the state into the tier's files, in the call: nothing is left for a background thread
    background = False

    def __init__(self, links: Nodes, identity: Identity, run: str, model: str, keep: int, root: str,
                 world_size: int, limit: Optional[int] = None):
        self.links = links
        self.identity = identity
        self.job = identity.job
        self.run = run
        self.model = model
        self.keep = keep
        self.root = root
        self.world_size = world_size
        self.limit = limit  # the tier's byte limit (MemoryTier.limit_bytes)
        self.save_id: Optional[str] = None
        self.published: Optional[str] = None  # this node's tag folder once published

    @property
    def node(self) -> int:
        return self.links.node

    @property
    def nodes(self) -> int:
        return self.links.count

    @property
    def leader(self) -> bool:
        return self.links.leader

    def view(self, mine: dict, publisher) -> None:
        # the folders differ by node: the job is what must be the same
        mine.update(dir=self.job, node=self.node, owner=publisher.owner if publisher else None)

    def agree(self, pre: List[dict], request: SaveRequest, rank: int, stack: contextlib.ExitStack,
              prepare: Callable, gather: Callable):
        """The save's id and the tag's check; then every other node's leader stages under rank 0's name,
        so that every rank hands DeepSpeed the same tag (its tag validation compares them)."""
        problem = self._check(pre, request.tag)
        if problem:
            return None, problem
        publisher, error = prepare(request, stack, pre[0]["owner"]) if self.leader and rank != 0 else (None, None)
        problem = failed_ranks(gather(error)) or None
        if problem:
            problem = f"could not start saving {request.tag} in the memory tier: {problem}; nothing was published"
        return publisher, problem

    def replacement_problem(self, request: SaveRequest, publisher) -> Optional[str]:
        return self.replace_problem(publisher.output)

    def in_place(self, engine) -> bool:
        return capture_problem(engine.checkpoint_engine, engine) is None

    def publish(self, engine, request: SaveRequest, group, publisher, failure: Optional[str],
                described: list) -> Tuple[bool, Optional[str]]:
        """Each node's leader publishes its node's share, with the sizes and CRC-32s of the files its
        ranks wrote in place; every rank gathers what the leaders did."""
        gathered = group.all_gather((failure, described))
        result = None
        if self.leader:
            known = {name: (size, crc) for r, g in enumerate(gathered) if self.links.node_of(r) == self.node
                     for name, size, crc in g[1]}
            result = self._publish(publisher, [g[0] for g in gathered], request.tag, engine.global_steps, known,
                                   mine={name for name, _, _ in described})
        results = group.all_gather(result)
        ok, message = self.outcome(results)
        leader = results[self.links.ranks[self.node][0]]
        if ok and leader is not None and leader[2]:
            # the files the next save writes over: mapped by each of their writers while training runs
            free_slot.map_ahead(leader[2], [(name, size) for name, size, _ in described])
        return ok, message

    def _check(self, pre: List[dict], tag: str) -> Optional[str]:
        """After the preflight's gather: the save's id (rank 0's staging owner) and the tag's check."""
        problem = nm.tag_reserved(tag)
        if problem:
            return f"checkpoint tag {tag!r} {problem}; choose another tag; nothing was written"
        nodes = [p.get("node") for p in pre]
        if nodes != [self.links.node_of(r) for r in range(len(pre))]:
            return "the ranks' node numbers changed since the memory tier was set up; nothing was written"
        self.save_id = pre[0]["owner"]
        return None

    def mine(self, manifest) -> bool:
        """Whether a share is one of this job's run's (its job folder, save dir and run)."""
        return owns(manifest, self.identity, self.run)

    def replace_problem(self, output: str) -> Optional[str]:
        """Why ``output`` (an existing tag folder of this node) must not be replaced: only a share of
        this job's save dir is."""
        if not os.path.lexists(output):
            return None
        found = nm.read(output) if os.path.isdir(output) and not os.path.islink(output) else None
        if found is None or not owns(found, self.identity):
            return (f"{output} exists and is not a memory checkpoint of job {self.job}; a save replaces only its "
                    f"own; choose another tag, or remove that folder")
        return None

    def _publish(self, publisher: Publisher, outcomes: List[Optional[str]], tag: str, step: int,
                 known: Optional[dict] = None, mine=frozenset()) -> tuple:
        """This node's leader: the share described and published (or its staging let go): (published,
        why not, the folder whose files the next save writes over where known). ``known``:
        {name: (size, CRC-32)} of the files written in place (their CRCs computed as they were written);
        ``mine``: the names of the files this process wrote."""
        bad = [(r, m) for r, m in enumerate(outcomes) if m]
        if bad:
            return False, (f"checkpoint {tag} was not saved in the memory tier: "
                           + "; ".join(f"rank {r}: {m}" for r, m in bad)
                           + ". Nothing was published; the partial files were removed")
        try:
            claim(self.root, self.identity, self.run)  # the folder is this job's run's before a share is in it
            first, count = self.links.ranks[self.node]
            os.chmod(publisher.staging, 0o700)  # a share's folder is as private as the folders above it
            files = tuple(nm.describe(publisher.staging, known))
            manifest = nm.NodeManifest(self.save_id, self.job, tag, int(step), self.node, self.nodes, self.world_size,
                                       (first, count), self.model, files, self.run, self.identity.save_dir)
            nm.write(publisher.staging, manifest)
            problem = self.replace_problem(publisher.output)
            if problem:
                return False, f"checkpoint {tag} was not saved on node {self.node}: {problem}"
            publisher.publish()
        except Exception as exc:
            return False, (f"publishing checkpoint {tag} in node {self.node}'s memory folder failed: "
                           f"{describe_failure(exc)}")
        self.published = publisher.output
        folder = os.path.dirname(publisher.output)
        ahead = None  # the folder whose files the next save writes over, for its writers to map now
        try:
            # what this save did not take from the free slot; the share the pruning retires is the next one
            free_slot.discard(folder)
            free_slot.promote_next(folder)  # a second slot made before the job's first save: the next save's
            # the run's shares here, read once for both prunings (each read stats every listed file)
            found = [(path, m) for path, m in nm.shares(folder) if self.mine(m) and m.model == self.model]
            retired = nm.prune(folder, self.keep, self.mine, self.model, protect=(tag, ), found=found,
                               remove=lambda path: free_slot.retire(folder, path))
            self._prune_stale(folder, found)
            remaining = [(path, m) for path, m in found if path not in retired]
            ahead = free_slot.next_retired(folder, remaining, self.keep)
            if ahead is None:  # the next save retires no share: make its slot now
                free_slot.prepare_ahead(folder, [(name, size) for name, size, _ in files], self._room, mine)
        except Exception as exc:  # the checkpoint is in place; say why older ones stay
            log.warning("pyckpt: the memory tier could not prune %s: %s", folder, describe_failure(exc))
        if self.links.sender is not None:
            self.links.sender.offer(publisher.output, tag)
        return True, None, ahead

    def _room(self, nbytes: int) -> Optional[str]:
        """Why ``nbytes`` more do not fit this job's part of the memory root now (None: they do), as a
        checkpoint's are judged before a save."""
        return fits(nbytes, budget(self.root, self.job, self.limit))

    def _prune_stale(self, folder: str, found=None) -> None:
        """Folders of this job on this root under another node number (this host was another node
        before a restart): removed once this node's own folder holds ``keep`` shares at least as
        new as anything in them, so they are never the newest copy left. ``found``: this folder's shares
        of the job and model, where the caller has read them."""
        if found is None:
            found = [(p, m) for p, m in nm.shares(folder) if self.mine(m) and m.model == self.model]
        mine = sorted((m.step for _, m in found), reverse=True)
        if len(mine) < self.keep:
            return
        floor = mine[self.keep - 1]
        for node, path in node_folders(self.root, self.job):
            if os.path.normpath(path) == os.path.normpath(folder):
                continue
            held = [m.step for sub in [path] + nm.replica_folders(path) for _, m in nm.shares(sub)]
            if all(s <= floor for s in held):
                remove_path(path)

    def outcome(self, results: list) -> Tuple[bool, Optional[str]]:
        """Every rank's view of the leaders' publications (None from the ranks that lead none)."""
        posted = [r for r in results if r is not None]
        bad = [r[1] for r in posted if not r[0]]
        if bad:
            return False, "; ".join(dict.fromkeys(bad))
        return True, None
