"""Rank 0's end of a durable save: the agreed outcome turned into a published checkpoint, or into nothing.

Publication happens only when every rank's outcome is a success, and only over a folder that is a
checkpoint of the same model (checked again under the output lock: it may have appeared since the
preflight). On any failure the staging folder goes with the publisher and ``latest`` stays as it
was; the message says what ``latest`` still names. ``keep_last`` prunes after a publication
(:mod:`.retention`); a pruning that fails only warns, the save itself being complete.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from ...execution.distributed import describe_failure
from ...execution.publisher import Publisher
from .outcome import failed_ranks
from .retention import keep_last, read_checkpoint, read_pointer, replace_problem

log = logging.getLogger("pyckpt")


def publish_checkpoint(publisher: Publisher, outcomes: List[Optional[str]], save_dir: str, tag: str):
    """Rank 0: (True, None) once published, else (False, why). The staging folder goes either way
    (renamed into place, or removed when the publisher is left)."""
    if any(outcomes):
        latest = _read_latest(save_dir)
        kept = f"latest still names {latest}" if latest else "there is no latest file"
        return False, (f"checkpoint {tag} was not saved in {save_dir}: {failed_ranks(outcomes)}. Nothing was "
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


def prune_after(save_dir: str, k: int, tag: str) -> None:
    """``keep_last=k`` once ``tag`` is published."""
    try:
        keep_last(save_dir, k, newest=tag)
    except Exception as exc:  # the save itself is complete; say why older ones stay
        log.warning("pyckpt: keep_last=%d could not prune %s: %s", k, save_dir, describe_failure(exc))


def _read_latest(save_dir: str) -> Optional[str]:
    try:
        return read_pointer(save_dir, "latest")
    except OSError:  # a message names what latest holds only when it is a plain file of the folder
        return None
