"""The integrity of a torch.save ZIP file: every member's bytes against the CRC-32 its directory
stores, read in bounded windows so that a multi-GiB record does not need its size in memory."""

from __future__ import annotations

import mmap
import os
from typing import List

from ..native import _core
from .torch_zip import SourceFile, open_regular

# Bytes per CRC step: bounded, and large enough that the per-call cost vanishes.
CHUNK = 64 << 20


def crc32(data, init: int = 0) -> int:
    return _core.crc32(data, init)


def member_crc_problems(sf: SourceFile, progress=None) -> List[str]:
    """Every member's bytes against its CRC-32 (what torch.load would only notice as garbage later):
    one line per defect, none for a sound file. ``progress(n)`` is told each member's size."""
    fd = open_regular(sf.path)
    try:
        size = os.fstat(fd).st_size
        if size != sf.size:
            return [f"changed size while being checked ({sf.size} -> {size} bytes)"]
        if size == 0:
            return []
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    problems: List[str] = []
    try:
        view = memoryview(mm)
        try:
            for name, (off, n, crc) in sf.members.items():
                got = 0
                for start in range(off, off + n, CHUNK):
                    got = crc32(view[start:min(off + n, start + CHUNK)], got)
                if progress:
                    progress(n)
                if got != crc:
                    problems.append(f"member {name} fails its CRC-32 check (stored {crc:08x}, bytes give "
                                    f"{got:08x}): the file is corrupt")
        finally:
            view.release()
    finally:
        mm.close()
    return problems
