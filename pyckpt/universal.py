"""Writing a Universal Checkpoint folder, complete or not at all.

Everything is written into a hidden sibling folder; only when every file is complete is it renamed
to the output name, and only then is ``latest_universal`` (beside the output folder, naming it)
replaced. A crash leaves at most a ``.<name>.pyckpt-tmp-*`` folder that no loader looks at.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Optional

from .checkpoint import ZeroCheckpoint, discover
from .errors import OutputExistsError
from .plan import Plan, fsync_path
from .zero12 import plan_zero12
from .zero3 import plan_zero3


@dataclass
class ConversionReport:
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

    @property
    def gbps(self) -> float:
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        return (f"converted {self.params} parameters (ZeRO-{self.stage}, dp={self.dp}) to {self.output}: "
                f"{self.files} files, {self.bytes_written / 1e9:.3f} GB in {self.seconds:.2f} s "
                f"({self.gbps:.2f} GB/s)")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("plan_text")
        d["gbps"] = self.gbps
        return d


def build_plan(ck: ZeroCheckpoint, inject_missing_state: bool = False, dense_only: bool = False,
               strict: bool = True):
    plan = Plan()
    if ck.stage <= 2:
        counts = plan_zero12(ck, plan, inject_missing_state, dense_only, strict)
    else:
        counts = plan_zero3(ck, plan, strict)
    return plan, counts


def convert_to_universal(input, output, workers: Optional[int] = None, *, inject_missing_state: bool = False,
                         overwrite: bool = False, progress: bool = False, dry_run: bool = False,
                         strict: bool = True, dense_only: bool = False, fsync: bool = False) -> ConversionReport:
    """Convert a DeepSpeed ZeRO checkpoint (tag folder or its parent with ``latest``) to Universal format.

    ``output`` is the universal tag folder to create (e.g. ``ckpt/global_step100_universal``);
    ``latest_universal`` is written beside it, as DeepSpeed's ds_to_universal.py does.
    ``dense_only`` converts a checkpoint with native DeepSpeed-MoE expert files (no AutoEP metadata)
    without its experts, as ds_to_universal.py does; without it such input is refused.
    ``strict=False`` (``--no_strict``) only warns about tensor-parallel merge patterns that match no parameter.

    The output is complete or absent whatever happens to this process: it is written into a hidden
    sibling folder, renamed into place when complete, and ``latest_universal`` is replaced after that.
    ``fsync=True`` (``--fsync``) also makes it survive a power loss: every file and folder is flushed
    before the rename and ``latest_universal`` after it. Off by default, as for ``cp`` and DeepSpeed:
    flushing waits for the disk, which otherwise writes back while the next job runs.
    """
    t0 = time.perf_counter()
    ck = discover(input)
    plan, counts = build_plan(ck, inject_missing_state, dense_only, strict)
    output = os.path.abspath(os.fspath(output))
    report = ConversionReport(ck.folder, output, ck.stage, ck.dp, ck.tp, ck.pp, counts["params"], 0, 0,
                              len(plan.archives) + len(plan.copies), 0.0)
    if dry_run:
        report.plan_text = plan.describe()
        return report
    if os.path.exists(output) and not overwrite:
        raise OutputExistsError(f"{output} already exists (pass --overwrite to replace it)")
    parent, base = os.path.split(output)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{base}.pyckpt-tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        stats = plan.execute(staging, workers, progress, fsync=fsync)
        _publish(staging, output)
        if fsync:
            fsync_path(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _write_atomic(os.path.join(parent, "latest_universal"), base, fsync)
    report.tensor_bytes = stats["tensor_bytes"]
    report.bytes_written = stats["bytes_written"]
    report.files = stats["files"]
    report.seconds = time.perf_counter() - t0
    return report


def _publish(staging: str, output: str) -> None:
    old = None
    if os.path.exists(output):
        old = f"{output}.pyckpt-old-{os.getpid()}"
        os.rename(output, old)
    os.rename(staging, output)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: str, text: str, fsync: bool) -> None:
    tmp = f"{path}.pyckpt-tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_path(os.path.dirname(path))
