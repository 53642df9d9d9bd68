"""``save_checkpoint``: DeepSpeed's save, called on every rank, complete or invisible.

The order of one call (every rank):

1. **Arrival** (:mod:`.arrival`): every rank must be here; a call on some ranks fails fast, naming
   the missing ones, instead of hanging in DeepSpeed's first barrier. Calls naming different
   folders or tags meet here too: the preflight names that disagreement.
2. **Preflight**, one all-gather: rank 0 makes the save folder, removes what killed saves left, and
   takes the tag's staging folder (a hidden sibling, under the output lock of
   :mod:`pyckpt.execution.publish`); every rank estimates its bytes (:mod:`.space`). All ranks then
   agree on the tag, the staging name and whether the filesystem has room, before anything is written.
3. **DeepSpeed's save** into the staging tag, with ``save_latest=False`` and every file write
   guarded (:mod:`.guarded_io`) so that a failing rank still reaches DeepSpeed's collectives. Rank 0
   also writes the tokenizer, the model config and ``training_state.json`` (:mod:`.companions`).
4. **Agreement**, one all-gather of every rank's outcome.
5. **Publication** by rank 0 when all succeeded: the staging folder is renamed to the tag (an atomic
   exchange if the tag exists), then ``latest`` is replaced atomically. On any failure the staging
   folder is removed and ``latest`` and earlier checkpoints stay as they were. Rank 0 broadcasts the
   outcome, so every rank returns (or raises) the same.
6. Optionally the ranks convert the published checkpoint together: to a Universal Checkpoint
   (``universal=True``) and/or a Hugging Face folder (``export="hf"``).

With ``async_save=True`` step 3 writes nothing: every file DeepSpeed's save hands its checkpoint
engine is snapshotted into host buffers (:mod:`.snapshot`) and the call returns; steps 4-5 run on
a background thread per rank (:mod:`.background`), agreeing through the store instead of a
collective. Conversions then run at the join. ``keep_last`` prunes older checkpoints after a
publication (:mod:`.retention`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, List, Optional

from ...errors import SaveError
from ...execution.distributed import TorchRanks, describe_failure
from ...execution.publish import Publisher, clean_orphans, pointer_name_problem
from .arrival import Arrival, _default_store, _ranks
from .background import AsyncSave, StoreAgreement, write_files
from .companions import write_model_config, write_tokenizer, write_training_state
from .guarded_io import WriteFailures, guarded
from .retention import keep_last as prune
from .retention import POINTERS, read_checkpoint, read_pointer, replace_problem
from .snapshot import (CHUNK_BYTES, CaptureCheckpointEngine, DeferredClones, DeviceCopies, SnapshotArena,
                       capture_problem, deferring_clones)
from .space import estimate_rank_bytes, free_bytes, human

log = logging.getLogger("pyckpt")

WHAT = "pyckpt.deepspeed.save_checkpoint"


def _check_tag(tag: str) -> str:
    if tag in ("", ".", "..") or "/" in tag or "\x00" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be one folder name not starting with '.' "
                         "(hidden names beside the checkpoints are pyckpt's staging)")
    if tag in POINTERS:
        raise ValueError(f"checkpoint tag {tag!r} is the name of the pointer file that names the newest checkpoint; "
                         "choose another tag; nothing was written")
    # `latest` would name a checkpoint that DeepSpeed's load_checkpoint cannot find (a bare AssertionError)
    problem = pointer_name_problem(tag)
    if problem:
        raise ValueError(f"checkpoint tag {tag!r} {problem}: a tag must have no whitespace at either end and no "
                         "control characters, so that `latest` can name it; nothing was written")
    return tag


def _failed_ranks(outcomes: List[Optional[str]]) -> str:
    bad = [(r, m) for r, m in enumerate(outcomes) if m]
    return "; ".join(f"rank {r}: {m}" for r, m in bad)


def save_checkpoint(engine, save_dir, tag=None, *, tokenizer=None, model_config=None,
                    client_state: Optional[dict] = None, on_error: str = "raise", universal: bool = False,
                    export: Optional[str] = None, exclude_frozen_parameters: bool = False,
                    arrival_timeout: float = 300.0, fsync: bool = False, async_save: bool = False,
                    keep_last: Optional[int] = None, agree_timeout: float = 1800.0,
                    snapshot_limit: Optional[int] = None, memory=None, persist: bool = False):
    """Save ``engine``'s training checkpoint as ``save_dir/<tag>``; call it on **every** rank.

    What DeepSpeed writes is DeepSpeed's own ``save_checkpoint`` output (the same files, bit for
    bit); around it, rank 0 adds ``tokenizer`` (via ``save_pretrained``), ``model_config`` (a
    transformers config or a dict, as ``config.json``) and ``training_state.json`` (step, samples,
    learning rates, scheduler, topology, versions) to the same folder. ``tag`` defaults to
    ``global_step<N>`` as in DeepSpeed; a tag is one folder name, not hidden, with no whitespace at
    either end and no control characters (``latest`` must name it so that DeepSpeed finds it again).

    The checkpoint is complete or invisible: it is written under a hidden staging name, every
    rank's success is agreed, and only then does rank 0 rename it into place and replace
    ``latest`` (atomically). If any rank fails, nothing is published, ``latest`` and earlier
    checkpoints are untouched, the staging files are removed, and no rank is left waiting:
    ``on_error="raise"`` raises :class:`SaveError` on every rank with every failing rank's
    message; ``"warn"`` logs it once (rank 0, logger ``pyckpt``) and returns False on every rank,
    so training can go on. The free space is checked first, from the state's sizes.

    A call on only some ranks (e.g. under ``if rank == 0:``) raises :class:`~.arrival.CollectiveCallError`
    naming the missing ranks after ``arrival_timeout`` seconds instead of hanging.

    ``universal=True`` then converts the new checkpoint on all ranks together to
    ``save_dir/<tag>_universal`` (``latest_universal`` names it), so the run can be resumed at
    any topology at once; ``export="hf"`` writes the Hugging Face export to ``save_dir/<tag>_hf``.
    Returns True when everything asked for is in place.

    ``async_save=True`` returns as soon as every rank holds a copy of the state DeepSpeed's save
    would write (in host buffers reused by the next save: one snapshot of the rank's state stays
    allocated) and writes the files in the background, byte for byte the files DeepSpeed would
    have written; the checkpoint is published when every rank's files are complete, as above.
    It returns an :class:`~.background.AsyncSave` handle (``done()``, ``wait()``); the next save,
    ``wait()``, ``pyckpt.deepspeed.wait_for_saves()`` or the interpreter's exit joins it, and a
    failure is raised (or warned) there, on every rank. Conversions run at that join. Only
    DeepSpeed's default checkpoint engine can be captured; otherwise the save runs synchronously
    with a warning. ``snapshot_limit`` (bytes per rank) bounds the snapshot: a file that would take
    it past the limit is written during the call instead (so the call blocks for its write); the
    ``engine.destroy()`` join also frees the snapshot.

    ``memory=MemoryTier(...)`` (:class:`pyckpt.deepspeed.MemoryTier`) saves into the job's node-local
    memory folder (tmpfs) instead, by the same rules, keeping the tier's ``keep`` newest there; one that
    does not fit the tier's budget goes to ``save_dir`` with a warning. Every ``persist_every``-th memory
    checkpoint, or one saved with ``persist=True``, is also copied to ``save_dir`` in the background
    (``keep_last`` then applies there). Under ``pyckpt.deepspeed.enable(memory=...)`` a resume reads the
    newest of the two (:mod:`.memory_save`).

    ``keep_last=K`` removes this job's older checkpoints of ``save_dir`` beyond the K newest (by the
    step each records) once this one is published: only folders whose model-state file is
    DeepSpeed's, for the same parameters; never the one ``latest`` or ``latest_universal`` names, nor
    one another run holds locked (:mod:`.retention`).

    An existing ``save_dir/<tag>`` (and ``<tag>_universal`` / ``<tag>_hf`` when asked for) is replaced
    only when it is what pyckpt writes there (a DeepSpeed checkpoint of the same model, a Universal
    Checkpoint, a Hugging Face export); anything else stops the save on every rank before anything is
    written. Every argument that shapes the save must be the same on every rank: ranks that differ
    (``async_save`` on some only, say) are refused together in the preflight, naming the argument.
    """
    if on_error not in ("raise", "warn"):
        raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
    if export not in (None, "hf"):
        raise ValueError(f"export must be None or 'hf', not {export!r}")
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or a positive number of checkpoints, not {keep_last!r}")
    if snapshot_limit is not None and (isinstance(snapshot_limit, bool) or not isinstance(snapshot_limit, int)
                                       or snapshot_limit < 0):
        raise ValueError(f"snapshot_limit must be None or a number of bytes, not {snapshot_limit!r}")
    import threading  # its longest wait bounds both: a longer one raises OverflowError mid-save, not here
    from ...errors import check_number
    for key, seconds in (("arrival_timeout", arrival_timeout), ("agree_timeout", agree_timeout)):
        check_number(key, seconds, low=0, low_open=True, high=threading.TIMEOUT_MAX)
    kwargs = dict(tokenizer=tokenizer, model_config=model_config, client_state=client_state, on_error=on_error,
                  universal=universal, export=export, exclude_frozen_parameters=exclude_frozen_parameters,
                  arrival_timeout=arrival_timeout, fsync=fsync, async_save=async_save, keep_last=keep_last,
                  agree_timeout=agree_timeout, snapshot_limit=snapshot_limit)
    if memory is not None:
        from .memory_save import save_to_memory

        return save_to_memory(save_collectively, engine, save_dir, tag, memory, persist, kwargs)
    return save_collectively(engine, save_dir, tag, **kwargs)


def save_collectively(engine, save_dir, tag=None, *, tokenizer=None, model_config=None,
                      client_state: Optional[dict] = None, on_error: str = "raise", universal: bool = False,
                      export: Optional[str] = None, exclude_frozen_parameters: bool = False,
                      arrival_timeout: float = 300.0, fsync: bool = False, async_save: bool = False,
                      keep_last: Optional[int] = None, agree_timeout: float = 1800.0,
                      snapshot_limit: Optional[int] = None, share=None):
    """The save :func:`save_checkpoint` describes, its arguments checked. ``share`` (a
    :class:`~.node_share.NodeShare`) makes ``save_dir`` node-local: each node's leader stages,
    publishes and prunes its own node's folder (every rank names its own node's), after the same
    agreement of every rank; None: one folder all ranks share, rank 0 its publisher."""
    # at most one save in flight per engine: the previous one is joined (and its failure reported) first,
    # and a memory checkpoint's persistence too (it meets the other nodes' leaders in the store)
    previous = getattr(engine, "_pyckpt_async_save", None)
    if previous is not None:
        engine._pyckpt_async_save = None
        previous.wait()
    pending = getattr(engine, "_pyckpt_persist", None)
    if pending is not None:
        engine._pyckpt_persist = None
        pending.wait()
    ckpt_engine = engine.checkpoint_engine
    if getattr(ckpt_engine, "is_decoupled", lambda: False)():
        raise ValueError(f"{WHAT}: the checkpoint engine {type(ckpt_engine).__name__} writes after the call returns "
                         "(decoupled); pyckpt can only publish a checkpoint whose files are written when the save "
                         "returns. Use DeepSpeed's default checkpoint engine")
    if getattr(engine, "use_node_local_storage", lambda: False)():
        raise ValueError(f"{WHAT}: checkpoint.use_node_local_storage is not supported: the checkpoint must be on one "
                         "filesystem all ranks share, so that rank 0 can publish it whole")
    save_dir = os.path.abspath(os.fspath(save_dir))
    tag = _check_tag(str(tag if tag is not None else f"global_step{engine.global_steps}"))
    group = _process_group()
    rank = group.rank
    t_call = time.perf_counter()
    if async_save:
        problem = capture_problem(ckpt_engine, engine)
        if problem:
            if rank == 0:
                log.warning("pyckpt: saving %s synchronously: %s", tag, problem)
            ok = save_collectively(engine, save_dir, tag, tokenizer=tokenizer, model_config=model_config,
                                   client_state=client_state, on_error=on_error, universal=universal,
                                   export=export, exclude_frozen_parameters=exclude_frozen_parameters,
                                   arrival_timeout=arrival_timeout, fsync=fsync, keep_last=keep_last, share=share)
            return AsyncSave(f"checkpoint {tag}", on_error, rank).finished(ok, None)

    # One name for every save, whatever its folder and tag: ranks that disagree on those must still
    # meet here, so that the preflight names the disagreement instead of calling the others absent.
    arrival = Arrival("save", rank, group.size)
    arrival.wait(arrival_timeout, WHAT)

    stack = contextlib.ExitStack()
    publisher: Optional[Publisher] = None
    local_error = None

    def prepare(owner: Optional[str] = None) -> Optional[str]:
        """The publisher's side (rank 0, or every node's leader): the folder made and cleaned, the tag's
        staging folder taken under its lock, nothing the save would replace someone else's."""
        nonlocal publisher
        try:
            os.makedirs(save_dir, exist_ok=True)
            for name in clean_orphans(save_dir):
                log.info("pyckpt: removed %s, left in %s by a save that did not finish", name, save_dir)
            publisher = stack.enter_context(Publisher(os.path.join(save_dir, tag), overwrite=True, fsync=fsync,
                                                      pointer="latest", owner=owner))
            if share is not None:
                return share.replace_problem(publisher.output)
            return _replace_problem(save_dir, tag, universal, export)
        except Exception as exc:
            return f"preparing {save_dir}: {describe_failure(exc)}"

    if rank == 0:
        local_error = prepare()
    with stack:
        try:
            need = estimate_rank_bytes(engine)
            free = free_bytes(save_dir)
        except Exception as exc:
            need, free = 0, None
            local_error = local_error or f"estimating the checkpoint's size: {describe_failure(exc)}"
        staging_tag = os.path.basename(publisher.staging) if publisher else None
        shape = {"async_save": bool(async_save), "keep_last": keep_last, "universal": bool(universal),
                 "export": export, "snapshot_limit": snapshot_limit, "on_error": on_error,
                 "exclude_frozen_parameters": bool(exclude_frozen_parameters)}
        mine = {"tag": tag, "dir": save_dir, "need": need, "free": free, "error": local_error,
                "staging": staging_tag, "shape": shape}
        if share is not None:  # folders differ by node: the job is what must be the same
            mine.update(dir=share.job, node=share.node, owner=publisher.owner if publisher else None)
        pre = group.all_gather(mine)
        arrival.done()
        problem = _preflight_problem(pre, save_dir, tag, by_node=share is not None)
        if problem is None and share is not None:
            problem = share.agree(pre, tag)
            if problem is None:  # every other node's leader stages under rank 0's name, so every rank
                # hands DeepSpeed the same tag (its tag validation compares them)
                if share.leader and rank != 0:
                    local_error = prepare(pre[0]["owner"])
                problem = _failed_ranks(group.all_gather(local_error)) or None
                if problem:
                    problem = f"could not start saving {tag} in the memory tier: {problem}; nothing was published"
        if problem:
            failed = _fail(problem, on_error, rank, published=False)
            return AsyncSave(f"checkpoint {tag}", on_error, rank).finished(False, problem) if async_save else failed
        staging_tag = pre[0]["staging"]
        if async_save:
            return _save_async(engine, save_dir, tag, staging_tag, publisher, stack, group, client_state,
                               exclude_frozen_parameters, tokenizer, model_config, on_error, universal, export, fsync,
                               keep_last, agree_timeout, t_call, snapshot_limit, share)

        failures = WriteFailures()
        t0 = time.perf_counter()
        with guarded(engine, failures):
            try:
                engine.save_checkpoint(save_dir, tag=staging_tag, client_state=client_state or {}, save_latest=False,
                                       exclude_frozen_parameters=exclude_frozen_parameters)
            except Exception as exc:  # not a write (those are caught where they happen): report it all the same
                failures.record("DeepSpeed's save_checkpoint raised", None, exc)
        if rank == 0 and not failures:
            _write_companions(engine, publisher.staging, tag, group.size, tokenizer, model_config, failures)
        outcomes = group.all_gather(failures.first())

        result = None
        if share is not None:
            if share.leader:
                result = share.publish(publisher, outcomes, tag, engine.global_steps)
            ok, message = share.outcome(group.all_gather(result))
        else:
            if rank == 0:
                result = _publish(publisher, outcomes, save_dir, tag)
                if result[0] and keep_last:
                    _prune(save_dir, keep_last, tag)
            ok, message = group.broadcast(result)
    if not ok:
        return _fail(message, on_error, rank, published=False)
    if rank == 0:
        log.info("pyckpt: saved %s in %.2f s", os.path.join(save_dir, tag), time.perf_counter() - t0)
    return _convert(save_dir, tag, universal, export, on_error, rank)


