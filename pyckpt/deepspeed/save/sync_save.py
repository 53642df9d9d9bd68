"""Steps 3-5 of a synchronous save: DeepSpeed's save into the staging folder, the agreement, the publication.

Every file write of DeepSpeed's save is guarded (:mod:`.guarded_io`), so a failing rank still
reaches DeepSpeed's collectives; rank 0 adds the companions (:mod:`.companions`). One all-gather
of every rank's outcome follows; rank 0 publishes (:mod:`.publication`) and broadcasts the result,
or, with node-local folders, each node's leader publishes its node's share (:mod:`.node_share`) and
every rank gathers what the leaders did. Every rank returns the same (ok, message).
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

from .companions import write_companions
from .guarded_io import WriteFailures, guarded
from .preflight import Staged
from .publication import prune_after, publish_checkpoint
from .request import SaveRequest


def save_now(engine, request: SaveRequest, staged: Staged) -> Tuple[bool, Optional[str], float]:
    """Steps 3-5 (see the module doc), every rank: (ok, why not, when DeepSpeed's save started)."""
    save_dir, tag, share = request.save_dir, request.tag, request.share
    group = staged.group
    rank = group.rank
    failures = WriteFailures()
    t0 = time.perf_counter()
    with guarded(engine, failures):
        try:
            engine.save_checkpoint(save_dir, tag=staged.staging_tag, client_state=request.client_state or {},
                                   save_latest=False, exclude_frozen_parameters=request.exclude_frozen_parameters)
        except Exception as exc:  # not a write (those are caught where they happen): report it all the same
            failures.record("DeepSpeed's save_checkpoint raised", None, exc)
    if rank == 0 and not failures:
        write_companions(engine, staged.publisher.staging, tag, group.size, request.tokenizer, request.model_config,
                         failures, request.training_state)
    outcomes = group.all_gather(failures.first())

    result = None
    if share is not None:
        if share.leader:
            result = share.publish(staged.publisher, outcomes, tag, engine.global_steps)
        ok, message = share.outcome(group.all_gather(result))
    else:
        if rank == 0:
            result = publish_checkpoint(staged.publisher, outcomes, save_dir, tag)
            if result[0] and request.keep_last:
                prune_after(save_dir, request.keep_last, tag)
        ok, message = group.broadcast(result)
    return ok, message, t0
