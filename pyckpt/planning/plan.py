"""A conversion plan: which output files exist and where each of their bytes comes from.

Format rules (ZeRO-1/2, ZeRO-3, ...) only build a Plan. It is plain data, cheap to build and to
print (``--dry-run``); :func:`pyckpt.execution.executor.execute` hands it to the native executor,
which copies the bytes in parallel with the GIL released and streams them into the output archives.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, List, Tuple

from ..errors import CheckpointFormatError, printable_line, quoted
from ..tensors import ITEMSIZE, NewTensor, Piece  # noqa: F401  (Piece: planners import it from here)
from ..formats.pickle_write import storages_of
from .collector import pauses_collector


def check_relpath(relpath: str) -> str:
    """An output path relative to the staging folder: no absolute path, no '.'/'..'/empty part."""
    parts = relpath.split("/")
    if (not relpath or relpath.startswith("/") or "\\" in relpath or "\x00" in relpath
            or any(p in ("", ".", "..") for p in parts)):
        raise CheckpointFormatError(f"refusing to write {quoted(relpath)}: output paths must stay inside the output "
                                    "folder")
    return relpath


class Segments:
    """A virtual flat byte string made of source ranges: a fragment concatenation not yet copied.

    Conversions compose slicing and concatenation (ZeRO fragments -> an EP rank's local experts ->
    rows of the full expert tensor) on these, and only the final pieces become copy ops.
    """

    # One per parameter and state while a plan is made, each holding a range per rank it spans: a
    # 70B-class model at dp 4,096 holds about 3.6 ranges a rank at once, kept packed (24 bytes a
    # range, not a tuple and its integers).
    __slots__ = ("_srcs", "_offs", "_lens", "nbytes")

    def __init__(self, parts=()):
        self._srcs: List[Any] = []  # source files
        self._offs = array("q")  # absolute offsets in them
        self._lens = array("q")  # byte counts
        self.nbytes = 0
        for sf, off, n in parts:
            self.append(sf, off, n)

    @property
    def parts(self) -> List[Tuple[Any, int, int]]:
        """(source file, absolute offset, nbytes) of each range, in order."""
        return list(zip(self._srcs, self._offs, self._lens))

    def append(self, sf, off: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        if self._srcs and self._srcs[-1] is sf and self._offs[-1] + self._lens[-1] == off:
            self._lens[-1] += nbytes  # adjacent ranges merge into one copy
        else:
            self._srcs.append(sf)
            self._offs.append(off)
            self._lens.append(nbytes)
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


def row_pieces(seg: Segments, outer: int, src_row: int, src_off: int, dst_row: int, dst_off: int,
            block: int) -> List[Piece]:
    """The pieces that copy ``block`` bytes at ``src_off`` of each of ``outer`` rows of ``seg`` (rows of
    ``src_row`` bytes) to ``dst_off`` of each destination row (rows of ``dst_row`` bytes): a
    tensor-parallel merge's columns, a row permutation's rows. Runs of whole source rows inside one
    source range become one strided piece."""
    if block == 0 or outer == 0:
        return []
    pieces: List[Piece] = []
    if src_row == block:  # whole source rows: strided ops over each contiguous run of rows
        pos = 0
        for sf, off, n in seg.parts:
            first, last = pos // block, (pos + n - 1) // block
            r = first
            while r <= last:
                lo, hi = max(pos, r * block), min(pos + n, (r + 1) * block)
                if lo == r * block and hi == (r + 1) * block:
                    # the last row this part holds whole (row r is whole, so run_end >= r)
                    run_end = min(last, (pos + n) // block - 1)
                    rows = run_end - r + 1
                    pieces.append(Piece(sf, off + (lo - pos), block, r * dst_row + dst_off, 0, rows,
                                        dst_row if rows > 1 else 0))
                    r = run_end + 1
                else:
                    pieces.append(Piece(sf, off + (lo - pos), hi - lo, r * dst_row + dst_off + (lo - r * block)))
                    r += 1
            pos += n
        return pieces
    for r in range(outer):
        for p in seg.slice(r * src_row + src_off, block).pieces(r * dst_row + dst_off):
            pieces.append(p)
    return pieces


@dataclass(slots=True)
class ArchiveOut:
    relpath: str
    obj: Any


@dataclass
class ArchiveSeriesOut:
    """A file of several torch.save archives back to back, each holding one object and readable on
    its own from its (offset, length) slice, which :func:`pyckpt.native.series_layout` gives: the
    data files of torch.distributed.checkpoint."""

    relpath: str
    members: List[Any] = field(default_factory=list)


@dataclass
class FileCopy:
    src: Any  # pyckpt.formats.torch_zip.SourceFile, parsed and checked like every file pyckpt reads
    relpath: str


@dataclass
class RawFileOut:
    """A file that is its records back to back: ``head`` (bytes computed here, e.g. a safetensors
    header), then each tensor's bytes in order. A file of ``head`` alone is a small text file."""

    relpath: str
    head: bytes
    tensors: List[Tuple[str, NewTensor]] = field(default_factory=list)