def _save_async(engine, save_dir, tag, staging_tag, publisher, stack, group, client_state, exclude_frozen_parameters,
                tokenizer, model_config, on_error, universal, export, fsync, keep_last, agree_timeout, t_call,
                snapshot_limit=None, share=None):
    """Steps 3-6 of an asynchronous save: the snapshot now, the rest on a background thread."""
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
        with guarded(engine, failures), deferring_clones(clones):
            try:
                engine.save_checkpoint(save_dir, tag=staging_tag, client_state=client_state or {}, save_latest=False,
                                       exclude_frozen_parameters=exclude_frozen_parameters)
            except Exception as exc:
                failures.record("DeepSpeed's save_checkpoint raised", None, exc)
    finally:
        engine.checkpoint_engine = inner
    staging = os.path.join(save_dir, staging_tag)
    if rank == 0 and not failures:
        _write_companions(engine, staging, tag, group.size, tokenizer, model_config, failures)
    # the output lock and the staging folder now belong to the background work (rank 0)
    held = stack.pop_all()
    agreement = StoreAgreement(_default_store(), staging_tag, rank, group.size, agree_timeout)
    sources = arena.sources()
    step = engine.global_steps
    handle = AsyncSave(f"checkpoint {tag} in {save_dir}", on_error, rank)
    handle._t_call = t_call

    def body(h: AsyncSave):
        outcome = failures.first()
        if outcome is None:
            try:
                copies.wait()  # device-to-host copies still in flight (GPU state)
                write_files(files, sources, staging, fsync)
            except Exception as exc:
                outcome = f"writing into {staging}: {describe_failure(exc)}"
        h.written_s = time.perf_counter() - t_call
        agreement.post(outcome)
        if share is not None:
            return _publish_shares(h, agreement, share, held, publisher, tag, step, rank, agree_timeout)
        if rank == 0:
            # the other ranks wait for the result: it is posted whatever happens here
            result = (False, f"checkpoint {tag} was not saved in {save_dir}: publishing it failed on rank 0")
            try:
                with held:
                    try:
                        outcomes = agreement.gather()
                    except TimeoutError as exc:
                        outcomes = [f"{exc}"]
                    result = _publish(publisher, outcomes, save_dir, tag)
                if result[0] and keep_last:
                    _prune(save_dir, keep_last, tag)
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

    if universal or export:
        handle._after.append(lambda: _convert(save_dir, tag, universal, export, on_error, rank))
    handle.stall_s = time.perf_counter() - t_call
    engine._pyckpt_async_save = handle
    _join_at_destroy(engine)
    return handle.start(body)


