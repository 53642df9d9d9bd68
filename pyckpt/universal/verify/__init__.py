"""Checking a Universal Checkpoint folder before the ZeRO checkpoint it came from is deleted.

``pyckpt verify OUTPUT [--against INPUT]`` (or :func:`verify_universal`) reads every file
of a universal folder with pyckpt's safe reader (nothing is unpickled with code execution), checks
every ZIP member against its CRC-32, and checks that each parameter has what DeepSpeed's
``load_universal`` reads (``universal_checkpoint.load_hp_checkpoint_state`` and the ZeRO-3 loader):
``zero/<name>/fp32.pt`` plus the optimizer-state files the other parameters have, as a
``{'param': tensor, ...}`` dict (ZeRO-3 dense: a raw tensor), float32, equal shapes, shapes that fit
the ``param_shapes`` of the copied model-state files. ``against`` also plans the conversion of the
ZeRO checkpoint with pyckpt's own planner (writing nothing) and compares file list, shapes, dtypes,
byte counts and the CRC-32 of every planned tensor with the files present.

Problems are collected, not raised: a user deciding whether to delete the source wants the whole
list in one run. Only an OUTPUT that is not a universal folder at all, or an INPUT that cannot be
read, raises (:class:`VerifyInputError`).

Split by concern: the report (:mod:`.report`), which folder is checked (:mod:`.folders`), the
layout's rules on the files present (:mod:`.layout_rules`, with the ZIP CRC check of
:mod:`pyckpt.formats.zip_integrity`), and the comparison with a fresh plan (:mod:`.against`).

Import rule: as :mod:`pyckpt.universal`.
"""

from __future__ import annotations

import os

from ...errors import VerifyInputError
from .against import verify_against
from .folders import resolve_universal_folder
from .layout_rules import CheckedFiles, verify_folder
from .report import Problem, Progress, VerifyReport

__all__ = ["verify_universal", "VerifyReport", "Problem", "resolve_universal_folder", "VerifyInputError"]


def verify_universal(output, *, against=None, inject_missing_state: bool = True, dense_only: bool = False,
                     content: bool = True, progress: bool = False) -> VerifyReport:
    """Check a Universal Checkpoint folder (or the folder holding ``latest_universal``).

    Returns a :class:`VerifyReport`; ``report.ok`` is False with one :class:`Problem` per defect.
    With ``against`` (the ZeRO checkpoint it was converted from) the conversion is planned again and
    the output compared with the plan: same files, shapes, dtypes and byte counts, and (``content``)
    the CRC-32 of every planned tensor. Raises VerifyInputError when OUTPUT is not a universal folder
    or INPUT cannot be read; nothing is written, nothing is unpickled with code execution.
    """
    report = VerifyReport(os.path.abspath(os.fspath(output)))
    folder = resolve_universal_folder(output, report)
    if folder is None:
        return report
    folder = os.path.abspath(folder)
    report.output = folder
    bar = Progress(folder) if progress else None
    files = CheckedFiles(report, bar.update if bar else None)
    try:
        verify_folder(folder, report, files)
        if against is not None:
            report.against = os.path.abspath(os.fspath(against))
            verify_against(folder, against, report, files, inject_missing_state, dense_only, content)
    finally:
        if bar:
            bar.close()
    return report
