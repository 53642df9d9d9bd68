"""A universal folder against the ZeRO checkpoint it came from: the conversion is planned again
(writing nothing) and the files present compared with the plan, down to the CRC-32 of every planned
tensor, computed apart from the executor (Python reads, the numpy cast kernel)."""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from typing import Optional, Tuple

from ...errors import CheckpointFormatError, PyckptError, VerifyInputError, metadata_errors, quoted
from ...formats.dtype_cast import cast_bytes
from ...formats.pickle_read import Opaque, TensorRef
from ...formats.torch_zip import SourceFile, open_regular
from ...formats.zip_integrity import CHUNK, crc32
from ...native import KIND_SOURCE_DTYPE
from ...tensors import ITEMSIZE, NewTensor, numel
from ...zero.discovery import discover
from ...zero.read import read_zero_state
from ..layout import param_folder, param_of_path
from ..write import universal_plan
from .layout_rules import CheckedFiles, shape_tuple
from .report import VerifyReport

# Planned tensors whose bytes need reordering or dtype conversion are assembled in memory to be
# CRC'd; above this size they are checked for shape and size only (counted in the report).
_ASSEMBLE_LIMIT = 512 << 20
# Descriptors the comparison keeps open at once (_Reader), well under a soft `ulimit -n` of 1024
_OPEN_FILES = 128


def verify_against(folder, against, report, files: CheckedFiles, inject_missing_state, dense_only, content):
    """The folder against a fresh plan of converting ``against``: files, shapes, dtypes, bytes."""
    try:
        with metadata_errors(against):
            ck = discover(against)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # unused-pattern warnings are the converter's business
                state, _ = read_zero_state(ck, inject_missing_state, dense_only, strict=False)
                plan = universal_plan(state)
    except (PyckptError, OSError) as exc:
        raise VerifyInputError(f"cannot plan the conversion of {os.fspath(against)}: {exc}") from None
    planned = {}
    for arc in plan.archives:
        planned[arc.relpath] = ("archive", arc.obj)
    for c in plan.copies:
        planned[c.relpath] = ("copy", c.src)
    present = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        for f in filenames:
            present.add(os.path.relpath(os.path.join(dirpath, f), folder).replace(os.sep, "/"))
    planned_params = set(state.params)
    present_params = {param_of_path(rel) for rel in present} - {None}
    missing_params = set()
    for rel in sorted(set(planned) - present):
        param = param_of_path(rel)
        if param is not None and param not in present_params:
            if param not in missing_params:  # one line for the whole folder, not one per state file
                missing_params.add(param)
                report.add(os.path.join(folder, param_folder(param)), f"missing parameter folder: converting "
                           f"{ck.folder} writes it")
            continue
        report.add(os.path.join(folder, rel), f"missing: converting {ck.folder} writes it")
    reported_dirs = set()
    for rel in sorted(present - set(planned)):
        param = param_of_path(rel)
        if param is not None and param not in planned_params:
            if param not in reported_dirs:
                reported_dirs.add(param)
                report.add(os.path.join(folder, param_folder(param)), f"extra parameter: converting {ck.folder} "
                           "writes no such folder")
            continue
        report.add(os.path.join(folder, rel), f"extra file: converting {ck.folder} does not write it")
    reader = _Reader()
    try:
        _compare_files(folder, planned, present, report, files, reader, content)
    finally:
        reader.close()


def _compare_files(folder, planned, present, report, files, reader, content) -> None:
    for rel in sorted(set(planned) & present):
        path = os.path.join(folder, rel)
        kind, what = planned[rel]
        if kind == "copy":
            try:  # a dangling or looping link, a FIFO, a folder: named with the rule, never a bare errno
                fd = open_regular(path)
                try:
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
            except (CheckpointFormatError, OSError) as exc:
                if not any(p.path == path for p in report.problems):  # the layout check may have said so
                    report.add(path, str(exc).removeprefix(f"{path}: "))
                continue
            if size != what.size:
                report.add(path, f"is {size} bytes; the copy of {what.path} should be {what.size}")
            elif content and not _same_file_bytes(what.path, path):
                report.add(path, f"differs from {what.path}, of which it should be a copy")
            continue
        sf, obj = files.open(path)
        if sf is None or obj is None:
            continue
        _compare(what, obj, sf, "", path, report, reader if content else None)


def _same_file_bytes(a: str, b: str) -> bool:
    fa, fb = open_regular(a), open_regular(b)
    try:
        while True:
            x, y = os.read(fa, CHUNK), os.read(fb, CHUNK)
            if x != y:
                return False
            if not x:
                return True
    finally:
        os.close(fa)
        os.close(fb)


