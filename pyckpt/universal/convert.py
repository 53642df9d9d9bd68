"""Writing a Universal Checkpoint folder, complete or not at all.

Everything is written into a hidden sibling folder; only when every file is complete is it renamed
to the output name, and only then is ``latest_universal`` (beside the output folder, naming it)
replaced. A crash leaves at most a ``.<name>.pyckpt-tmp-*`` folder that no loader looks at.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..zero.discovery import discover
from .write import build_plan
from ..errors import check_workers, metadata_errors
from ..execution.distributed import several
from ..execution.publish import agreed_plan, check_pointer_name, write_published
from ..execution.report import WrittenReport


@dataclass
class ConversionReport(WrittenReport):
    input: str
    output: str
    stage: int
    dp: int
    tp: int
    pp: int
    params: int
    tensor_bytes: int
    bytes_written: int
    files: int
    seconds: float
    plan_text: str = ""

    def summary(self) -> str:
        return (f"converted {self.params} parameters (ZeRO-{self.stage}, dp={self.dp}) to {self.output}: "
                f"{self.files} files, {self.written()}")


def convert_to_universal(input, output, *, workers: Optional[int] = None, inject_missing_state: bool = False,
                         overwrite: bool = False, progress: bool = False, dry_run: bool = False,
                         strict: bool = True, dense_only: bool = False, fsync: bool = False,
                         notify: Optional[Callable[[str], None]] = None, ranks=None) -> ConversionReport:
    """Convert a DeepSpeed ZeRO checkpoint (tag folder or its parent with ``latest``) to Universal format.

    ``output`` is the universal tag folder to create (e.g. ``ckpt/global_step100_universal``);
    ``latest_universal`` is written beside it, as DeepSpeed's ds_to_universal.py does.
    ``dense_only`` converts a checkpoint with native DeepSpeed-MoE expert files (no AutoEP metadata)
    without its experts, as ds_to_universal.py does; without it such input is refused.
    ``strict=False`` (``--no_strict``) only warns about tensor-parallel merge patterns that match no parameter.

    The output is complete or absent whatever happens to this process: it is written into a hidden
    sibling folder, renamed into place when complete, and ``latest_universal`` is replaced after that.
    An existing ``output`` is replaced only with ``overwrite=True``, by an atomic exchange; runs into
    one output take turns under a lock beside it, and each run first removes what killed runs into
    that output left (see :mod:`pyckpt.execution.publish`). ``output`` may not be, contain or lie inside the
    checkpoint's tag folder, and its name may not start or end with whitespace or hold a control
    character (DeepSpeed strips what it reads from ``latest_universal``; such a name is refused at once).
    ``fsync=True`` (``--fsync``) also makes it survive a power loss: every file and folder is flushed
    before the rename and ``latest_universal`` after it. Off by default, as for ``cp`` and DeepSpeed:
    flushing waits for the disk, which otherwise writes back while the next job runs.

    ``ranks`` (:func:`pyckpt.execution.distributed.from_launcher`'s TorchRanks): the processes of a
    torch.distributed job share the work, every one calling with the same arguments. Each plans,
    the plans must agree, and each writes its share of the output files (balanced by bytes, so each
    reads about 1/K of the checkpoint) into one staging folder on the shared filesystem, which
    rank 0 publishes when all succeeded. The output is bit-equal to a single process's. Every rank
    returns the report with the totals of all, or raises :class:`~pyckpt.errors.RanksFailedError`
    naming each failing rank; nothing is published then.
    """
    t0 = time.perf_counter()
    check_workers(workers)
    ranks = several(ranks)
    output = os.path.abspath(os.fspath(output))
    check_pointer_name(output, "latest_universal")
    def make_plan():
        with metadata_errors(input):
            ck = discover(input)
        with metadata_errors(ck.folder):
            return (ck, ) + tuple(build_plan(ck, inject_missing_state, dense_only, strict))

    ck, plan, counts = agreed_plan(ranks, "planning the conversion", input, output, dry_run, make_plan)
    report = ConversionReport(ck.folder, output, ck.stage, ck.dp, ck.tp, ck.pp, counts["params"], 0, 0,
                              len(plan.archives) + len(plan.copies), 0.0)
    if dry_run:
        report.plan_text = plan.describe()
        return report
    stats = write_published(plan, output, overwrite=overwrite, fsync=fsync, workers=workers, progress=progress,
                            notify=notify, ranks=ranks)
    report.tensor_bytes = stats["tensor_bytes"]
    report.bytes_written = stats["bytes_written"]
    report.files = stats["files"]
    report.seconds = time.perf_counter() - t0
    return report
