"""How a save's failure reaches the caller: one line naming every failing rank, then raised or warned.

Every rank ends a collective save with the same outcome; ``on_error`` decides what the caller sees:
``"raise"`` raises :class:`~pyckpt.errors.SaveError` on every rank, ``"warn"`` logs the line once
(rank 0, logger ``pyckpt``) and returns False on every rank, so that training can go on.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from ...errors import SaveError

log = logging.getLogger("pyckpt")


def failed_ranks(outcomes: List[Optional[str]]) -> str:
    """``rank r: why; ...`` for every rank whose outcome is a failure (a message), '' when none failed."""
    bad = [(r, m) for r, m in enumerate(outcomes) if m]
    return "; ".join(f"rank {r}: {m}" for r, m in bad)


def report_failure(message: str, on_error: str, rank: int, published: bool) -> bool:
    """SaveError (``on_error="raise"``), or the message logged once and False (``"warn"``)."""
    if on_error == "raise":
        raise SaveError(message, published=published)
    if rank == 0:
        log.warning("pyckpt: %s", message)
    return False
