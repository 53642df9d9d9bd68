"""Which names a checkpoint tag may take: one rule for the save that names a tag folder, the replica
receiver that takes a tag from a peer, and the node manifest that records one, so that a tag one of
them takes is never one another refuses.

A tag is one folder name, not a hidden one (hidden names beside the checkpoints are pyckpt's staging,
:mod:`.staging_names`), of at most ``TAG_MAX`` bytes of UTF-8 (the hidden names beside it must stay
one file name, and a peer receives the tag as UTF-8), not a pointer file's own name, and one that a
pointer file can name back (:mod:`.pointer`).
"""

from __future__ import annotations

from .pointer import POINTERS, pointer_name_problem
from .staging_names import TAG_MAX

_ONE_FOLDER = ("it must be one folder name not starting with '.' (hidden names beside the checkpoints are pyckpt's "
               "staging)")


def tag_problem(tag: str) -> str:
    """Why ``tag`` cannot name a checkpoint's folder, or '' if it can: one phrase, to follow the tag
    in a message."""
    if not tag:
        return f"is empty; {_ONE_FOLDER}"
    if tag in (".", ".."):
        return f"is '.' or '..'; {_ONE_FOLDER}"
    if "/" in tag:
        return f"contains a slash; {_ONE_FOLDER}"
    if tag.startswith("."):
        return f"starts with '.'; {_ONE_FOLDER}"
    try:
        size = len(tag.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid UTF-8 (a peer receives a tag as UTF-8, and `latest` holds it as text)"
    if size > TAG_MAX:
        return (f"is {size} bytes long; a tag is at most {TAG_MAX} bytes of UTF-8 (the hidden names beside it "
                "must stay one file name)")
    if tag in POINTERS:
        return "is the name of the pointer file that names the newest checkpoint"
    problem = pointer_name_problem(tag)
    if problem:
        return f"{problem}: a tag must have no whitespace at either end and no control characters, so that " \
               "`latest` can name it"
    return ""
