"""The memory tier made ready for a job's first save, once training has begun.

A memory save writes over the free slot's files: tmpfs pages the tier already holds, mapped by the
process that writes them (:mod:`..tiers.free_slot`). The job's first save has no slot: it creates its
files, and the kernel allocates every page inside the call (about 0.35 s per 800 MB, against 0.2 s for
the whole save once the tier is warm). :func:`prepare_memory_tier`, called once on every rank after the
first training step (or a resume), learns the files the save will write (:mod:`.save_layout`: DeepSpeed's save
run without writing), and each node's leader then readies what that save writes over:

* no share of the job's run on the node and no slot: two new empty slots, the free slot and the next
  one (the second save's; only the first where two do not fit the tier's budget, none where one does
  not), in each of which each rank makes its own files, allocated and mapped (``free_slot.make_own``),
  in the call (or in the background). The node then holds what it holds in the steady state,
  ``max(keep, 2)`` checkpoints' pages counting the slot;
* a slot already there (a run before this one left it), or a share the save will retire (a job
  restarted after a crash, its tier full): each rank maps its own files of it (``free_slot.map_ahead``).

The first save takes the slot's files as every later save does; once it is published the next slot
becomes the free slot (``free_slot.promote_next``), and the third save writes over the first's files,
which their writer mapped when it made them. So no save of the job allocates a page or maps a file in
its call. A job that ends normally without saving removes the slots it made
(:func:`.memory_save.discard_unused_at_exit`).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from ...execution.distributed import TorchRanks, describe_failure
from ..tiers import free_slot
from ..tiers import node_manifest as nm
from ..tiers.job_identity import agreed_run, bound, owns
from ..tiers.links import nodes
from ..tiers.memory_root import budget, fits
from ..tiers.policy import one_tier
from .in_flight import join_all
from .memory_save import discard_unused_at_exit, tier_view, view_problem
from .save_layout import save_layout

log = logging.getLogger("pyckpt")

MADE, MAPPED = "made", "mapped"


def prepare_memory_tier(engine, save_dir, save_tier=None, *, exclude_frozen_parameters: bool = False,
                        background: bool = False, memory=None) -> Optional[str]:
    """Readies ``save_tier`` (the :class:`~..tiers.policy.MemoryTier` the saves to ``save_dir`` use) for
    the job's next memory save; call it on **every** rank, once, after the first training step (or a
    resume) and before the first save. Before the first step an optimizer may not have made its state yet
    (torch's Adam makes its moments at its first step), so the files' sizes are not known: a call at step 0
    prepares nothing and says so. The pages the first two saves write over are allocated and mapped
    by every rank at once, in the call (once per job; 0.9-3.4 s for a rank's 2 GB in the benchmarks on a
    2-core machine), so that the first save costs what a later one does. ``background=True`` does that in a thread
    at idle priority instead, while the first steps run, and the first save waits for what is left: there,
    with every core training, one first save waited 0.42 s (0.08 s steady), and the first step was as slow
    as after the call. ``exclude_frozen_parameters`` as the saves will pass it.

    Returns what was done on this node ("made": a new free slot; "mapped": the files of the slot or of the
    share the save writes over), or None where nothing was (said once on rank 0: the tier's folder is
    another job's, the files do not fit the tier's budget, the layout could not be learned). Nothing it
    does changes a checkpoint; it never fails the job for what it could not do."""
    tier = one_tier(save_tier, memory, "save_tier")
    if tier is None:
        raise ValueError("prepare_memory_tier needs save_tier=MemoryTier(...), the tier the saves use")
    group = TorchRanks()
    if not getattr(engine, "global_steps", 0):  # the same on every rank: all return here, no collective left
        if group.rank == 0:
            log.warning("pyckpt: prepare_memory_tier was called before the first training step, when the optimizer "
                        "may not have made its state yet; nothing was prepared: call it after the first step")
        return None
    tier, identity = bound(tier, save_dir)
    join_all(engine)
    free_slot.settle()
    mine = tier_view(tier)
    # collective, so every rank runs it whatever happened above; a folder that is never made
    files, failure = save_layout(engine, mine["folder"] or os.fspath(save_dir), exclude_frozen_parameters)
    mine["error"] = mine["error"] or failure
    mine["files"] = files
    pre = group.all_gather(mine)
    problem = view_problem(pre, identity, tier)
    if problem:
        if group.rank == 0:
            log.warning("pyckpt: the memory tier was not prepared for the first save: %s", problem)
        return None
    run = agreed_run([p["record"] for p in pre], identity)
    links = nodes(group, tier.folder, tier.keep, tier.job_name)
    decision = None
    if links.leader:
        node_files = [f for r, p in enumerate(pre) if links.node_of(r) == links.node for f in p["files"]]
        decision = _ready_node(mine["folder"], node_files, identity, run, nm.model_digest(engine), tier)
    decisions = group.all_gather(decision)
    kind, folders = decisions[links.ranks[links.node][0]]
    for where in folders if kind is not None else ():
        if kind == MADE:
            free_slot.make_own(where, files, background)
        else:
            free_slot.map_ahead(where, files, background)
    if group.rank == 0:
        refused = [d[1] for d in decisions if d is not None and d[0] is None]
        if refused:
            log.info("pyckpt: the memory tier was not prepared for the first save: %s", "; ".join(refused))
    return kind


def _ready_node(folder: str, files, identity, run: Optional[str], model: str, tier) -> tuple:
    """A node's leader: (MADE, the new slots) / (MAPPED, the folders the next saves write over) / (None,
    why nothing is readied)."""
    try:
        slot, spare = free_slot.path(folder), free_slot.next_path(folder)
        if os.path.lexists(slot):  # a run before this one left them
            return MAPPED, [p for p in (slot, spare) if os.path.isdir(p) and not os.path.islink(p)]
        if run is not None:
            found = [(p, m) for p, m in nm.shares(folder) if owns(m, identity, run) and m.model == model]
            ahead = free_slot.next_retired(folder, found, tier.keep)
            if ahead is not None:
                return MAPPED, [ahead]
        need = sum(size for _, size in files)
        room = budget(tier.root_path, tier.job_name, tier.limit_bytes)
        problem = fits(need, room)
        if problem:
            return None, problem
        made = [slot]
        if not os.path.lexists(spare) and fits(2 * need, room) is None:
            made.append(spare)  # the second save's too: the node then holds what the steady state holds
        for new in made:
            os.mkdir(new, 0o700)
        discard_unused_at_exit(folder)
        return MADE, made
    except Exception as exc:  # an optimisation: the first save allocates as it did
        return None, f"{folder}: {describe_failure(exc)}"
