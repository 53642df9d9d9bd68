"""Running a plan: the native executor writes the archives and raw files, the kernel copies whole files.

:func:`compile_plan` turns a :class:`~pyckpt.planning.plan.Plan` into the executor's tables (the
torch.save record layout of every archive, the records of every raw file, and the op rows that
fill them);
:func:`execute` runs them into a staging folder, with progress and, on request, fsync.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import threading
from typing import Dict, List, Optional, Tuple

from ..errors import CheckpointFormatError
from ..tensors import ITEMSIZE, NewTensor
from ..formats.pickle_read import StorageRef
from ..formats.pickle_write import dumps
from ..formats.torch_zip import open_regular
from ..native import execute_into, op_table, series_layout, write_archives
from ..planning.plan import Plan
from ..planning.collector import pauses_collector
from .durable import fsync_path


# The top folder of each archive in a series: what torch.save names it when writing to a stream
# (torch.distributed.checkpoint's data files hold such archives).
SERIES_ARCHIVE_NAME = "archive"


def copy_checked(src, dst: str, fsync: bool = False) -> None:
    """Copies the checked file ``src`` (a SourceFile) to a new file ``dst`` inside the kernel.

    The copy must have the size that was checked: a file replaced or truncated since it was parsed
    is refused rather than copied unchecked. ``dst`` must not exist (no planted file or link is
    followed or overwritten)."""
    fin = open_regular(src.path)
    try:
        if os.fstat(fin).st_size != src.size:
            raise CheckpointFormatError(f"{src.path}: the file changed size since it was checked ({src.size} -> "
                                        f"{os.fstat(fin).st_size} bytes)")
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            left = src.size
            use_cfr = hasattr(os, "copy_file_range")
            while left > 0:
                n = 0
                if use_cfr:
                    try:
                        n = os.copy_file_range(fin, fout, left)
                    except OSError as exc:  # e.g. across filesystems on older kernels
                        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                            raise
                        use_cfr = False
                        continue
                else:
                    n = os.sendfile(fout, fin, None, left)
                if n == 0:
                    raise CheckpointFormatError(f"{src.path}: the file shrank while being copied")
                left -= n
            if fsync:
                os.fsync(fout)
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, f"copy to {dst}: {os.strerror(exc.errno)}") from None
        finally:
            os.close(fout)
        shutil.copystat(src.path, dst)
    finally:
        os.close(fin)


def _archive_records(obj):
    """What a torch.save archive of ``obj`` holds, as torch.save lays it out: the records before its
    storages (name, size, bytes), the storages (one ``data/<key>`` record each), the records after."""
    pkl, storages = dumps(obj)
    head = [("data.pkl", len(pkl), pkl), (".format_version", 1, b"1"), (".storage_alignment", 2, b"64"),
            ("byteorder", 6, b"little")]
    return head, storages, [("version", 2, b"3\n")]


def series_locations(members) -> List[Tuple[int, int]]:
    """(offset, length) of each archive of a file of ``members`` (Plan.add_archive_series), as the
    executor will write it."""
    records, starts = [], []
    for obj in members:
        starts.append(len(records))
        head, storages, tail = _archive_records(obj)
        records += [(name, size) for name, size, _ in head]
        records += [(f"data/{st.key}", st.numel * ITEMSIZE[st.dtype]) for st in storages]
        records += [(name, size) for name, size, _ in tail]
    return [tuple(x) for x in series_layout(SERIES_ARCHIVE_NAME, records, starts)]


@pauses_collector
def compile_plan(plan: Plan, root: str):
    """(sources, outputs, op table, tensor bytes) for :func:`pyckpt.native.write_archives`."""
    sources: List[str] = []
    source_index: Dict[int, int] = {}
    outputs = []
    ops: List[Tuple[int, ...]] = []
    tensor_bytes = 0

    def src_id(sf) -> int:
        i = source_index.get(id(sf))
        if i is None:
            i = len(sources)
            source_index[id(sf)] = i
            sources.append(sf.path)
        return i

    def add_members(relpath: str, out_idx: int, obj, records: list) -> None:
        """The records of one torch.save archive of ``obj`` appended to ``records``, and the ops
        that fill its tensors."""
        nonlocal tensor_bytes
        head, storages, tail = _archive_records(obj)
        records += head
        for st in storages:
            rec = len(records)
            nbytes = st.numel * ITEMSIZE[st.dtype]
            tensor_bytes += nbytes
            src = st.source
            if isinstance(src, NewTensor) and src.data is not None:
                if len(src.data) != nbytes:
                    raise ValueError(f"{relpath}: computed tensor holds {len(src.data)} bytes, expected {nbytes}")
                records.append((f"data/{st.key}", nbytes, src.data))
                continue
            records.append((f"data/{st.key}", nbytes, None))
            if isinstance(src, StorageRef):
                sf = src.source
                ops.append((src_id(sf), sf.storage_offset(src), out_idx, rec, 0, nbytes, 0, 1, 0))
            elif isinstance(src, NewTensor):
                for p in src.pieces:
                    ops.append((src_id(p.src) if p.src is not None else -1, p.src_off, out_idx, rec, p.dst_off,
                                p.nbytes, p.kind, p.rows, p.stride))
            else:  # pragma: no cover - torch_pickle only produces the two kinds above
                raise TypeError(type(src))
        records += tail

    for arc in plan.archives:
        records = []
        add_members(arc.relpath, len(outputs), arc.obj, records)
        outputs.append((os.path.join(root, arc.relpath), os.path.splitext(os.path.basename(arc.relpath))[0], records))
    for ser in plan.series:
        records, starts = [], []
        for obj in ser.members:
            starts.append(len(records))
            add_members(ser.relpath, len(outputs), obj, records)
        outputs.append((os.path.join(root, ser.relpath), SERIES_ARCHIVE_NAME, records, starts))
    for raw in plan.raw_files:
        out_idx = len(outputs)
        records = [("head", len(raw.head), raw.head)] if raw.head else []
        for tname, t in raw.tensors:
            rec = len(records)
            nbytes = t.numel() * ITEMSIZE[t.dtype]
            tensor_bytes += nbytes
            if t.data is not None:
                if len(t.data) != nbytes:
                    raise ValueError(f"{raw.relpath}: computed tensor {tname} holds {len(t.data)} bytes, expected {nbytes}")
                records.append((tname, nbytes, t.data))
                continue
            records.append((tname, nbytes, None))
            for p in t.pieces:
                ops.append((src_id(p.src) if p.src is not None else -1, p.src_off, out_idx, rec, p.dst_off, p.nbytes,
                            p.kind, p.rows, p.stride))
        outputs.append((os.path.join(root, raw.relpath), None, records))
    return sources, outputs, op_table(ops), tensor_bytes


def execute(plan: Plan, root: str, workers: Optional[int] = None, progress: bool = False,
            fsync: bool = False) -> Dict[str, int]:
    """Writes every output under ``root`` (which must exist). Returns byte counts.

    ``fsync`` makes every file and folder durable before returning (for power loss; the rename
    that publishes the output already makes it complete-or-absent for a killed process)."""
    dirs = {os.path.dirname(os.path.join(root, a.relpath)) for a in plan.archives}
    dirs |= {os.path.dirname(os.path.join(root, c.relpath)) for c in plan.copies}
    dirs |= {os.path.dirname(os.path.join(root, r.relpath)) for r in plan.raw_files}
    dirs |= {os.path.dirname(os.path.join(root, r.relpath)) for r in plan.series}
    for d in sorted(dirs):
        os.makedirs(d, exist_ok=True)
    # Whole-file copies (model-state files) go through the kernel's copy path in a thread, so they
    # overlap with the native executor instead of adding to it (both release the GIL).
    copy_error = []

    def copy_all():
        try:
            for c in plan.copies:
                copy_checked(c.src, os.path.join(root, c.relpath), fsync)
        except BaseException as exc:  # reported on the calling thread
            copy_error.append(exc)

    sources, outputs, ops, tensor_bytes = compile_plan(plan, root)
    # Only on a terminal, where tqdm (disable=None) would draw it anyway. Elsewhere none is made, so
    # a Ctrl-C cannot land in tqdm's constructor, whose half-made instance prints a traceback when
    # freed. Made before the copier starts: an interrupt here then leaves no thread running.
    bar = _ProgressBar(tensor_bytes) if progress and getattr(sys.stderr, "isatty", lambda: False)() else None
    copier = threading.Thread(target=copy_all, name="pyckpt-copy")
    copier.start()
    try:
        result = write_archives(sources, outputs, ops, root=root, workers=workers or 0, fsync=fsync,
                                progress=bar.update if bar else None)
    finally:
        copier.join()
        if bar:
            bar.close()
    if copy_error:
        raise copy_error[0]
    if fsync:
        for d in sorted(dirs | {root}, key=len, reverse=True):  # entries before their parents
            fsync_path(d)
    copied = sum(c.src.size for c in plan.copies)
    return {"bytes_written": int(result["bytes_written"]) + copied, "tensor_bytes": tensor_bytes,
            "files": len(outputs) + len(plan.copies), "copied_bytes": copied}


class _ProgressBar:
    """tqdm on stderr, fed from the executor's progress callback."""

    def __init__(self, total: int):
        from tqdm import tqdm
        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                         desc="pyckpt", leave=False, disable=None)
        self._last = 0

    def update(self, done: int, total: int) -> None:
        # The executor counts archive headers too; follow its total so the bar ends at 100%.
        if total != self._bar.total:
            self._bar.total = total
        if done > self._last:
            self._bar.update(done - self._last)
            self._last = done

    def close(self) -> None:
        self._bar.close()


def gather_tensor(t: NewTensor, dst, workers: int = 0) -> None:
    """Fills the writable buffer ``dst`` (``t``'s bytes, contiguous) from ``t``'s pieces: only
    those byte ranges of the mapped sources are read."""
    if t.data is not None:
        memoryview(dst).cast("B")[:len(t.data)] = t.data
        return
    sources: List[str] = []
    index: Dict[int, int] = {}
    rows = []
    for p in t.pieces:
        if p.src is None:
            s = -1
        else:
            s = index.setdefault(id(p.src), len(sources))
            if s == len(sources):
                sources.append(p.src.path)
        rows.append((s, p.src_off, 0, 0, p.dst_off, p.nbytes, p.kind, p.rows, p.stride))
    if rows:
        execute_into(sources, op_table(rows), dst, workers)