def _compare(expected, actual, sf: SourceFile, where: str, path: str, report: VerifyReport, reader) -> None:
    """Walk the planned object and the file's object together; tensors by dtype, shape and (with a
    ``reader``) the CRC-32 of their bytes."""
    if isinstance(expected, (NewTensor, TensorRef)):
        if not isinstance(actual, TensorRef):
            report.add(path, f"{_at(where)}expected a tensor, found a {type(actual).__name__}")
            return
        shape = shape_tuple(expected.shape)
        if (expected.dtype, shape) != (actual.dtype, shape_tuple(actual.shape)):
            report.add(path, f"{_at(where)}{actual.dtype}{list(actual.shape)}, but converting the input gives "
                       f"{expected.dtype}{shape} ({numel(shape) * ITEMSIZE[expected.dtype]} bytes)")
            return
        if reader is not None:
            want = _planned_crc(expected, reader)
            if want is None:
                report.content_skipped += 1
                return
            got = _file_tensor_crc(sf, actual, reader)
            if got is None:
                report.content_skipped += 1
            elif got != want:
                report.add(path, f"{_at(where)}tensor bytes differ from the input's (CRC-32 {got:08x}, expected "
                           f"{want:08x})")
            else:
                report.content_checked += 1
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            report.add(path, f"{_at(where)}expected a dict, found a {type(actual).__name__}")
            return
        if list(expected) != list(actual):
            report.add(path, f"{_at(where)}keys {list(actual)[:12]}, but converting the input gives "
                       f"{list(expected)[:12]}")
            return
        for key in expected:
            _compare(expected[key], actual[key], sf, f"{where}[{quoted(key)}]", path, report, reader)
        return
    if isinstance(expected, (list, tuple)) and not isinstance(expected, str):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            report.add(path, f"{_at(where)}expected a sequence of {len(expected)}, found {_short(actual)}")
            return
        for i, (e, a) in enumerate(zip(expected, actual)):
            _compare(e, a, sf, f"{where}[{i}]", path, report, reader)
        return
    if isinstance(expected, Opaque):
        return  # inert records (loss scaler, enums) are written back as read; nothing to compare by value
    if isinstance(expected, (bool, int, float, str, type(None))):
        same = expected == actual and type(expected) is type(actual)
        if isinstance(expected, float) and isinstance(actual, float) and math.isnan(expected) and math.isnan(actual):
            same = True
        if not same:
            report.add(path, f"{_at(where)}{_short(actual)}, but converting the input gives {_short(expected)}")


def _at(where: str) -> str:
    """Where in the file's object a difference is: '' for the whole object, else a key path."""
    return f"at {where}: " if where else ""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _planned_crc(t, reader: "_Reader") -> Optional[int]:
    """CRC-32 of the bytes the plan would write for ``t``, or None when not worth computing."""
    if isinstance(t, TensorRef):
        sf = t.storage.source
        if not t.is_contiguous():
            return None
        off, n = sf.tensor_byte_range(t)
        return reader.crc(sf, off, n)
    if not isinstance(t, NewTensor):
        return None
    nbytes = numel(t.shape) * ITEMSIZE[t.dtype]
    if t.data is not None:
        return crc32(t.data)
    pieces = sorted(t.pieces, key=lambda p: p.dst_off)
    if all(p.kind == 0 and p.rows <= 1 for p in pieces):
        pos, crc = 0, 0
        for p in pieces:
            if p.dst_off != pos:
                return None  # not a plain concatenation: would need assembling
            crc = reader.crc(p.src, p.src_off, p.nbytes, crc)
            pos += p.nbytes
        return crc if pos == nbytes else None
    if nbytes > _ASSEMBLE_LIMIT:
        return None
    return crc32(_assemble(t, nbytes, reader))


class _Reader:
    """Reads byte ranges of checked files through a descriptor kept per file: a ZeRO plan has a
    piece per parameter per rank, and opening the shard for each would dominate the comparison. At
    most _OPEN_FILES stay open (the least recently read is closed first), so a checkpoint of
    thousands of rank files is compared under a soft `ulimit -n` of 1024; pieces come in output
    order, which walks the ranks in order, so a file is rarely opened twice."""

    def __init__(self):
        self._fds: "OrderedDict[str, Tuple[int, int]]" = OrderedDict()

    def read(self, sf, off: int, n: int) -> bytes:
        entry = self._fds.get(sf.path)
        if entry is None:
            if len(self._fds) >= _OPEN_FILES:
                os.close(self._fds.popitem(last=False)[1][0])
            fd = open_regular(sf.path)
            entry = self._fds[sf.path] = (fd, os.fstat(fd).st_size)
        else:
            self._fds.move_to_end(sf.path)
        fd, size = entry
        if off < 0 or n < 0 or off + n > size:
            raise CheckpointFormatError(f"{sf.path}: byte range [{off}, {off + n}) is outside the {size}-byte file")
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise CheckpointFormatError(f"{sf.path}: the file shrank while being read")
        return data

    def crc(self, sf, off: int, n: int, crc: int = 0) -> int:
        for start in range(off, off + n, CHUNK):
            crc = crc32(self.read(sf, start, min(off + n, start + CHUNK) - start), crc)
        return crc

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _assemble(t, nbytes: int, reader: "_Reader") -> bytes:
    """The planned bytes of a strided or converting NewTensor, as the executor would write them,
    computed apart from it (numpy casts, Python copies)."""
    out = bytearray(nbytes)
    for p in t.pieces:
        for i in range(max(1, p.rows)):
            data = reader.read(p.src, p.src_off + i * p.nbytes, p.nbytes)
            if p.kind:
                data = cast_bytes(data, KIND_SOURCE_DTYPE[p.kind], t.dtype)
            dst = p.dst_off + i * p.stride
            out[dst:dst + len(data)] = data
    return bytes(out)


def _file_tensor_crc(sf: SourceFile, t: TensorRef, reader: "_Reader") -> Optional[int]:
    if not t.is_contiguous():
        return None
    off, n = sf.tensor_byte_range(t)
    name = f"{sf.prefix}/data/{t.storage.key}"
    member = sf.members.get(name)
    if member is not None and member[0] == off and member[1] == n:
        return member[2]  # the whole record: its stored CRC, already checked against the bytes
    return reader.crc(sf, off, n)