def _publish_shares(h: AsyncSave, agreement: StoreAgreement, share, held, publisher, tag: str, step: int,
                    rank: int, timeout: float) -> tuple:
    """An asynchronous save's end with node-local folders: rank 0 gathers every rank's outcome and
    announces it; each node's leader then publishes its node's folder (or lets its staging go) and
    posts how that went; every rank returns what all the leaders posted."""
    if rank == 0:
        try:
            outcomes = agreement.gather()
        except TimeoutError as exc:
            outcomes = [f"{exc}"]
        bad = _failed_ranks(outcomes)
        agreement.announce(not bad, bad or None)
    try:
        go, why = agreement.result()
    except Exception as exc:
        go, why = False, f"rank 0 announced no outcome: {describe_failure(exc)}"
    nodes = StoreAgreement(agreement.store, agreement.prefix[len("pyckpt/async/"):] + "nodes", share.node,
                           share.nodes, timeout)
    if share.leader:
        result = (False, f"checkpoint {tag} was not saved in the memory tier: publishing failed on node {share.node}")
        try:
            with held:
                if go:
                    result = share.publish(publisher, [None], tag, step)
                else:
                    result = (False, f"checkpoint {tag} was not saved in the memory tier: {why}. Nothing was "
                                     "published; the partial files were removed")
        finally:
            nodes.post(list(result))
    try:
        results = nodes.gather()
    except TimeoutError as exc:
        results = [[False, f"checkpoint {tag}: {exc}"]]
    agreement.forget()
    h.published_s = time.perf_counter() - h._t_call
    ok, message = share.outcome(results)
    if ok and rank == 0:
        log.info("pyckpt: saved %s in the memory tier (%.2f s after the call)", tag, h.published_s)
    return ok, message


