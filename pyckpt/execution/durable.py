"""Making what was written durable: one fsync of a file or a folder by path."""

from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it durable, a rename among them)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
