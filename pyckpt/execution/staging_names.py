"""The hidden names a run gives its entries beside an output, and the one rule that reads them back.

Beside OUTPUT (``<parent>/<base>``) a run keeps ``.<base>.pyckpt-tmp-<owner>`` (its staging folder),
``.<base>.pyckpt-old-<owner>`` (an old output set aside by a swap without ``RENAME_EXCHANGE``),
``.<base>.pyckpt-ptr-<owner>`` (a pointer file being written) and ``.<base>.pyckpt-lock`` (the
output's lock). Whoever makes such a name, and whoever later asks which output an entry belongs to
(cleaning one output, or finding the outputs of a folder that killed runs left something beside),
goes through this module, so that a name one side writes is always a name the other side finds.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

STAGING, OLD, POINTER_TMP, LOCK = "pyckpt-tmp", "pyckpt-old", "pyckpt-ptr", "pyckpt-lock"
# The longest checkpoint tag, in bytes of UTF-8: a tag must leave room for the hidden names beside it
# (``.<tag>.pyckpt-tmp-<host, up to 64>-<pid>-<8 hex>`` adds up to about 100 bytes) within one file name
# of 255 bytes. One limit for every tag: the save refuses what a replica's receiver would refuse.
TAG_MAX = 128
# The kinds a run leaves with its owner id after them; the lock file carries none.
OWNED = (STAGING, OLD, POINTER_TMP)


def owner_id() -> str:
    # os.uname and os.urandom rather than socket and secrets: the same name and randomness, without
    # their imports (a tenth of a short export's start-up)
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", os.uname().nodename)[:64] or "host"
    return f"{host}-{os.getpid()}-{os.urandom(4).hex()}"


def hidden_name(base: str, kind: str, owner: str = "") -> str:
    """The entry of ``kind`` beside output ``base``: ``.<base>.<kind>-<owner>``, or the lock's
    ``.<base>.pyckpt-lock``."""
    return f".{base}.{LOCK}" if kind == LOCK else f".{base}.{kind}-{owner}"


def _shape(base: str) -> "re.Pattern[str]":
    # an owner of any length: a name that starts like a run's entry is treated as one
    return re.compile(r"\.(%s)\.(?:(%s)-.*|(%s))" % (base, "|".join(OWNED), LOCK), re.S)


def _legacy_old(base: str) -> "re.Pattern[str]":
    # pyckpt 0.1 set a swapped-out output aside as ``<base>.pyckpt-old-<pid>`` and took no lock
    return re.compile(r"%s\.%s-\d+" % (base, OLD), re.S)


# Any base: the longest one that still leaves a kind after it.
_ANY = _shape(".+")


def leftover(name: str, base: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """(the output's base name, the kind) if ``name`` is an entry a run leaves beside an output,
    else None. With ``base``, only entries of that output count, the legacy swap name included;
    without it, the hidden entries of any output (a legacy name has no lock to guard its removal)."""
    if base is None:
        m = _ANY.fullmatch(name)
        return (m.group(1), m.group(2) or m.group(3)) if m else None
    m = _shape(re.escape(base)).fullmatch(name)
    if m:
        return base, m.group(2) or m.group(3)
    return (base, OLD) if _legacy_old(re.escape(base)).fullmatch(name) else None