def _join_at_destroy(engine) -> None:
    """``engine.destroy()`` joins the save in flight first (its failure reported there) and lets go of
    the snapshot buffers: the end of the engine's life is a join point like the next save."""
    if getattr(engine, "_pyckpt_joins_at_destroy", False):
        return
    original = engine.destroy

    def destroy(*args, **kwargs):
        pending = getattr(engine, "_pyckpt_async_save", None)
        engine._pyckpt_async_save = None
        try:
            if pending is not None:
                pending.wait()
        finally:
            engine._pyckpt_arena = None
            del engine.destroy  # the class's own again
            engine._pyckpt_joins_at_destroy = False
            original(*args, **kwargs)

    engine.destroy = destroy
    engine._pyckpt_joins_at_destroy = True


def _prune(save_dir: str, k: int, tag: str) -> None:
    try:
        prune(save_dir, k, newest=tag)
    except Exception as exc:  # the save itself is complete; say why older ones stay
        log.warning("pyckpt: keep_last=%d could not prune %s: %s", k, save_dir, describe_failure(exc))


def _process_group() -> TorchRanks:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{WHAT} needs torch.distributed to be initialised (deepspeed.initialize does it)")
    return TorchRanks()


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
        return f"could not start saving {tag} in {save_dir}: {_failed_ranks(errors)}; nothing was written"
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


