"""A conversion plan: which output files exist and where each of their bytes comes from.

Format rules (ZeRO-1/2, ZeRO-3, ...) only build a Plan. It is plain data, cheap to build and to
print (``--dry-run``); :meth:`Plan.execute` hands it to the native executor, which copies the bytes
in parallel with the GIL released and streams them into the output archives.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .native import _core
from .archive import open_regular
from .errors import CheckpointFormatError, InputChangedError, PlanCheckError
from .names import check_relpath
from .safe_pickle import ITEMSIZE, StorageRef
from .torch_pickle import NewTensor, dumps

# What the executor can do to a source element on its way to a float32 output (Tensor.float()).
CONVERT_TO_F32 = {
    "float32": 0,
    "bfloat16": _core.KIND_BF16_TO_F32,
    "float16": _core.KIND_F16_TO_F32,
    "float64": _core.KIND_F64_TO_F32,
    "int64": _core.KIND_I64_TO_F32,
    "int32": _core.KIND_I32_TO_F32,
    "int16": _core.KIND_I16_TO_F32,
    "int8": _core.KIND_I8_TO_F32,
    "uint8": _core.KIND_U8_TO_F32,
    "bool": _core.KIND_BOOL_TO_F32,
}


@dataclass
class Piece:
    """Bytes [src_off, src_off+nbytes) of a source file land at dst_off of a new tensor."""

    src: Any  # pyckpt.archive.SourceFile
    src_off: int
    nbytes: int
    dst_off: int
    kind: int = 0
    rows: int = 1
    stride: int = 0


class Segments:
    """A virtual flat byte string made of source ranges: a fragment concatenation not yet copied.

    Conversions compose slicing and concatenation (ZeRO fragments -> an EP rank's local experts ->
    rows of the full expert tensor) on these, and only the final pieces become copy ops.
    """

    def __init__(self, parts=()):
        self.parts: List[Tuple[Any, int, int]] = []  # (source file, absolute offset, nbytes)
        self.nbytes = 0
        for sf, off, n in parts:
            self.append(sf, off, n)

    def append(self, sf, off: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        last = self.parts[-1] if self.parts else None
        if last is not None and last[0] is sf and last[1] + last[2] == off:
            self.parts[-1] = (sf, last[1], last[2] + nbytes)  # adjacent ranges merge into one copy
        else:
            self.parts.append((sf, off, nbytes))
        self.nbytes += nbytes

    def extend(self, other: "Segments") -> None:
        for sf, off, n in other.parts:
            self.append(sf, off, n)

    def slice(self, start: int, nbytes: int) -> "Segments":
        if start < 0 or nbytes < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"byte range [{start}, {start + nbytes}) outside a {self.nbytes}-byte segment list")
        out = Segments()
        pos = 0
        end = start + nbytes
        for sf, off, n in self.parts:
            lo, hi = max(start, pos), min(end, pos + n)
            if lo < hi:
                out.append(sf, off + (lo - pos), hi - lo)
            pos += n
            if pos >= end:
                break
        return out

    def pieces(self, dst_off: int = 0) -> List["Piece"]:
        out = []
        for sf, off, n in self.parts:
            out.append(Piece(sf, off, n, dst_off))
            dst_off += n
        return out

    def read(self) -> bytes:
        return b"".join(sf.read_bytes(off, n) for sf, off, n in self.parts)


@dataclass
class ArchiveOut:
    relpath: str
    obj: Any


@dataclass
class FileCopy:
    src: Any  # pyckpt.archive.SourceFile, parsed and checked like every file pyckpt reads
    relpath: str


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


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Plan:
    archives: List[ArchiveOut] = field(default_factory=list)
    copies: List[FileCopy] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # what a --dry-run should tell besides the files

    _relpaths: set = field(default_factory=set, repr=False)

    def _claim(self, relpath: str) -> str:
        check_relpath(relpath)
        if relpath in self._relpaths:
            # Two inputs (e.g. parameter names that differ only in ways a path does not show) would
            # silently land in one file; the second would replace the first.
            raise CheckpointFormatError(f"two outputs map to the same file {relpath!r}: refusing to let one replace "
                                        "the other")
        self._relpaths.add(relpath)
        return relpath

    def add_archive(self, relpath: str, obj: Any) -> None:
        self.archives.append(ArchiveOut(self._claim(relpath), obj))

    def add_copy(self, src, relpath: str) -> None:
        src.load()  # a file copied verbatim passes the same checks as one pyckpt parses
        src.check_copyable()
        self.copies.append(FileCopy(src, self._claim(relpath)))

    # -- compiling to the executor's tables --------------------------------------------------------
    def compile(self, root: str):
        """Returns (sources, outputs, ops, tensor_bytes) for _core.write_archives."""
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

        for out_idx, arc in enumerate(self.archives):
            pkl, storages = dumps(arc.obj)
            name = os.path.splitext(os.path.basename(arc.relpath))[0]
            records = [("data.pkl", len(pkl), pkl), (".format_version", 1, b"1"), (".storage_alignment", 2, b"64"),
                       ("byteorder", 6, b"little")]
            for st in storages:
                rec = len(records)
                nbytes = st.numel * ITEMSIZE[st.dtype]
                tensor_bytes += nbytes
                src = st.source
                if isinstance(src, NewTensor) and src.data is not None:
                    if len(src.data) != nbytes:
                        raise ValueError(f"{arc.relpath}: computed tensor holds {len(src.data)} bytes, expected {nbytes}")
                    records.append((f"data/{st.key}", nbytes, src.data))
                    continue
                records.append((f"data/{st.key}", nbytes, None))
                if isinstance(src, StorageRef):
                    sf = src.source
                    ops.append((src_id(sf), sf.storage_offset(src), out_idx, rec, 0, nbytes, 0, 1, 0))
                elif isinstance(src, NewTensor):
                    for p in src.pieces:
                        ops.append((src_id(p.src), p.src_off, out_idx, rec, p.dst_off, p.nbytes, p.kind, p.rows,
                                    p.stride))
                else:  # pragma: no cover - torch_pickle only produces the two kinds above
                    raise TypeError(type(src))
            records.append(("version", 2, b"3\n"))
            outputs.append((os.path.join(root, arc.relpath), name, records))
        table = np.array(ops, dtype=np.int64).reshape(-1, 9)
        return sources, outputs, table, tensor_bytes

    def execute(self, root: str, workers: Optional[int] = None, progress: bool = False,
                fsync: bool = False) -> Dict[str, int]:
        """Writes every output under ``root`` (which must exist). Returns byte counts.

        ``fsync`` makes every file and folder durable before returning (for power loss; the rename
        that publishes the output already makes it complete-or-absent for a killed process)."""
        dirs = {os.path.dirname(os.path.join(root, a.relpath)) for a in self.archives}
        dirs |= {os.path.dirname(os.path.join(root, c.relpath)) for c in self.copies}
        for d in sorted(dirs):
            os.makedirs(d, exist_ok=True)
        # Whole-file copies (model-state files) go through the kernel's copy path in a thread, so they
        # overlap with the native executor instead of adding to it (both release the GIL).
        copy_error = []

        def copy_all():
            try:
                for c in self.copies:
                    copy_checked(c.src, os.path.join(root, c.relpath), fsync)
            except BaseException as exc:  # reported on the calling thread
                copy_error.append(exc)

        sources, outputs, ops, tensor_bytes = self.compile(root)
        copier = threading.Thread(target=copy_all, name="pyckpt-copy")
        copier.start()
        bar = _ProgressBar(tensor_bytes) if progress else None
        try:
            result = _core.write_archives(sources, outputs, ops, workers or 0, fsync, bar.update if bar else None,
                                          root=root)
        except _core.PlanError as exc:
            raise PlanCheckError(f"{root}: the copy plan failed the executor's checks: {exc}") from None
        except _core.SourceChangedError as exc:
            raise InputChangedError(str(exc)) from None
        finally:
            copier.join()
            if bar:
                bar.close()
        if copy_error:
            raise copy_error[0]
        if fsync:
            for d in sorted(dirs | {root}, key=len, reverse=True):  # entries before their parents
                fsync_path(d)
        copied = sum(c.src.size for c in self.copies)
        return {"bytes_written": int(result["bytes_written"]) + copied, "tensor_bytes": tensor_bytes,
                "files": len(outputs) + len(self.copies), "copied_bytes": copied}

    # -- describing ----------------------------------------------------------------------------
    def describe(self, limit: int = 40) -> str:
        lines = []
        total = 0
        for arc in self.archives:
            _, storages = dumps(arc.obj)
            nbytes = sum(st.numel * ITEMSIZE[st.dtype] for st in storages)
            npieces = sum(len(st.source.pieces) if isinstance(st.source, NewTensor) else 1 for st in storages)
            total += nbytes
            if len(lines) < limit:
                lines.append(f"  {arc.relpath}: {nbytes} bytes from {npieces} piece(s)")
        if len(self.archives) > limit:
            lines.append(f"  ... and {len(self.archives) - limit} more archive(s)")
        for c in self.copies:
            lines.append(f"  {c.relpath}: copy of {c.src.path}")
        head = [f"{len(self.archives)} archive(s), {total} tensor bytes; {len(self.copies)} file copies"]
        return "\n".join(head + self.notes + lines)


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
