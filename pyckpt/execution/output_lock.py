"""One run into an output at a time: an exclusive lock on ``.<name>.pyckpt-lock`` beside it.

A POSIX record lock, which NFS carries between nodes, so two runs into one OUTPUT never interleave,
whichever node they run on. A run removes the file while it still holds the lock; a run that was
waiting on it may then hold a lock on a file no longer there, so every locker checks, once locked,
that the path still names the file it locked, and otherwise locks anew. A killed run's file stays
until the next run into OUTPUT (or ``clean()``) ends.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Callable, Optional

from ..errors import OutputLockError
from .staging_names import LOCK, hidden_name


class OutputLock:
    """An exclusive POSIX lock on ``.<name>.pyckpt-lock`` beside the output, held until release(),
    which removes the file. With ``wait=False`` a lock another run holds is not waited for: ``held``
    is False then."""

    def __init__(self, output: str, notify: Optional[Callable[[str], None]] = None, wait: bool = True):
        parent, base = os.path.split(output)
        self.path = os.path.join(parent, hidden_name(base, LOCK))
        self.fd = -1
        told = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise OutputLockError(exc.errno, f"{self.path}: cannot lock ({os.strerror(exc.errno)}); two "
                                              "runs into one output could interleave, so none is started") from None
                    if not wait:
                        os.close(fd)
                        return
                    if notify and not told:
                        notify(f"waiting for another pyckpt run into {output} to finish (it holds {self.path})")
                        told = True
                    fcntl.lockf(fd, fcntl.LOCK_EX)
                named = _names(self.path, fd)
            except BaseException:
                os.close(fd)
                raise
            if named:
                self.fd = fd
                return
            os.close(fd)  # its holder removed it on release; a newcomer may hold the file there now

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            # Removed while still locked: whoever waited on it sees the path change and locks anew.
            if _names(self.path, self.fd):
                os.unlink(self.path)
        except OSError:
            pass  # left for the next run into the output, whose release removes it
        finally:
            os.close(self.fd)  # closing drops the lock
            self.fd = -1


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