def _replace_problem(save_dir: str, tag: str, universal: bool, export: Optional[str]) -> Optional[str]:
    """Why this save must not start: a folder it would replace (the tag, or a conversion it was asked
    for) exists and is not what pyckpt writes there. DeepSpeed's own save would leave such a folder's
    files alone; replacing it whole would cost the user them."""
    outputs = [(tag, "checkpoint")] + ([(tag + "_universal", "_universal")] if universal else []) + \
        ([(tag + "_hf", "_hf")] if export == "hf" else [])
    for name, kind in outputs:
        problem = replace_problem(os.path.join(save_dir, name), kind)
        if problem:
            return (f"{problem}; a save replaces only a checkpoint of its own tag. Choose another tag, or move "
                    "that folder away")
    return None


def _write_companions(engine, folder: str, tag: str, world_size: int, tokenizer, model_config,
                      failures: WriteFailures) -> None:
    steps = [("writing the tokenizer into", lambda: tokenizer is not None and write_tokenizer(tokenizer, folder)),
             ("writing the model config into",
              lambda: model_config is not None and write_model_config(model_config, folder)),
             ("writing training_state.json into", lambda: write_training_state(engine, tag, world_size, folder))]
    for action, step in steps:
        try:
            step()
        except Exception as exc:
            failures.record(action, folder, exc)
            return


