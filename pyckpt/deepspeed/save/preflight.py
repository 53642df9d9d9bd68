"""Step 2 of a save: before anything is written, every rank agrees that the save can start.

One all-gather carries each rank's view: the tag, the folder, the arguments that shape the save
(:meth:`~.request.SaveRequest.shape`), its estimated bytes and the folder's free space (:mod:`.space`),
and whatever went wrong preparing. Rank 0 prepares first (with node-local folders, every other node's
leader once the gather agreed: :mod:`.destination`): it makes the save folder, removes what killed saves
left, and takes the tag's staging folder under the output lock
(:class:`~pyckpt.execution.publisher.Publisher`), refusing to go on when an existing folder of that name
is not what the destination may replace. Ranks that differ, a rank that could
not prepare, a folder too small: every rank sees the same problem and stops together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import List, Optional

from ...execution.distributed import TorchRanks, describe_failure
from ...execution.leftovers import clean_orphans
from ...execution.publisher import Publisher
from .arrival import Arrival, _ranks
from .destination import Destination
from .outcome import failed_ranks
from .request import SaveRequest
from .space import estimate_rank_bytes, free_bytes, human

log = logging.getLogger("pyckpt")


@dataclasses.dataclass
class Staged:
    """What the preflight leaves the rest of a save: ``problem`` (every rank's the same) when it must
    stop, else the staging folder's name every rank hands DeepSpeed; ``publisher`` on the ranks that
    publish (rank 0, or each node's leader), entered into ``stack``, which owns the lock until the
    save ends (or its background work takes it over)."""

    group: TorchRanks
    stack: contextlib.ExitStack
    publisher: Optional[Publisher]
    staging_tag: Optional[str]
    problem: Optional[str]


def preflight(engine, request: SaveRequest, destination: Destination, group: TorchRanks, arrival: Arrival,
              stack: contextlib.ExitStack) -> Staged:
    """Step 2 (see the module doc), every rank; ``arrival`` is left once the gather is done."""
    save_dir, tag = request.save_dir, request.tag
    rank = group.rank
    prepare = functools.partial(_prepare, destination)
    publisher, local_error = prepare(request, stack) if rank == 0 else (None, None)
    try:
        need = estimate_rank_bytes(engine)
        free = free_bytes(save_dir)
    except Exception as exc:
        need, free = 0, None
        local_error = local_error or f"estimating the checkpoint's size: {describe_failure(exc)}"
    staging_tag = os.path.basename(publisher.staging) if publisher else None
    mine = {"tag": tag, "dir": save_dir, "need": need, "free": free, "error": local_error,
            "staging": staging_tag, "shape": request.shape()}
    destination.view(mine, publisher)
    pre = group.all_gather(mine)
    arrival.done()
    problem = _preflight_problem(pre, save_dir, tag, by_node=destination.by_node)
    if problem is None:
        later, problem = destination.agree(pre, request, rank, stack, prepare, group.all_gather)
        publisher = later or publisher
    return Staged(group, stack, publisher, None if problem else pre[0]["staging"], problem)


def _prepare(destination: Destination, request: SaveRequest, stack: contextlib.ExitStack,
             owner: Optional[str] = None):
    """A publisher's side (rank 0, or a node's leader): the folder made and cleaned, the tag's staging
    folder taken under its lock, nothing the save would replace someone else's. Returns (the publisher,
    or None if it could not be made; why the save cannot start, or None)."""
    save_dir, tag = request.save_dir, request.tag
    publisher = None
    try:
        os.makedirs(save_dir, exist_ok=True)
        for name in clean_orphans(save_dir):
            log.info("pyckpt: removed %s, left in %s by a save that did not finish", name, save_dir)
        publisher = stack.enter_context(Publisher(os.path.join(save_dir, tag), overwrite=True, fsync=request.fsync,
                                                  pointer="latest" if request.save_latest else None,
                                                  owner=owner))
        return publisher, destination.replacement_problem(request, publisher)
    except Exception as exc:
        return publisher, f"preparing {save_dir}: {describe_failure(exc)}"


def _preflight_problem(pre: List[dict], save_dir: str, tag: str, by_node: bool = False) -> Optional[str]:
    if any(not (isinstance(p, dict) and "shape" in p) for p in pre):  # a rank's memory save met this gather
        return (f"the ranks called save_checkpoint with different memory= settings (some with a memory tier, some "
                f"without); checkpoint {tag} was not saved, nothing was written")
    tags = {p["tag"] for p in pre}
    dirs = {p["dir"] for p in pre}
    if len(tags) > 1 or len(dirs) > 1:
        return (f"the ranks name different checkpoints ({', '.join(sorted(tags))} in {', '.join(sorted(dirs))}); "
                "save_dir and tag must be the same on every rank; nothing was written")
    # Arguments that decide which collectives and store rounds follow: ranks that differ would part
    # ways (one waiting in an all_gather the other never makes, or a later training collective
    # pairing with it), so they are refused here, together, before anything is written.
    for key in pre[0]["shape"]:
        values = [p["shape"][key] for p in pre]
        if any(v != values[0] for v in values):
            shown = _by_value(values)
            return (f"the ranks pass different {key} to save_checkpoint ({shown}); every argument that shapes the "
                    f"save must be the same on every rank; checkpoint {tag} was not saved, nothing was written")
    errors = [p["error"] for p in pre]
    if any(errors):
        return f"could not start saving {tag} in {save_dir}: {failed_ranks(errors)}; nothing was written"
    # one filesystem for all, or one per node (node-local folders): each must hold its ranks' files
    groups: dict = {}
    for r, p in enumerate(pre):
        groups.setdefault(p.get("node") if by_node else None, []).append(r)
    for node, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        need = sum(pre[r]["need"] for r in ranks)
        frees = [pre[r]["free"] for r in ranks if pre[r]["free"] is not None]
        free = min(frees) if frees else None
        if free is not None and need > free:
            biggest = max(ranks, key=lambda r: pre[r]["need"])
            where = save_dir if node is None else f"node {node}'s folder {save_dir}"
            return (f"not enough free space for checkpoint {tag} in {where}: it needs about {human(need)} "
                    f"({len(ranks)} ranks, the most {human(pre[biggest]['need'])} on rank {biggest}) and "
                    f"{human(free)} is free; nothing was written")
    return None


def _by_value(values: list, limit: int = 4) -> str:
    """``value on rank(s) a, b; other on rank(s) c``: which ranks passed what."""
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), []).append(rank)
    parts = [f"{value} on rank(s) {_ranks(ranks)}" for value, ranks in list(groups.items())[:limit]]
    return "; ".join(parts) + (f"; {len(groups) - limit} more values" if len(groups) > limit else "")

