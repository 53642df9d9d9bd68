"""A DCP folder pyckpt exported, against the checkpoint it came from: the export is planned again
with the options it recorded (``.pyckpt-export.json``), and the folder must hold exactly the planned
files: the same ``.metadata`` byte for byte (every entry, chunk and location), data files of the
planned sizes, and in each of them every planned archive where the metadata says, its members
named and sized as planned, its pickle the planned one, each member's bytes matching the CRC-32 its
directory stores, and each chunk's CRC-32 that of the input's bytes (computed apart from the
executor: Python reads, numpy casts). Nothing is unpickled.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
from typing import Optional

from ..errors import PyckptError, VerifyInputError, metadata_errors
from ..execution.executor import SERIES_ARCHIVE_NAME, series_locations
from ..formats.confined import read_inside
from ..formats.json_file import parse_json_object
from ..formats.pickle_write import dumps
from ..tensors import ITEMSIZE, NewTensor
from ..universal.verify.against import _planned_crc, _Reader
from ..universal.verify.report import VerifyReport
from .export import EXPORT_RECORD, EXPORT_RECORD_VERSION, METADATA_NAME, plan_dcp
from .layout import OPTIM_LAYOUTS

RECORD_MAX_BYTES = 1 << 20
_OPTIONS = {"dtype": str, "optimizer": bool, "model_key": str, "optim_key": str, "chunk_bytes": int,
            "exclude_frozen": bool, "data_files": int, "save_id": str}


class _Slice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own (what DCP's reader hands
    torch.load for each chunk)."""

    def __init__(self, fd: int, start: int, length: int):
        self._fd, self._start, self._len, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: pos, 1: self._pos + pos, 2: self._len + pos}[whence])
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._len - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos) if n else b""
        buf[:len(data)] = data
        self._pos += len(data)
        return len(data)


def _options(folder: str) -> dict:
    try:
        raw = read_inside(folder, EXPORT_RECORD, RECORD_MAX_BYTES)
    except (PyckptError, OSError) as exc:
        raise VerifyInputError(f"{os.path.join(folder, EXPORT_RECORD)}: cannot read the export's options ({exc}): "
                               "only a DCP folder pyckpt exported can be verified against its input") from None
    opts = parse_json_object(raw, os.path.join(folder, EXPORT_RECORD), "export record", VerifyInputError)
    bad = [k for k, kind in _OPTIONS.items() if type(opts.get(k)) is not kind]
    if not bad and type(opts.get("hf_names", False)) is not bool:  # absent from the first records: False
        bad = ["hf_names"]
    if not bad and opts.get("optim_layout", "nested") not in OPTIM_LAYOUTS:
        bad = ["optim_layout"]
    if not bad and type(opts.get("torchtitan", False)) is not bool:
        bad = ["torchtitan"]
    if not bad and opts.get("initial_lr") is not None and type(opts["initial_lr"]) not in (int, float):
        bad = ["initial_lr"]
    if bad or opts.get("version") != EXPORT_RECORD_VERSION:
        raise VerifyInputError(f"{os.path.join(folder, EXPORT_RECORD)}: not an export record of this pyckpt "
                               f"({'field ' + bad[0] if bad else 'version'})")
    return opts


