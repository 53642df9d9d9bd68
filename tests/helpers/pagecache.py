"""Page-cache measuring for tests: how much of a file is resident, and evicting it."""

from __future__ import annotations

import ctypes
import mmap
import os


def resident_bytes(path) -> int:
    """Bytes of ``path`` in the page cache (mincore over a fresh shared mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) * page


def evict(path) -> None:
    """Drop ``path``'s pages from the page cache (after writing back any dirty ones)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
