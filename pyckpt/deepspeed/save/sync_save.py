"""Steps 3-5 of a synchronous save: DeepSpeed's save into the staging folder, the agreement, the publication.

Every file write of DeepSpeed's save is guarded (:mod:`.guarded_io`), so a failing rank still
reaches DeepSpeed's collectives; rank 0 adds the companions (:mod:`.companions`). One all-gather
of every rank's outcome follows; rank 0 publishes (:mod:`.publication`) and broadcasts the result,
or, with node-local folders, each node's leader publishes its node's share (:mod:`.node_share`) and
every rank gathers what the leaders did. Every rank returns the same (ok, message).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import List, Optional, Tuple

from .companions import write_companions
from .guarded_io import WriteFailures, guarded
from .preflight import Staged
from .publication import prune_after, publish_checkpoint
from .request import SaveRequest
from .slot_save import capturing, write_slot_files
from .snapshot import capture_problem


def save_now(engine, request: SaveRequest, staged: Staged) -> Tuple[bool, Optional[str], float]:
    """Steps 3-5 (see the module doc), every rank: (ok, why not, when DeepSpeed's save started)."""
    save_dir, tag, share = request.save_dir, request.tag, request.share
    group = staged.group
    rank = group.rank
    failures = WriteFailures()
    t0 = time.perf_counter()
    # a memory save writes its files in place from the state itself (:mod:`.slot_save`), where the
    # checkpoint engine can be captured; otherwise DeepSpeed writes them into the node's folder
    in_place = share is not None and capture_problem(engine.checkpoint_engine, engine) is None
    described: List[tuple] = []
    with contextlib.ExitStack() as stack:
        captured = stack.enter_context(capturing(engine)) if in_place else None
        stack.enter_context(guarded(engine, failures))
        try:
            engine.save_checkpoint(save_dir, tag=staged.staging_tag, client_state=request.client_state or {},
                                   save_latest=False, exclude_frozen_parameters=request.exclude_frozen_parameters)
        except Exception as exc:  # not a write (those are caught where they happen): report it all the same
            failures.record("DeepSpeed's save_checkpoint raised", None, exc)
    staging = os.path.join(save_dir, staged.staging_tag)
    if captured is not None and not failures:
        try:
            described = write_slot_files(*captured, staging, save_dir)
        except Exception as exc:
            failures.record("writing into", staging, exc)
        captured = None  # the state's storages are no longer referenced
    if rank == 0 and not failures:
        write_companions(engine, staging, tag, group.size, request.tokenizer, request.model_config,
                         failures, request.training_state)

    result = None
    if share is not None:
        gathered = group.all_gather((failures.first(), described))
        outcomes = [g[0] for g in gathered]
        if share.leader:
            known = {name: (size, crc) for r, g in enumerate(gathered) if share.links.node_of(r) == share.node
                     for name, size, crc in g[1]}
            result = share.publish(staged.publisher, outcomes, tag, engine.global_steps, known)
        ok, message = share.outcome(group.all_gather(result))
    else:
        outcomes = group.all_gather(failures.first())
        if rank == 0:
            result = publish_checkpoint(staged.publisher, outcomes, save_dir, tag)
            if result[0] and request.keep_last:
                prune_after(save_dir, request.keep_last, tag)
        ok, message = group.broadcast(result)
    return ok, message, t0
