"""The pointer files of a save folder (``latest``, ``latest_universal``) and which names they can hold.

DeepSpeed finds a checkpoint again by reading a pointer file as ``read().strip()``; a name that
would not survive that (whitespace at either end) or that breaks a one-line file and every message
naming it (a control character) cannot be published behind a pointer. The rule lives here, below
both the publisher and the save front end, so that the two refuse the same names.
"""

from __future__ import annotations

import os

from ..errors import PointerNameError
from .control_characters import first_control

# The pointer files of a save folder: part of the checkpoint whichever of them led to the tag folder.
POINTERS = ("latest", "latest_universal")


def pointer_name_problem(name: str) -> str:
    """Why a pointer file (``latest``, ``latest_universal``) holding ``name`` would not lead DeepSpeed
    back to the folder of that name, or '' if it would. DeepSpeed reads a pointer as
    ``read().strip()``; a control character is refused too (a newline or an escape sequence in a
    one-line pointer file and in every message that names it)."""
    if name != name.strip():
        return "starts or ends with whitespace, which DeepSpeed strips when it reads the name back"
    bad = first_control(name)
    if bad:
        return f"contains the control character {bad!r}"
    return ""


def check_pointer_name(output: str, pointer: str) -> None:
    """PointerNameError unless ``pointer`` beside ``output`` can name it (see :func:`pointer_name_problem`)."""
    parent, base = os.path.split(os.path.abspath(os.fspath(output)))
    problem = pointer_name_problem(base)
    if problem:
        raise PointerNameError(f"{parent}: the output folder name {base!r} {problem}; {pointer}, which names it, "
                               "would not lead DeepSpeed back to it. Choose a name without whitespace at either "
                               "end or control characters")
