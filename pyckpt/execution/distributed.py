"""One conversion spread over the processes of a torch.distributed job (``torchrun ... -m pyckpt.convert``).

Every process plans the whole conversion (planning reads metadata only, and a plan is plain data,
so all of them arrive at the same one; :func:`agreed` checks that they did), takes the outputs
:func:`split_outputs` gives it, and writes them into the one staging folder rank 0 made on the
shared filesystem. A process maps only the sources its outputs need and touches only their byte
ranges, so each reads about 1/K of the checkpoint.

Every step that can fail on one process ends in one collective (:func:`agreed`), so a failure
anywhere is known everywhere at the same point: no process waits for one that gave up, and every
process raises the same :class:`~pyckpt.errors.RanksFailedError` naming each failing rank.

torch is imported only when a launch is detected: converting needs no torch.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import heapq
import os
import sys
from typing import Any, Iterator, List, Optional, Tuple, Type

from ..errors import PyckptError, RanksFailedError
from ..tensors import ITEMSIZE
from ..formats.pickle_write import dumps
from ..planning.plan import Plan

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
# Between two collectives a process writes its whole share, which for a large checkpoint on a busy
# filesystem takes far longer than torch's default 30 minutes; a process that dies is still seen at
# once (its connections close), so a long limit only bounds a process that hangs alive.
COLLECTIVE_TIMEOUT_S = 24 * 3600


class TorchRanks:
    """The processes of a torch.distributed group (the default group unless ``group`` is given), with
    the two object collectives a spread conversion needs."""

    def __init__(self, group: Any = None, owned: bool = False):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.owned = owned  # the default group was initialised for this run: close() takes it down
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` (a rank within the group) on every rank."""
        box = [obj]
        # broadcast_object_list names the source by its rank in the whole job
        root = src if self.group is None else self._dist.get_global_rank(self.group, src)
        self._dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]

    def close(self) -> None:
        """Takes down a process group :func:`from_launcher` initialised (one it found is the caller's).
        A process that exits with its gloo group still up can abort in the group's destructor."""
        if self.owned and self._dist.is_initialized():
            self._dist.destroy_process_group()
            self.owned = False


def from_launcher() -> Optional[TorchRanks]:
    """The job's processes when this one is part of a multi-process torch.distributed launch, else None.

    An initialised default group (e.g. inside a DeepSpeed job) is used as it is. Otherwise, under
    torchrun (RANK, WORLD_SIZE, MASTER_ADDR set, WORLD_SIZE > 1) the default group is initialised
    with gloo: the collectives carry a few small objects, which needs no accelerator."""
    dist = sys.modules.get("torch.distributed")  # already imported: no import cost to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return TorchRanks() if dist.get_world_size() > 1 else None
    if not all(os.environ.get(name) for name in LAUNCH_VARIABLES):
        return None
    try:
        size = int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise PyckptError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None
    if size <= 1:
        return None
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise PyckptError(f"launched as one of {size} processes (WORLD_SIZE), which needs torch.distributed: "
                          f"{exc}; install torch, or run a single process") from None
    if not dist.is_initialized():
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return TorchRanks(owned=True)
    return TorchRanks()


def leave_and_exit(code: int = 0, exit_handlers: bool = False):
    """Leave the default process group together, then end this process without interpreter shutdown.

    A DeepSpeed job keeps references to its process groups, so gloo's threads outlive
    ``destroy_process_group``; one still releasing the last collective's tensors asks for the GIL
    during finalization, where Python ends the asking thread and the C++ runtime aborts the process
    (SIGABRT, "terminate called without an active exception", after every rank had finished; torch
    issue 190489). For the end of a rank's script, after its output is written and closed.

    ``exit_handlers`` first runs the process's ``atexit`` handlers, as a normal end would (pyckpt's
    memory tier persists its newest checkpoint and clears the job's memory folder, asynchronous saves
    are joined) while the process group still stands."""
    import torch.distributed as dist

    if exit_handlers:
        atexit._run_exitfuncs()
    # A rank that failed does not wait for the others: they learn of it from their next collective.
    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def several(ranks: Optional[TorchRanks]) -> Optional[TorchRanks]:
    """``ranks`` when there is more than one process to share the work, else None (a single
    process runs exactly as without torch.distributed)."""
    return ranks if ranks is not None and ranks.size > 1 else None


