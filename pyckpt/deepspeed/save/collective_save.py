"""A save (:func:`~.entry.save_checkpoint`): DeepSpeed's save, called on every rank, complete or invisible.

The order of one call (every rank):

1. **Arrival** (:mod:`.arrival`): every rank must be here; a call on some ranks fails fast, naming
   the missing ones, instead of hanging in DeepSpeed's first barrier. Calls naming different
   folders or tags meet here too: the preflight names that disagreement.
2. **Preflight** (:mod:`.preflight`), one all-gather: rank 0 makes the save folder, removes what
   killed saves left, and takes the tag's staging folder (a hidden sibling, under the output lock of
   :mod:`pyckpt.execution.publisher`); every rank estimates its bytes (:mod:`.space`). All ranks then
   agree on the tag, the staging name and whether the filesystem has room, before anything is written.
3. **DeepSpeed's save** into the staging tag (:mod:`.sync_save`), with ``save_latest=False`` and every
   file write guarded (:mod:`.guarded_io`) so that a failing rank still reaches DeepSpeed's
   collectives. Rank 0 also writes the tokenizer, the model config and ``training_state.json``
   (:mod:`.companions`).
4. **Agreement**, one all-gather of every rank's outcome.
5. **Publication** (:mod:`.publication`) by rank 0 when all succeeded: the staging folder is renamed
   to the tag (an atomic exchange if the tag exists), then ``latest`` is replaced atomically. On any
   failure the staging folder is removed and ``latest`` and earlier checkpoints stay as they were.
   Rank 0 broadcasts the outcome, so every rank returns (or raises) the same (:mod:`.outcome`).
6. Optionally the ranks convert the published checkpoint together (:mod:`.conversions`): to a
   Universal Checkpoint (``universal=True``) and/or a Hugging Face folder (``export="hf"``).

With ``async_save=True`` step 3 writes nothing (:mod:`.async_save`): every file DeepSpeed's save
hands its checkpoint engine is snapshotted into host buffers (:mod:`.snapshot`) and the call
returns; steps 4-5 run on a background thread per rank (:mod:`.background`), agreeing through the
store instead of a collective. Conversions then run at the join. ``keep_last`` prunes older
checkpoints after a publication (:mod:`.retention`). What the call asks for travels through these
steps as one :class:`~.request.SaveRequest`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Optional

from ...execution.distributed import TorchRanks
from .arrival import Arrival
from .async_save import save_async
from .background import AsyncSave
from .conversions import convert_published
from .destination import Destination, SharedFolder
from .in_flight import join_all
from .outcome import report_failure
from .preflight import preflight
from .request import SaveRequest
from .snapshot import capture_problem
from .sync_save import save_now

log = logging.getLogger("pyckpt")

WHAT = "pyckpt.deepspeed.save_checkpoint"


def save_collectively(engine, request: SaveRequest, destination: Optional[Destination] = None):
    """The save :func:`~.entry.save_checkpoint` describes, its arguments checked, into ``destination``
    (:mod:`.destination`): by default one folder all ranks share, rank 0 its publisher."""
    destination = destination or SharedFolder()
    # at most one save in flight per engine: the previous one is joined (and its failure reported) first,
    # and a memory checkpoint's persistence too (it meets the other nodes' leaders in the store)
    join_all(engine)
    ckpt_engine = engine.checkpoint_engine
    if getattr(ckpt_engine, "is_decoupled", lambda: False)():
        raise ValueError(f"{WHAT}: the checkpoint engine {type(ckpt_engine).__name__} writes after the call returns "
                         "(decoupled); pyckpt can only publish a checkpoint whose files are written when the save "
                         "returns. Use DeepSpeed's default checkpoint engine")
    if getattr(engine, "use_node_local_storage", lambda: False)():
        raise ValueError(f"{WHAT}: checkpoint.use_node_local_storage is not supported: the checkpoint must be on one "
                         "filesystem all ranks share, so that rank 0 can publish it whole")
    request = request.resolved(engine)
    save_dir, tag, on_error = request.save_dir, request.tag, request.on_error
    group = _process_group()
    rank = group.rank
    t_call = time.perf_counter()
    if request.async_save and not destination.background:
        # the destination writes its files in the call (a memory save is one copy from the state in either
        # mode, :mod:`.slot_save`): nothing is left for a background thread
        ok = save_collectively(engine, dataclasses.replace(request, async_save=False, snapshot_limit=None),
                               destination)
        handle = AsyncSave(f"checkpoint {tag}", on_error, rank).finished(ok, None)
        handle.stall_s = time.perf_counter() - t_call
        return handle
    if request.async_save:
        problem = capture_problem(ckpt_engine, engine)
        if problem:
            if rank == 0:
                log.warning("pyckpt: saving %s synchronously: %s", tag, problem)
            # the synchronous save takes no snapshot, so it has no limit either
            ok = save_collectively(engine, dataclasses.replace(request, async_save=False, snapshot_limit=None),
                                   destination)
            return AsyncSave(f"checkpoint {tag}", on_error, rank).finished(ok, None)

    # One name for every save, whatever its folder and tag: ranks that disagree on those must still
    # meet here, so that the preflight names the disagreement instead of calling the others absent.
    arrival = Arrival("save", rank, group.size)
    arrival.wait(request.arrival_timeout, WHAT)

    with contextlib.ExitStack() as stack:
        staged = preflight(engine, request, destination, group, arrival, stack)
        if staged.problem:
            failed = report_failure(staged.problem, on_error, rank, published=False)
            return AsyncSave(f"checkpoint {tag}", on_error, rank).finished(False, staged.problem) \
                if request.async_save else failed
        if request.async_save:
            return save_async(engine, request, staged, t_call)
        ok, message, t0 = save_now(engine, request, destination, staged)
    if not ok:
        return report_failure(message, on_error, rank, published=False)
    if rank == 0:
        log.info("pyckpt: saved %s in %.2f s", os.path.join(save_dir, tag), time.perf_counter() - t0)
    return convert_published(save_dir, tag, request.universal, request.export, on_error, rank)


def _process_group() -> TorchRanks:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{WHAT} needs torch.distributed to be initialised (deepspeed.initialize does it)")
    return TorchRanks()
