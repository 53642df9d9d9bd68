"""Running a plan into a published output, by one process or by several sharing it out.

The executor writes into the staging folder of a :class:`~.publisher.Publisher`, which then puts the
output in place (one atomic rename, then the pointer file). Several processes share the output files
out among them; rank 0 alone holds the output's lock and publishes, and only once every rank's files
are written, so a failure anywhere leaves no output and no staging folder.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

from ..errors import RanksFailedError
from .fault_points import rank_fault_point
from .publisher import Publisher


def write_published(plan, output: str, *, overwrite: bool = False, fsync: bool = False,
                    pointer: Optional[str] = "latest_universal", workers: Optional[int] = None,
                    progress: bool = False, notify: Optional[Callable[[str], None]] = None, ranks=None) -> dict:
    """Runs ``plan`` into a staging folder beside ``output`` and publishes it (see :class:`Publisher`).

    An exception raised once the output is in place carries ``pyckpt_published`` (the output),
    ``pyckpt_pointer`` (the pointer file's name, or None) and ``pyckpt_pointer_written``, so the
    caller can tell the user what is on disk although the run did not finish.

    With ``ranks`` (a :class:`~pyckpt.execution.distributed.TorchRanks` of more than one process,
    every one calling with the same plan and arguments) the output files are shared out among them
    (:func:`write_published_together`); the byte counts returned are the totals of all ranks."""
    from .distributed import several
    from .executor import execute

    if several(ranks):
        return write_published_together(plan, output, ranks, overwrite=overwrite, fsync=fsync, pointer=pointer,
                                        workers=workers, progress=progress, notify=notify)
    with Publisher(output, overwrite=overwrite, fsync=fsync, pointer=pointer, notify=notify) as out:
        try:
            stats = execute(plan, out.staging, workers, progress, fsync=fsync)
            out.publish()
        except BaseException as exc:
            if out.published:
                _mark_published(exc, output, pointer, out.pointer_written)
            raise
    return stats


def _mark_published(exc: BaseException, output: str, pointer: Optional[str], pointer_written: bool) -> None:
    exc.pyckpt_published = output
    exc.pyckpt_pointer = pointer
    exc.pyckpt_pointer_written = pointer_written


def write_published_together(plan, output: str, ranks, *, overwrite: bool = False, fsync: bool = False,
                             pointer: Optional[str] = "latest_universal", workers: Optional[int] = None,
                             progress: bool = False, notify: Optional[Callable[[str], None]] = None) -> dict:
    """:func:`write_published` by several processes: rank 0 locks, cleans and makes the staging folder,
    every rank writes its share of the files into it, and only when all succeeded does rank 0 publish.
    A failure anywhere leaves no output and no staging folder, and raises
    :class:`~pyckpt.errors.RanksFailedError` on every rank."""
    from .distributed import agreed, describe_failure, split_outputs
    from .executor import execute

    share = split_outputs(plan, ranks.size)[ranks.rank]
    lead = ranks.rank == 0
    with contextlib.ExitStack() as stack:
        with agreed(ranks, "preparing the output") as vote:
            if lead:
                # rank 0 holds the lock to the end; leaving this block by any route removes staging
                out = stack.enter_context(Publisher(output, overwrite=overwrite, fsync=fsync, pointer=pointer,
                                                    notify=notify))
                vote.value = out.staging
        staging = vote.values[0]
        with agreed(ranks, "writing the output files") as vote:
            vote.value = execute(share, staging, workers, progress, fsync=fsync)
            rank_fault_point(ranks.rank)
        totals = {key: sum(stats[key] for stats in vote.values) for key in vote.values[0]}
        # Publishing is rank 0's alone; the others wait on its outcome (one broadcast), so that they
        # too return only once the output is in place, or raise when it is not.
        failure, outcome = None, None
        if lead:
            try:
                out.publish()
            except Exception as exc:
                failure = exc
                outcome = (describe_failure(exc), out.published, out.pointer_written)
        outcome = ranks.broadcast(outcome)
        if outcome is not None:
            message, published, pointer_written = outcome
            error = RanksFailedError("publishing the output", {0: message}, ranks.size)
            if published:
                _mark_published(error, output, pointer, pointer_written)
            raise error from failure
    return totals