def default_workers() -> Optional[int]:
    """Copy threads per process when several share a node: the node's cores split between them
    (LOCAL_WORLD_SIZE processes), at least one. None outside a launch (the executor's own default)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local or not local.isdigit() or int(local) <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(local))


# -- sharing a plan out ------------------------------------------------------------------------

def output_sizes(plan: Plan) -> List[Tuple[str, str, int]]:
    """(kind, relpath, bytes) of every output file of ``plan``, in plan order."""
    out = []
    for arc in plan.archives:
        pkl, storages = dumps(arc.obj)
        out.append(("archive", arc.relpath, len(pkl) + sum(st.numel * ITEMSIZE[st.dtype] for st in storages)))
    for raw in plan.raw_files:
        out.append(("raw", raw.relpath, len(raw.head) + sum(t.numel() * ITEMSIZE[t.dtype] for _, t in raw.tensors)))
    for c in plan.copies:
        out.append(("copy", c.relpath, int(c.src.size)))
    for ser in plan.series:
        nbytes = 0
        for obj in ser.members:
            pkl, storages = dumps(obj)
            nbytes += len(pkl) + sum(st.numel * ITEMSIZE[st.dtype] for st in storages)
        out.append(("series", ser.relpath, nbytes))
    return out


def plan_digest(plan: Plan) -> Tuple[int, int, str]:
    """(files, bytes, sha256 of every output's kind, path and size): equal on ranks that planned alike."""
    sizes = output_sizes(plan)
    h = hashlib.sha256()
    for kind, relpath, nbytes in sizes:
        h.update(f"{kind}\0{relpath}\0{nbytes}\n".encode("utf-8", "surrogateescape"))
    return len(sizes), sum(n for _, _, n in sizes), h.hexdigest()


def split_outputs(plan: Plan, size: int) -> List[Plan]:
    """``plan``'s output files dealt to ``size`` ranks, each file to exactly one: largest first, each
    to the rank with the fewest bytes so far (ties: the lower rank). Deterministic, so every rank
    computes the same deal from the same plan. Greedy leaves no rank more than the largest file
    above an even share. Each share keeps the plan's order and notes."""
    if size < 1:
        raise ValueError(f"cannot share a plan among {size} ranks")
    # output_sizes lists archives, raw files, copies and series in this order too
    outputs = [(attr, out) for attr in ("archives", "raw_files", "copies", "series") for out in getattr(plan, attr)]
    sizes = [nbytes for _, _, nbytes in output_sizes(plan)]
    order = sorted(range(len(outputs)), key=lambda j: (-sizes[j], outputs[j][1].relpath))
    loads = [(0, rank) for rank in range(size)]  # already a heap
    owner = [0] * len(outputs)
    for j in order:
        load, rank = heapq.heappop(loads)
        owner[j] = rank
        heapq.heappush(loads, (load + sizes[j], rank))
    shares = [Plan(notes=list(plan.notes)) for _ in range(size)]
    for j, (attr, out) in enumerate(outputs):
        getattr(shares[owner[j]], attr).append(out)
        shares[owner[j]]._relpaths.add(out.relpath)
    return shares


# -- agreeing ----------------------------------------------------------------------------------

class Vote:
    """What one rank says after a step (``value``) and, once all have said it, what every rank said."""

    def __init__(self):
        self.value: Any = None
        self.values: Optional[list] = None


def describe_failure(exc: BaseException) -> str:
    """One line for another rank's message: the exception's kind and text."""
    return RanksFailedError.describe(exc)


@contextlib.contextmanager
def agreed(ranks: Optional[TorchRanks], what: str, same: bool = False, *,
           error: Type[RanksFailedError] = RanksFailedError, own: bool = False) -> Iterator[Vote]:
    """The one rank agreement of convert, export, load and save: runs the block on every rank, then
    one all_gather of each rank's outcome. If the block failed anywhere, every rank raises ``error``
    naming each failed rank and its message (a failed rank's own exception as the cause); with
    ``own``, a rank that failed raises its own exception instead (noting the other failing ranks), so
    that its type reaches the caller, and only the others raise ``error``. Otherwise ``vote.values``
    holds every rank's ``vote.value``; with ``same`` they must all be equal. Without ranks the block
    just runs, its errors unchanged.

    Only Exception is agreed on: an interrupt unwinds this rank, and the others learn of it when
    its connections close."""
    vote = Vote()
    if ranks is None:
        yield vote
        vote.values = [vote.value]
        return
    failure: Optional[BaseException] = None
    try:
        yield vote
    except Exception as exc:  # told to every rank below
        failure = exc
    said = ranks.all_gather((error.describe(failure), None) if failure is not None else (None, vote.value))
    failed = {rank: message for rank, (message, _) in enumerate(said) if message is not None}
    if failed:
        if own and failure is not None:
            if len(failed) > 1:
                failure.add_note(f"pyckpt: {what} failed on ranks {sorted(failed)}")
            raise failure
        raise error(what, failed, ranks.size) from failure
    vote.values = [value for _, value in said]
    if same and any(v != vote.values[0] for v in vote.values):
        differing = {rank: f"{v!r} (rank 0: {vote.values[0]!r})" for rank, v in enumerate(vote.values)
                     if v != vote.values[0]}
        raise error(f"{what} (the ranks disagree: are the inputs, pyckpt versions and arguments the "
                               "same on every node?)", differing, ranks.size)
