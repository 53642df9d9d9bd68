"""Steps 3-6 of an asynchronous save (``async_save=True``): the snapshot now, the rest in the background.

DeepSpeed's save runs as usual, but every file it hands its checkpoint engine is captured into host
buffers (:mod:`.snapshot`) instead of written, and the call returns. A background thread per rank
(:mod:`.background`) then writes the rank's files into the staging folder and posts its outcome in
the store; rank 0 gathers every rank's and publishes (:mod:`.publication`). (A memory save never
comes here: its one copy runs in the call, :mod:`.slot_save`.) The output lock and the staging folder pass from the call to that thread.
Conversions run at the join (:mod:`.conversions`), which the next save, ``wait()``,
``wait_for_saves()``, ``engine.destroy()`` (:mod:`.destroy_hook`) or the interpreter's exit makes.
"""

from __future__ import annotations

import logging
import os
import time

from ...execution.distributed import describe_failure
from .arrival import _default_store
from .background import AsyncSave, StoreAgreement, write_files
from .companions import write_companions
from .conversions import convert_published
from .destroy_hook import join_at_destroy
from .guarded_io import WriteFailures, guarded
from .in_flight import begin_save
from .own_save import deepspeeds_own
from .preflight import Staged
from .publication import prune_after, publish_checkpoint
from .request import SaveRequest
from .snapshot import (CHUNK_BYTES, CaptureCheckpointEngine, DeferredClones, DeviceCopies, SnapshotArena,
                       deferring_clones)

log = logging.getLogger("pyckpt")


def save_async(engine, request: SaveRequest, staged: Staged, t_call: float) -> AsyncSave:
    """Steps 3-6 of an asynchronous save: the snapshot now, the rest on a background thread."""
    save_dir, tag, snapshot_limit = request.save_dir, request.tag, request.snapshot_limit
    group = staged.group
    rank = group.rank
    arena = getattr(engine, "_pyckpt_arena", None)
    if arena is None or (snapshot_limit is not None and arena.chunk_bytes > max(snapshot_limit, 1)):
        # under a limit, chunks no bigger than it, so what stays allocated stays near it
        chunk = CHUNK_BYTES if snapshot_limit is None else min(CHUNK_BYTES, max(snapshot_limit, 1))
        arena = engine._pyckpt_arena = SnapshotArena(chunk)
    arena.begin()
    files: list = []
    failures = WriteFailures()
    inner = engine.checkpoint_engine
    copies = DeviceCopies()
    clones = DeferredClones()
    engine.checkpoint_engine = CaptureCheckpointEngine(inner, arena, files, snapshot_limit, copies, clones)
    try:
        with guarded(engine, failures), deferring_clones(clones), deepspeeds_own(engine):
            try:
                engine.save_checkpoint(save_dir, tag=staged.staging_tag, client_state=request.client_state or {},
                                       save_latest=False, exclude_frozen_parameters=request.exclude_frozen_parameters)
            except Exception as exc:
                failures.record("DeepSpeed's save_checkpoint raised", None, exc)
    finally:
        engine.checkpoint_engine = inner
    staging = os.path.join(save_dir, staged.staging_tag)
    if rank == 0 and not failures:
        write_companions(engine, staging, tag, group.size, request.tokenizer, request.model_config, failures,
                         request.training_state)
    # the output lock and the staging folder now belong to the background work (rank 0)
    held = staged.stack.pop_all()
    agreement = StoreAgreement(_default_store(), staged.staging_tag, rank, group.size, request.agree_timeout)
    sources = arena.sources()
    handle = AsyncSave(f"checkpoint {tag} in {save_dir}", request.on_error, rank)
    handle._t_call = t_call

    def body(h: AsyncSave):
        outcome = failures.first()
        if outcome is None:
            try:
                copies.wait()  # device-to-host copies still in flight (GPU state)
                write_files(files, sources, staging, request.fsync)
            except Exception as exc:
                outcome = f"writing into {staging}: {describe_failure(exc)}"
        h.written_s = time.perf_counter() - t_call
        agreement.post(outcome)
        if rank == 0:
            # the other ranks wait for the result: it is posted whatever happens here
            result = (False, f"checkpoint {tag} was not saved in {save_dir}: publishing it failed on rank 0")
            try:
                with held:
                    try:
                        outcomes = agreement.gather()
                    except TimeoutError as exc:
                        outcomes = [f"{exc}"]
                    result = publish_checkpoint(staged.publisher, outcomes, save_dir, tag)
                if result[0] and request.keep_last:
                    prune_after(save_dir, request.keep_last, tag)
            finally:
                agreement.announce(*result)
        else:
            result = agreement.result()
        agreement.forget()
        h.published_s = time.perf_counter() - t_call
        if result[0] and rank == 0:
            log.info("pyckpt: saved %s in the background (%.2f s after the call)", os.path.join(save_dir, tag),
                     h.published_s)
        return tuple(result)

    if request.universal or request.export:
        handle.then(lambda: convert_published(save_dir, tag, request.universal, request.export,
                                                       request.on_error, rank))
    handle.stall_s = time.perf_counter() - t_call
    begin_save(engine, handle)
    join_at_destroy(engine)
    return handle.start(body)
