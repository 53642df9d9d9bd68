"""Steps 3-5 of a synchronous save: DeepSpeed's save into the staging folder, the agreement, the publication.

Every file write of DeepSpeed's save is guarded (:mod:`.guarded_io`), so a failing rank still
reaches DeepSpeed's collectives; rank 0 adds the companions (:mod:`.companions`). Where the destination
writes in place (a memory save, :mod:`.slot_save`), the files are written from the captured state. Then
the destination agrees on every rank's outcome and publishes (:mod:`.destination`). Every rank returns
the same (ok, message).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import List, Optional, Tuple

from .companions import write_companions
from .destination import Destination
from .guarded_io import WriteFailures, guarded
from .own_save import deepspeeds_own
from .preflight import Staged
from .request import SaveRequest
from .slot_save import capturing, write_slot_files


def save_now(engine, request: SaveRequest, destination: Destination,
             staged: Staged) -> Tuple[bool, Optional[str], float]:
    """Steps 3-5 (see the module doc), every rank: (ok, why not, when DeepSpeed's save started)."""
    save_dir, tag = request.save_dir, request.tag
    group = staged.group
    rank = group.rank
    failures = WriteFailures()
    t0 = time.perf_counter()
    # a memory save writes its files in place from the state itself (:mod:`.slot_save`), where the
    # checkpoint engine can be captured; otherwise DeepSpeed writes them into the node's folder
    in_place = destination.in_place(engine)
    described: List[tuple] = []
    with contextlib.ExitStack() as stack:
        captured = stack.enter_context(capturing(engine)) if in_place else None
        stack.enter_context(guarded(engine, failures))
        stack.enter_context(deepspeeds_own(engine))
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
    ok, message = destination.publish(engine, request, group, staged.publisher, failures.first(), described)
    return ok, message, t0