def _publish(publisher: Publisher, outcomes: List[Optional[str]], save_dir: str, tag: str):
    """Rank 0: (True, None) once published, else (False, why). The staging folder goes either way
    (renamed into place, or removed when the publisher is left)."""
    if any(outcomes):
        latest = _read_latest(save_dir)
        kept = f"latest still names {latest}" if latest else "there is no latest file"
        return False, (f"checkpoint {tag} was not saved in {save_dir}: {_failed_ranks(outcomes)}. Nothing was "
                       f"published ({kept}); the partial files were removed")
    # checked again under the lock (it may have appeared since), now against what is about to replace it
    problem = replace_problem(publisher.output, reference=read_checkpoint(publisher.staging))
    if problem:
        return False, (f"checkpoint {tag} was not saved in {save_dir}: {problem}, and a save replaces only a "
                       "checkpoint of its own tag. Nothing was published; the partial files were removed")
    try:
        publisher.publish()
    except Exception as exc:
        where = "" if not publisher.published else f" (the folder {publisher.output} is in place, latest was not updated)"
        return False, f"publishing checkpoint {tag} in {save_dir} failed{where}: {describe_failure(exc)}"
    return True, None


def _read_latest(save_dir: str) -> Optional[str]:
    try:
        return read_pointer(save_dir, "latest")
    except OSError:  # a message names what latest holds only when it is a plain file of the folder
        return None


