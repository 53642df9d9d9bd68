"""Which folder a verification checks: the universal folder itself, or the one a
``latest_universal`` pointer names."""

from __future__ import annotations

import os
from typing import Optional

from ...errors import CheckpointFormatError, VerifyInputError, quoted
from ...formats.confined import read_small_text
from ...zero.names import check_tag
from ..layout import LATEST_UNIVERSAL, STATES_FOLDER
from .report import VerifyReport


def resolve_universal_folder(path, report: Optional[VerifyReport] = None) -> Optional[str]:
    """The universal folder itself, or the one the ``latest_universal`` inside ``path`` names.

    A pointer that names nothing is a problem of the output (the resume would fail), so it goes
    into ``report`` and None comes back; a path that is neither raises VerifyInputError."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise VerifyInputError(f"{path}: not a folder")
    names = os.listdir(path)
    if STATES_FOLDER in names or any(n.endswith("_model_states.pt") for n in names):
        return path
    latest = os.path.join(path, LATEST_UNIVERSAL)
    if not os.path.lexists(latest):
        raise VerifyInputError(f"{path}: neither a universal checkpoint folder (no zero/ folder, no "
                               "*_model_states.pt) nor a folder holding latest_universal")
    try:
        tag = check_tag(read_small_text(path, LATEST_UNIVERSAL).strip(), latest)
    except CheckpointFormatError as exc:
        if report is None:
            raise
        report.add(latest, str(exc).replace(f"{latest}: ", "", 1))
        return None
    folder = os.path.join(path, tag)
    if not os.path.isdir(folder):
        if report is None:
            raise VerifyInputError(f"{latest} names {quoted(tag)}, but {folder} does not exist")
        report.add(latest, f"names {quoted(tag)}, but {folder} is not a folder: DeepSpeed's load_universal would fail")
        return None
    return folder
