"""Writing a Universal Checkpoint folder, complete or not at all.

Everything is written into a hidden sibling folder; only when every file is complete is it renamed
to the output name, and only then is ``latest_universal`` (beside the output folder, naming it)
replaced. A crash leaves at most a ``.<name>.pyckpt-tmp-*`` folder that no loader looks at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..zero.discovery import discover
from .write import build_plan
from ..errors import metadata_errors
from ..execution.writer_run import run_writer
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

    def took(self, stats: dict, seconds: float) -> None:
        super().took(stats, seconds)
        self.tensor_bytes = stats["tensor_bytes"]
        self.files = stats["files"]

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
    that output left (see :mod:`pyckpt.execution.publisher`). ``output`` may not be, contain or lie inside the
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
    def make_plan(output, ranks):
        with metadata_errors(input):
            ck = discover(input)
        with metadata_errors(ck.folder):
            return (ck, ) + tuple(build_plan(ck, inject_missing_state, dense_only, strict))

    def make_report(planned, output):
        ck, plan, counts = planned
        return ConversionReport(ck.folder, output, ck.stage, ck.dp, ck.tp, ck.pp, counts["params"], 0, 0,
                                len(plan.archives) + len(plan.copies), 0.0)

    return run_writer("conversion", input, output, make_plan, make_report, pointer="latest_universal",
                      overwrite=overwrite, dry_run=dry_run, workers=workers, progress=progress, fsync=fsync,
                      notify=notify, ranks=ranks)
