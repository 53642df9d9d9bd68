"""One run of a format's writer, the same for every output format: every process plans, the plans
agree, the output is published complete or not at all, and the report says what was written.

A format (the Universal Checkpoint, the Hugging Face export, the DCP export) brings only its planner and
its report; the order of the steps, what a dry run stops at and how a spread run shares the writing are
decided here once.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ..errors import check_workers
from .distributed import several
from .plan_agreement import agreed_plan
from .pointer import check_pointer_name
from .publish import write_published
from .report import WrittenReport


def run_writer(what: str, input, output, make_plan: Callable[[str, object], tuple],
               make_report: Callable[[tuple, str], WrittenReport], *, pointer: Optional[str], overwrite: bool,
               dry_run: bool, workers: Optional[int], progress: bool, fsync: bool,
               notify: Optional[Callable[[str], None]], ranks) -> WrittenReport:
    """Plan (``make_plan(output, ranks)``: a tuple starting with the checkpoint read and its plan) on
    every process of ``ranks`` (or alone), agree, and unless ``dry_run`` write and publish the output
    with its ``pointer`` file (None: none). ``make_report(planned, output)`` makes the report, whose
    ``took(stats, seconds)`` then records the write; a dry run's report carries the plan's text instead.
    ``output`` is made absolute first; with a pointer its name is checked before anything is read."""
    t0 = time.perf_counter()
    check_workers(workers)
    ranks = several(ranks)
    output = os.path.abspath(os.fspath(output))
    if pointer is not None:
        check_pointer_name(output, pointer)
    planned = agreed_plan(ranks, f"planning the {what}", input, output, dry_run, lambda: make_plan(output, ranks))
    report = make_report(planned, output)
    if dry_run:
        report.plan_text = planned[1].describe()
        return report
    stats = write_published(planned[1], output, overwrite=overwrite, fsync=fsync, pointer=pointer, workers=workers,
                            progress=progress, notify=notify, ranks=ranks)
    report.took(stats, time.perf_counter() - t0)
    return report