@dataclass
class Plan:
    archives: List[ArchiveOut] = field(default_factory=list)
    copies: List[FileCopy] = field(default_factory=list)
    raw_files: List[RawFileOut] = field(default_factory=list)
    series: List[ArchiveSeriesOut] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # what a --dry-run should tell besides the files
    # Files of the input read outside the checkpoint's own folder (a model config, a tokenizer beside
    # it): the output may not replace them (execution.output_apart.check_apart).
    input_files: List[str] = field(default_factory=list)

    _relpaths: set = field(default_factory=set, repr=False)

    def _claim(self, relpath: str) -> str:
        check_relpath(relpath)
        if relpath in self._relpaths:
            # Two inputs (e.g. parameter names that differ only in ways a path does not show) would
            # silently land in one file; the second would replace the first.
            raise CheckpointFormatError(f"two outputs map to the same file {quoted(relpath)}: refusing to let one "
                                        "replace the other")
        self._relpaths.add(relpath)
        return relpath

    def add_archive(self, relpath: str, obj: Any) -> None:
        self.archives.append(ArchiveOut(self._claim(relpath), obj))

    def add_raw_file(self, relpath: str, head: bytes, tensors: List[Tuple[str, NewTensor]] = ()) -> None:
        self.raw_files.append(RawFileOut(self._claim(relpath), bytes(head), list(tensors)))

    def add_archive_series(self, relpath: str, members: List[Any]) -> None:
        self.series.append(ArchiveSeriesOut(self._claim(relpath), list(members)))

    def add_copy(self, src, relpath: str) -> None:
        src.load()  # a file copied verbatim passes the same checks as one pyckpt parses
        src.check_copyable()
        self.copies.append(FileCopy(src, self._claim(relpath)))

    # -- describing ----------------------------------------------------------------------------
    @pauses_collector
    def describe(self, limit: int = 40) -> str:
        """The dry run's text. Its names come from the checkpoint (files copied, notes naming what was
        read) and each is escaped, so that none can start a line of its own or drive the terminal."""
        lines = []
        total = 0
        for arc in self.archives:
            storages = storages_of(arc.obj)
            nbytes = sum(st.numel * ITEMSIZE[st.dtype] for st in storages)
            npieces = sum(len(st.source.pieces) if isinstance(st.source, NewTensor) else 1 for st in storages)
            total += nbytes
            if len(lines) < limit:
                lines.append(f"  {printable_line(arc.relpath)}: {nbytes} bytes from {npieces} piece(s)")
        if len(self.archives) > limit:
            lines.append(f"  ... and {len(self.archives) - limit} more archive(s)")
        for raw in self.raw_files:
            nbytes = sum(ITEMSIZE[t.dtype] * t.numel() for _, t in raw.tensors)
            total += nbytes
            lines.append(f"  {printable_line(raw.relpath)}: {len(raw.head)} header bytes, "
                         f"{len(raw.tensors)} tensor(s), {nbytes} bytes")
        for ser in self.series:
            nbytes = 0
            for obj in ser.members:
                storages = storages_of(obj)
                nbytes += sum(st.numel * ITEMSIZE[st.dtype] for st in storages)
            total += nbytes
            if len(lines) < limit:
                lines.append(f"  {printable_line(ser.relpath)}: {len(ser.members)} archive(s) back to back, "
                             f"{nbytes} tensor bytes")
        for c in self.copies:
            lines.append(f"  {printable_line(c.relpath)}: copy of {printable_line(c.src.path)}")
        raw = f", {len(self.raw_files)} other file(s)" if self.raw_files else ""
        raw += f", {len(self.series)} file(s) of archives" if self.series else ""
        head = [f"{len(self.archives)} archive(s){raw}, {total} tensor bytes; {len(self.copies)} file copies"]
        return "\n".join(head + [printable_line(note) for note in self.notes] + lines)
