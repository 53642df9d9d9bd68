"""``pyckpt verify DCP_DIR``: a torch.distributed.checkpoint folder checked on its own, before it is
trusted (any DCP folder, FSDP2's, torchtitan's, torch's safetensors-backed one, or pyckpt's export).

Checked: the metadata parses (the allowlist reader) and its records follow the reader's rules
(:mod:`.read`: names inside the folder, ranges inside their files and apart, chunks tiling their
tensors); every record's archive opens inside its byte range and every one of its members' bytes
matches the CRC-32 the archive's directory stores; every chunk's archive holds a tensor of its entry's
dtype and the chunk's sizes, inside its storage record; every value's pickle parses. The
safetensors-backed layout has no checksums: its headers are checked, and every tensor's byte range
lies inside its file. Each defect is one problem naming its file; nothing is unpickled with code
execution and nothing is written.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from ..errors import CheckpointFormatError, PyckptError, UnsafePickleError, UnsupportedCheckpointError
from ..formats.torch_zip import max_pickle_bytes
from ..native import _core, native_errors
from ..universal.verify.report import VerifyReport
from .read import METADATA_NAME, DcpCheckpoint, Record, read_dcp
from .to_hf import model_entries

# Bytes hashed per read: a member of any size is checked in bounded memory.
CRC_BLOCK = 8 << 20
# Archive heads read per native batch (as the reader does).
_HEAD_BATCH = 512


def _add_error(report: VerifyReport, folder: str, exc: BaseException) -> None:
    """A reader's error as a problem: its message starts with the file it names, else the folder is named."""
    text = str(exc)
    path, sep, rest = text.partition(": ")
    if sep and path.startswith(folder):
        report.add(path, rest)
    else:
        report.add(folder, text)


def check_dcp(path) -> VerifyReport:
    """Check the DCP folder ``path`` (see the module's docstring); the report's ``ok`` is False with one
    problem per defect found."""
    folder = os.path.abspath(os.fspath(path))
    report = VerifyReport(folder)
    try:
        ck = read_dcp(folder)
    except (PyckptError, OSError) as exc:
        _add_error(report, folder, exc)
        return report
    try:
        report.params = len(model_entries(ck).names)
    except CheckpointFormatError:  # no model part an export would take: every tensor counts
        report.params = len(ck.tensors)
    files = {c.record.file.path: c.record.file for t in ck.tensors.values() for c in t.chunks}
    files.update({o.record.file.path: o.record.file for o in ck.objects.values()})
    report.files = len(files) + (1 if ck.layout == "torch_save" else 0)
    if ck.layout == "safetensors":
        # read_dcp checked every header and that each tensor's bytes lie inside its file; safetensors
        # stores no checksum to check the bytes against.
        report.bytes_checked = sum(f.size for f in files.values())
        return report
    report.bytes_checked += os.stat(os.path.join(folder, METADATA_NAME)).st_size
    unreadable = _check_archives(ck, report)
    _check_chunks(ck, report, unreadable)
    _check_values(ck, report, unreadable)
    return report


def _records(ck: DcpCheckpoint) -> List[Record]:
    return [c.record for t in ck.tensors.values() for c in t.chunks] + [o.record for o in ck.objects.values()]


def _where(r: Record) -> str:
    return f"the archive at bytes [{r.offset}, {r.offset + r.length})"


def _check_archives(ck: DcpCheckpoint, report: VerifyReport) -> set:
    """Every record's archive opened in its byte range and each member's bytes checked against its
    CRC-32; returns the ids of the records whose archive could not be opened."""
    records = _records(ck)
    unreadable = set()
    for lo in range(0, len(records), _HEAD_BATCH):
        batch = records[lo:lo + _HEAD_BATCH]
        heads = _core.read_archive_heads([r.file.path for r in batch], "data.pkl", max_pickle_bytes(), 0,
                                         [(r.offset, r.length) for r in batch])
        for r, head in zip(batch, heads):
            if head is None:
                unreadable.add(id(r))
                report.add(r.file.path, f"{_where(r)} cannot be read: {_archive_problem(r)}")
                continue
            _, _, members, _ = head
            bad = _bad_members(r, members)
            report.bytes_checked += r.length
            if bad:
                report.add(r.file.path, f"{_where(r)}: member {bad[0]} fails its CRC-32 check "
                                        f"(stored {bad[1]:08x}, bytes hash to {bad[2]:08x}): the file is corrupt")
    return unreadable


def _archive_problem(r: Record) -> str:
    """Why the native reader cannot open the archive of ``r`` (its own words, the file name dropped)."""
    try:
        with native_errors():
            _core.Archive(r.file.path, offset=r.offset, length=r.length).close()
    except (PyckptError, OSError, ValueError) as exc:
        text = str(exc)
        return text.split(": ", 1)[1] if text.startswith(r.file.path + ": ") else text
    return "the archive changed while it was read"


def _bad_members(r: Record, members: Dict[str, Tuple[int, int, int]]) -> Optional[Tuple[str, int, int]]:
    """The first member (name, stored CRC-32, computed CRC-32) whose bytes do not match, else None."""
    fd = os.open(r.file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        for name, (offset, size, crc) in sorted(members.items(), key=lambda m: m[1][0]):
            got, at, end = 0, offset, offset + size
            while at < end:
                block = os.pread(fd, min(CRC_BLOCK, end - at), at)
                if not block:
                    return name, crc, got  # shorter than its directory says: the file shrank
                got = _core.crc32(block, got)
                at += len(block)
            if got != crc:
                return name, crc, got
    finally:
        os.close(fd)
    return None


def _check_chunks(ck: DcpCheckpoint, report: VerifyReport, unreadable: set) -> None:
    """Every chunk's tensor against its entry (the reader's assemble); a tensor whose chunks fail is
    checked alone to name each defect."""
    keys = [k for k, t in ck.tensors.items() if not any(id(c.record) in unreadable for c in t.chunks)]
    try:
        ck.assemble(keys)
        return
    except (PyckptError, OSError, ValueError):
        pass
    for key in keys:
        try:
            ck.assemble([key])
        except (PyckptError, OSError, ValueError) as exc:
            _add_error(report, ck.folder, exc)


def _check_values(ck: DcpCheckpoint, report: VerifyReport, unreadable: set) -> None:
    """Every value's pickle parses by the allowlist reader (one naming code to run is a defect: torch's
    loader would run it); a value holding tensors is no defect, only not one pyckpt reads."""
    for key, obj in ck.objects.items():
        if id(obj.record) in unreadable:
            continue
        try:
            ck.value(key)
        except UnsupportedCheckpointError:
            continue
        except (CheckpointFormatError, UnsafePickleError, OSError, ValueError) as exc:
            _add_error(report, ck.folder, exc)
