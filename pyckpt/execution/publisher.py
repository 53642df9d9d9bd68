"""Putting one output folder in place: complete or absent, never replacing what it must not.

A run writes into a hidden staging folder beside OUTPUT and publishes it with one atomic rename;
``latest_universal`` (or another pointer file) is replaced atomically after that. Around it:

* **A lock per output** (:mod:`.output_lock`): two runs into one OUTPUT never interleave, and what
  killed runs left beside it is cleaned under that lock first (:mod:`.leftovers`).
* **No replacement without consent**: without ``overwrite`` the rename is ``RENAME_NOREPLACE``, so an
  OUTPUT that appeared meanwhile (even an empty folder, which plain rename(2) would replace) stays.
* **An atomic swap with consent**: ``RENAME_EXCHANGE`` swaps old and new, so OUTPUT always exists.
  Filesystems without it get two renames (OUTPUT aside, then staging in); a kill between them
  leaves the old output under ``.<name>.pyckpt-old-*``, which the next run or ``--clean`` renames
  back before anything else.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from typing import Callable, Optional

from ..errors import OutputExistsError
from ..native import _core
from .durable import fsync_path
from .fault_points import fault_point
from .leftovers import clean, remove_path
from .output_lock import OutputLock
from .pointer import check_pointer_name
from .staging_names import OLD, POINTER_TMP, STAGING, hidden_name, owner_id


def _no_unsupported(exc: OSError) -> bool:
    return exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class Publisher:
    """One run's output: lock, clean, stage, publish, pointer file. Use as a context manager."""

    def __init__(self, output: str, *, overwrite: bool = False, fsync: bool = False,
                 pointer: Optional[str] = "latest_universal", notify: Optional[Callable[[str], None]] = None,
                 owner: Optional[str] = None):
        self.output = os.path.abspath(os.fspath(output))
        self.parent, self.base = os.path.split(self.output)
        self.overwrite = overwrite
        self.fsync = fsync
        self.pointer = os.path.join(self.parent, pointer) if pointer else None
        self.notify = notify
        # a run of several publishers (a node-local save: one per node) may share one staging name
        if owner is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", owner):
            raise ValueError(f"a staging owner id must be 1 to 100 of A-Z a-z 0-9 _ . -, not {owner!r}")
        self.owner = owner or owner_id()
        self.staging = os.path.join(self.parent, hidden_name(self.base, STAGING, self.owner))
        self.published = False
        self.pointer_written = False
        self.leftover: Optional[str] = None  # the previous output, if it could not be removed
        self._lock: Optional[OutputLock] = None

    def __enter__(self) -> "Publisher":
        if self.pointer:
            check_pointer_name(self.output, os.path.basename(self.pointer))
        os.makedirs(self.parent, exist_ok=True)
        if self.pointer and os.path.lexists(self.pointer) and not os.path.isfile(self.pointer):
            raise OutputExistsError(f"{self.pointer} exists and is not a file; pyckpt would have to replace it with "
                                    "the pointer to the new output: remove or rename it first")
        self._lock = OutputLock(self.output, self.notify)
        try:
            for name in clean(self.output, lock=False):
                if self.notify:
                    self.notify(f"removed {os.path.join(self.parent, name)}, left by an earlier run that did not finish")
            if os.path.lexists(self.output) and not self.overwrite:
                raise OutputExistsError(f"{self.output} already exists (pass --overwrite to replace it)")
            os.mkdir(self.staging)
        except BaseException as exc:
            # An interrupt (Ctrl-C) can land after mkdir returned, before this method did: the folder is
            # this run's then (the lock is held and clean() just ran), and nothing else would remove it.
            # A FileExistsError from mkdir itself is the one case where it is not.
            if not isinstance(exc, FileExistsError) and os.path.lexists(self.staging):
                shutil.rmtree(self.staging, ignore_errors=True)
            self._release()
            raise
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if not self.published and os.path.lexists(self.staging):
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock:
            self._lock.release()
            self._lock = None

    def publish(self) -> None:
        """Staging becomes OUTPUT (atomically), then the pointer names it, then the old output goes."""
        fault_point("before-publish")
        old = None
        if os.path.lexists(self.output):
            if not self.overwrite:
                raise OutputExistsError(f"{self.output} appeared while converting (pass --overwrite to replace it)")
            old = self._swap()
        else:
            self._rename_noreplace()
        self.published = True
        fault_point("after-publish")
        if self.fsync:
            fsync_path(self.parent)
        if self.pointer:
            self._write_pointer()
        fault_point("after-pointer")
        if old:
            try:
                remove_path(old)
            except OSError as exc:
                self.leftover = old
                warnings.warn(f"the previous {self.output} is now at {old} and could not be removed ({exc}); remove it "
                              "by hand or run `python -m pyckpt.convert --clean OUTPUT`", stacklevel=2)

    def _rename_noreplace(self) -> None:
        try:
            _core.rename_noreplace(self.staging, self.output)
        except FileExistsError:
            raise OutputExistsError(f"{self.output} appeared while converting; it was left as it is (pass "
                                    "--overwrite to replace it)") from None
        except OSError as exc:
            if _no_unsupported(exc):
                raise
            # No RENAME_NOREPLACE here: the lock keeps other pyckpt runs out, so only a foreign
            # writer creating OUTPUT between these two calls could still be replaced.
            if os.path.lexists(self.output):
                raise OutputExistsError(f"{self.output} appeared while converting; it was left as it is") from None
            os.rename(self.staging, self.output)

    def _swap(self) -> str:
        """Exchanges OUTPUT and staging; returns where the old output now is."""
        try:
            _core.rename_exchange(self.staging, self.output)
            return self.staging
        except OSError as exc:
            if _no_unsupported(exc):
                raise
        aside = os.path.join(self.parent, hidden_name(self.base, OLD, self.owner))
        os.rename(self.output, aside)
        fault_point("between-renames")
        try:
            os.rename(self.staging, self.output)
        except BaseException:
            os.rename(aside, self.output)
            raise
        return aside

    def _write_pointer(self) -> None:
        tmp = os.path.join(self.parent, hidden_name(self.base, POINTER_TMP, self.owner))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, self.base.encode())
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            fault_point("before-pointer-rename")
            os.replace(tmp, self.pointer)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        self.pointer_written = True
        if self.fsync:
            fsync_path(self.parent)