def _fail(message: str, on_error: str, rank: int, published: bool) -> bool:
    if on_error == "raise":
        raise SaveError(message, published=published)
    if rank == 0:
        log.warning("pyckpt: %s", message)
    return False


def _convert(save_dir: str, tag: str, universal: bool, export: Optional[str], on_error: str, rank: int) -> bool:
    """The optional conversions of the published checkpoint, by all ranks together."""
    if not universal and not export:
        return True
    ranks = TorchRanks()
    source = os.path.join(save_dir, tag)
    jobs: List[Any] = []
    if universal:
        from ...universal.convert import convert_to_universal

        jobs.append(("a Universal Checkpoint", os.path.join(save_dir, f"{tag}_universal"), convert_to_universal, {}))
    if export == "hf":
        from ...huggingface.export import export_hf

        jobs.append(("a Hugging Face export", os.path.join(save_dir, f"{tag}_hf"), export_hf, {}))
    for what, output, run, kwargs in jobs:
        # a folder of that name that is not such a conversion is someone's (it may have appeared since
        # the preflight, an asynchronous save's conversion runs at its join): rank 0 looks, all agree
        problem = ranks.broadcast(replace_problem(output, output[len(source):], read_checkpoint(source))
                                  if rank == 0 else None)
        if problem:
            return _fail(f"checkpoint {tag} was saved in {save_dir} (latest names it), but it was not converted to "
                         f"{what}: {problem}", on_error, rank, published=True)
        try:
            run(source, output, overwrite=True, ranks=ranks, **kwargs)
        except Exception as exc:
            return _fail(f"checkpoint {tag} was saved in {save_dir} (latest names it), but converting it to {what} "
                         f"at {output} failed: {describe_failure(exc)}", on_error, rank, published=True)
    return True