def verify_dcp(output, *, against, content: bool = True) -> VerifyReport:
    """Check the DCP folder ``output`` against the checkpoint ``against`` it was exported from;
    returns the report (``ok`` False with one problem per defect). VerifyInputError when either
    cannot be read."""
    folder = os.path.abspath(os.fspath(output))
    report = VerifyReport(folder, against=os.path.abspath(os.fspath(against)))
    opts = _options(folder)
    try:
        with metadata_errors(against):
            ck, plan, layout, _ = plan_dcp(against, dtype=opts["dtype"], optimizer=opts["optimizer"],
                                           model_key=opts["model_key"], optim_key=opts["optim_key"],
                                           chunk_bytes=opts["chunk_bytes"], exclude_frozen=opts["exclude_frozen"],
                                           hf_names=opts.get("hf_names", False),
                                           optim_layout=opts.get("optim_layout", "nested"),
                                           min_files=opts["data_files"], save_id=opts["save_id"],
                                           torchtitan=opts.get("torchtitan", False),
                                           initial_lr=opts.get("initial_lr"))
    except (PyckptError, OSError, ValueError) as exc:
        raise VerifyInputError(f"cannot plan the DCP export of {os.fspath(against)}: {exc}") from None
    report.stage = getattr(ck, "stage", None)
    report.params = len(layout.tensors)
    planned = {r.relpath: r for r in plan.raw_files}
    planned.update({s.relpath: s for s in plan.series})
    present = set(os.listdir(folder))
    for name in sorted(set(planned) - present):
        report.add(os.path.join(folder, name), f"missing: exporting {ck.folder} writes it")
    for name in sorted(present - set(planned)):
        report.add(os.path.join(folder, name), f"extra file: exporting {ck.folder} does not write it")
    reader = _Reader()
    try:
        for name in sorted(set(planned) & present):
            path = os.path.join(folder, name)
            report.files += 1
            if name == EXPORT_RECORD:
                continue  # read above; its fields were planned with
            if name == METADATA_NAME:
                got = read_inside(folder, name, max(RECORD_MAX_BYTES, 4 * len(planned[name].head)))
                report.bytes_checked += len(got)
                if got != planned[name].head:
                    report.add(path, f"differs from the metadata of exporting {ck.folder} (entries, chunks or "
                                     "locations)")
                continue
            _check_data_file(path, planned[name].members, report, reader if content else None)
    finally:
        reader.close()
    return report


def _check_data_file(path: str, members, report: VerifyReport, reader: Optional[_Reader]) -> None:
    where = series_locations(members)
    want_size = where[-1][0] + where[-1][1] if where else 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        report.add(path, f"cannot be read: {exc.strerror}")
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            report.add(path, "is not a regular file")
            return
        size = os.fstat(fd).st_size
        if size != want_size:
            report.add(path, f"is {size} bytes; the export's plan makes it {want_size}")
            return
        for k, (obj, (off, length)) in enumerate(zip(members, where)):
            problem = _check_archive(fd, off, length, obj, reader, report)
            report.bytes_checked += length
            if problem:
                report.add(path, f"archive {k} at byte {off}: {problem}")
    finally:
        os.close(fd)


def _check_archive(fd: int, off: int, length: int, obj, reader: Optional[_Reader], report: VerifyReport):
    pkl, storages = dumps(obj)
    prefix = SERIES_ARCHIVE_NAME + "/"
    try:
        with zipfile.ZipFile(_Slice(fd, off, length)) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            want = {prefix + "data.pkl": len(pkl)}
            want.update({f"{prefix}data/{st.key}": st.numel * ITEMSIZE[st.dtype] for st in storages})
            for name, size in want.items():
                if name not in infos or infos[name].file_size != size:
                    return f"member {name} missing or not {size} bytes"
            if zf.read(prefix + "data.pkl") != pkl:
                return "its pickle differs from the planned one"
            bad = zf.testzip()  # every member's bytes against its stored CRC-32
            if bad is not None:
                return f"member {bad} fails its CRC-32 check: the file is corrupt"
            for st in storages:
                if reader is None or not isinstance(st.source, NewTensor):
                    continue
                expected = _planned_crc(st.source, reader)
                if expected is None:
                    report.content_skipped += 1
                elif infos[f"{prefix}data/{st.key}"].CRC != expected:
                    return f"chunk bytes differ from the input's (CRC-32 {infos[f'{prefix}data/{st.key}'].CRC:08x}, " \
                           f"expected {expected:08x})"
                else:
                    report.content_checked += 1
    except zipfile.BadZipFile as exc:
        return f"not a readable archive ({exc})"
    return None
