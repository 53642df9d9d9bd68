"""Every process of a spread run plans the same bytes, and a real run's output lies apart from its input.

Planning runs on every process (it is cheap and needs no I/O beyond metadata); before anything is
written the processes compare digests of their plans, so a process that read a different checkpoint
(another mount, a file replaced meanwhile) stops the run everywhere instead of writing a mixed output.
"""

from __future__ import annotations

from typing import Callable

from .output_apart import check_apart


def agreed_plan(ranks, what: str, given_input, output: str, dry_run: bool, make_plan: Callable[[], tuple]) -> tuple:
    """``make_plan()``, whose result starts with (the checkpoint read, its plan), run by every process of
    ``ranks`` (or alone): every process must plan the same bytes, and a real run's output must lie apart
    from the checkpoint (:func:`check_apart`). A failure on any process fails every process
    (:func:`~pyckpt.execution.distributed.agreed`). Returns ``make_plan``'s result."""
    from .distributed import agreed, plan_digest  # on first use: a short command's start-up does without

    with agreed(ranks, what, same=True) as vote:
        result = make_plan()
        checkpoint, plan = result[0], result[1]
        if not dry_run:
            check_apart(given_input, checkpoint.folder, output, plan.input_files)
        if ranks:
            vote.value = plan_digest(plan)
    return result
