"""The memory tier's root folder on a node: where it is, who may use it, what it may still hold.

A memory checkpoint lives in node-local tmpfs (``/dev/shm`` by default), a folder every user of the
node can write to and whose pages are the node's memory. So the root is treated like any other hostile
folder: created mode 0700, and refused when it is a link, not a folder, another user's, or writable by
group or others. Every level under it (``<root>/<job>/node<N>``) is opened relative to the level above
with ``O_NOFOLLOW`` and checked by the same rules, so nothing a memory folder names is followed outside
it; and a save asks :func:`fits` before it writes, keeping a share of the node's memory spare.

Which job a folder is (:mod:`.job_identity`) and which node (:mod:`.nodes`) are decided elsewhere;
this module holds the root's rules.

One module, longer than most: opening a node's folder level by level, measuring the job's tree against the
budget and removing it all go by the same descriptor-relative, no-follow rules (the walk itself is
:mod:`.folder_walk`), and those rules are the tier's safety; they are kept where one reading sees all
of them.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...errors import MemoryRootError, check_number
from .folder_names import LEVELS_ABOVE_TAG, check_job_name, node_folder, node_of_folder
from .folder_walk import TAG_DEPTH, held_bytes, kind_of, open_child

ENV_ROOT = "PYCKPT_MEMORY_ROOT"

MODE = 0o700
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The job's tree: its tag folders at most LEVELS_ABOVE_TAG folders down, each nesting at most
# TAG_DEPTH; a deeper one is not ours to walk (a walk holds one descriptor a level)
MAX_DEPTH = LEVELS_ABOVE_TAG + TAG_DEPTH

_ROOT = "the memory root"
_JOB = "the job's memory folder"
_NODE = "the node's memory folder"
_TOO_DEEP = f"{_JOB} nests at most {MAX_DEPTH} folders; a deeper one is not one pyckpt wrote"


# -- where ------------------------------------------------------------------------------------

def default_root() -> str:
    """``$PYCKPT_MEMORY_ROOT`` if set (and not empty), else ``/dev/shm/pyckpt-<uid>``."""
    return os.environ.get(ENV_ROOT) or f"/dev/shm/pyckpt-{os.getuid()}"


# -- opening and checking ---------------------------------------------------------------------

def _check(st: os.stat_result, path: str, what: str, mode: bool = True) -> None:
    """Refuses ``st`` (an lstat or fstat of ``path``) unless it is a real folder of ours that nobody
    else may write to (``mode``: its permission bits are checked too)."""
    if stat.S_ISLNK(st.st_mode):
        raise MemoryRootError(f"{path}: {what} is a symbolic link; it must be a real folder (a link could send "
                              f"checkpoints anywhere)")
    if not stat.S_ISDIR(st.st_mode):
        raise MemoryRootError(f"{path}: {what} is {kind_of(st.st_mode)}; it must be a folder")
    if st.st_uid != os.geteuid():
        raise MemoryRootError(f"{path}: {what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                              f"it must be ours")
    if mode and st.st_mode & 0o022:
        raise MemoryRootError(f"{path}: {what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"it must not be (chmod 700)")


def _open_failed(exc: OSError, path: str, what: str) -> MemoryRootError:
    if exc.errno == errno.ELOOP:
        return MemoryRootError(f"{path}: {what} is a symbolic link; it must be a real folder")
    if exc.errno == errno.ENOTDIR:
        return MemoryRootError(f"{path}: {what} is not a folder; it must be a folder")
    return MemoryRootError(f"{path}: {what} cannot be opened ({exc.strerror or exc}); it must be a folder of ours")


def _open_level(parent_fd: int, name: str, path: str, what: str, create: bool) -> Optional[int]:
    """A descriptor of the folder ``name`` inside ``parent_fd``, created mode 0700 if absent and
    ``create`` (None if absent otherwise), after the checks of :func:`_check` on the very folder
    opened (the lstat before the open and the fstat after it must be the same file)."""
    created = False
    if create:
        try:
            os.mkdir(name, MODE, dir_fd=parent_fd)
            created = True
        except FileExistsError:
            pass  # another rank of this node made it, or it was there: checked below all the same
        except OSError as exc:
            raise MemoryRootError(f"{path}: {what} cannot be created ({exc.strerror or exc})") from exc
    try:
        before = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        if create:
            raise MemoryRootError(f"{path}: {what} vanished while it was being created") from None
        return None
    except OSError as exc:
        raise _open_failed(exc, path, what) from exc
    # mkdir's mode passes through the umask (a strict 0o277 leaves 0500, unusable): what we made is
    # set to 0700 once open, and its mode checked then
    _check(before, path, what, mode=not created)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise _open_failed(exc, path, what) from exc
    try:
        after = os.fstat(fd)
        if not os.path.samestat(before, after):
            raise MemoryRootError(f"{path}: {what} was replaced while it was being opened; it must stay put")
        if created and stat.S_IMODE(after.st_mode) != MODE:
            _check(after, path, what, mode=False)
            os.fchmod(fd, MODE)
            after = os.fstat(fd)
        _check(after, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_parents(parent: str, create: bool) -> int:
    """A descriptor of ``parent`` (absolute), its missing folders created mode 0700 if ``create``.
    Parents are the user's choice (``/dev/shm`` itself is 1777): links among them are followed and
    they are not checked; only folders made here are made private."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        done = "/"
        for part in [p for p in parent.split("/") if p]:
            done = os.path.join(done, part)
            if create:
                try:
                    os.mkdir(part, MODE, dir_fd=fd)
                    made = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    try:
                        os.fchmod(made, MODE)
                    finally:
                        os.close(made)
                except FileExistsError:
                    pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except FileNotFoundError:
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "the memory root's parent folder does not exist", done) from None
    except OSError as exc:
        os.close(fd)
        raise MemoryRootError(f"{done}: a parent folder of the memory root cannot be opened "
                              f"({exc.strerror or exc}); it must be a folder") from exc
    return fd


def _root_fd(root: str, create: bool) -> Tuple[str, int]:
    given = os.fspath(root)
    if not given:
        raise ValueError("the memory root must be a path, not an empty string")
    path = os.path.abspath(given)
    parent, name = os.path.split(path)
    if not name:
        raise MemoryRootError(f"{path}: the memory root is the filesystem's root; it must be a folder of its own")
    parent_fd = _open_parents(parent, create)
    try:
        fd = _open_level(parent_fd, name, path, _ROOT, create)
    finally:
        os.close(parent_fd)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "the memory root does not exist", path)
    try:
        os.fstatvfs(fd)
    except OSError as exc:
        os.close(fd)
        raise MemoryRootError(f"{path}: {_ROOT}'s filesystem cannot report its free space "
                              f"({exc.strerror or exc}); it must be one statvfs works on") from exc
    return path, fd


def open_root(root: str, create: bool = True) -> str:
    """The memory root made safe to use: created mode 0700 (missing parents too) if absent and
    ``create``; refused with :class:`MemoryRootError` (one line naming the path and the rule) when it
    is a symbolic link, not a folder, another user's (not ``os.geteuid()``), writable by group or
    others, or on a filesystem statvfs fails on. Only the root itself is checked: parents the user
    named are the user's. Absent without ``create``: FileNotFoundError. Returns the absolute path
    (``os.path.abspath``: links in the parents stay as the user spelled them)."""
    path, fd = _root_fd(root, create)
    os.close(fd)
    return path


def _node_name(node: int) -> str:
    return node_folder(check_number('node', node, integer=True, low=0))


def node_memory_folder(root: str, job: str, node: int) -> str:
    """``<root>/<job>/node<node>``, each level created mode 0700 if absent and checked by
    :func:`open_root`'s rules, each opened relative to the one above without following links.
    Returns its path."""
    job = check_job_name(job)
    name = _node_name(node)
    path, root_fd = _root_fd(root, True)
    try:
        job_path = os.path.join(path, job)
        job_fd = _open_level(root_fd, job, job_path, _JOB, True)
        try:
            node_path = os.path.join(job_path, name)
            os.close(_open_level(job_fd, name, node_path, _NODE, True))
        finally:
            os.close(job_fd)
    finally:
        os.close(root_fd)
    return node_path


def level(folder: str, name: str, what: str, create: bool = True) -> Optional[str]:
    """``folder/name`` (``folder`` a level :func:`node_memory_folder` made and checked, such as a node's folder),
    created mode 0700 if absent and ``create``, and checked by :func:`open_root`'s rules (no link, ours,
    writable by nobody else) on the very folder opened, ``folder`` itself opened without following a
    link and checked again; None when absent and not ``create``. Returns its path."""
    path = os.path.join(folder, name)
    try:
        fd = os.open(folder, _DIR_FLAGS)
    except OSError as exc:
        raise _open_failed(exc, folder, "the folder above " + what) from exc
    try:
        _check(os.fstat(fd), folder, "the folder above " + what)
        child = _open_level(fd, name, path, what, create)
    finally:
        os.close(fd)
    if child is None:
        return None
    os.close(child)
    return path


def node_folders(root: str, job: str) -> List[Tuple[int, str]]:
    """``(node, path)`` of every ``node<N>`` folder of the job under ``root``, sorted by node. Only real
    folders named exactly ``node<N>`` (digits, no leading zero) count; links, files and other names are
    ignored. A counted folder, the job's folder and the root are checked as :func:`node_memory_folder` checks
    them; nothing is created (an absent root or job folder holds none)."""
    job = check_job_name(job)
    try:
        path, root_fd = _root_fd(root, False)
    except FileNotFoundError:
        return []
    try:
        job_path = os.path.join(path, job)
        job_fd = _open_level(root_fd, job, job_path, _JOB, False)
    finally:
        os.close(root_fd)
    if job_fd is None:
        return []
    found = []
    try:
        with os.scandir(job_fd) as entries:
            for entry in entries:
                number = node_of_folder(entry.name)
                if number is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue
                node_path = os.path.join(job_path, entry.name)
                _check(st, node_path, _NODE)
                found.append((number, node_path))
    finally:
        os.close(job_fd)
    return sorted(found)


# -- how much ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """What the memory root may still take for this job."""

    free: int  # bytes free to us on the root's filesystem (statvfs f_bavail * f_frsize)
    limit: Optional[int]  # the user's limit in bytes for this job's memory folders, or None
    used: int  # bytes this job's folder tree holds now (regular files' st_blocks * 512, links not followed)

    def room(self) -> int:
        """Bytes a new checkpoint may take: the free space, and under a limit what it leaves; never
        negative. A limit of 0 is a limit (no room), not its absence."""
        room = self.free if self.limit is None else min(self.free, self.limit - self.used)
        return max(0, room)


def budget(root: str, job: str, limit: Optional[int] = None) -> Budget:
    """The memory root's free space for us, the user's ``limit`` (bytes, or None) and what the job's
    folder tree (``<root>/<job>``, every node's folder in it) holds now, links not followed. The root
    is opened as :func:`open_root` opens it (created if absent), the job's folder checked if present."""
    job = check_job_name(job)
    if limit is not None:
        check_number("limit", limit, integer=True, low=0)
    path, root_fd = _root_fd(root, True)
    try:
        st = os.fstatvfs(root_fd)
        free = st.f_bavail * st.f_frsize
        job_path = os.path.join(path, job)
        job_fd = _open_level(root_fd, job, job_path, _JOB, False)
    finally:
        os.close(root_fd)
    used = 0
    if job_fd is not None:
        try:
            used = held_bytes(job_fd, job_path, MAX_DEPTH, MemoryRootError, _TOO_DEEP)
        finally:
            os.close(job_fd)
    return Budget(free=free, limit=limit, used=used)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def fits(need: int, b: Budget, margin: float = 0.05) -> Optional[str]:
    """None if a checkpoint of ``need`` bytes fits in ``b.room()`` with a ``margin`` share of the free
    space left spare (tmpfs pages are the node's memory: never fill it to the last byte), else one line
    saying why, in human units."""
    check_number("need", need, integer=True, low=0)
    check_number("margin", margin, low=0, high=1)
    spare = math.ceil(b.free * margin)
    usable = max(0, min(b.room(), b.free - spare))
    if need <= usable:
        return None
    limit = "no limit" if b.limit is None else f"limit {_human(b.limit)} of which {_human(b.used)} used"
    return (f"a memory checkpoint of {_human(need)} does not fit: room for {_human(usable)} ({_human(b.free)} free, "
            f"{margin:.0%} of it kept spare as the node's memory; {limit})")


# -- removing ---------------------------------------------------------------------------------

def _remove_tree(fd: int, path: str, removed: List[str], depth: int = 0) -> None:
    """Empties the folder ``fd`` (at ``path``): files and links unlinked, never followed; sub-folders
    opened relative to it without following links, emptied, removed."""
    if depth > MAX_DEPTH:
        raise MemoryRootError(f"{path}: is a sub-folder more than {MAX_DEPTH} levels down; {_TOO_DEEP}")
    with os.scandir(fd) as entries:
        listed = list(entries)
    for entry in listed:
        child_path = os.path.join(path, entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            child = open_child(fd, entry.name, st)
            if child is None:
                continue
            try:
                _remove_tree(child, child_path, removed, depth + 1)
            finally:
                os.close(child)
            os.rmdir(entry.name, dir_fd=fd)
        else:
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                continue
        removed.append(child_path)


def remove_job(root: str, job: str) -> List[str]:
    """Removes ``<root>/<job>`` and returns the paths removed (contents before their folder, the job's
    folder last). Only that folder: a link in its place is unlinked, not followed, and nothing inside
    it is followed out of it. Refused with :class:`MemoryRootError`: a root :func:`open_root` refuses,
    a job folder owned by another user, or something there that is neither a folder nor a link. An
    absent root or job folder: nothing to remove."""
    job = check_job_name(job)
    try:
        path, root_fd = _root_fd(root, False)
    except FileNotFoundError:
        return []
    job_path = os.path.join(path, job)
    removed: List[str] = []
    try:
        try:
            st = os.stat(job, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            return []
        if stat.S_ISLNK(st.st_mode):
            os.unlink(job, dir_fd=root_fd)
            return [job_path]
        if not stat.S_ISDIR(st.st_mode):
            raise MemoryRootError(f"{job_path}: {_JOB} is {kind_of(st.st_mode)}; only a folder or a link is "
                                  f"removed here")
        if st.st_uid != os.geteuid():
            raise MemoryRootError(f"{job_path}: {_JOB} is owned by uid {st.st_uid}, not by this user "
                                  f"(uid {os.geteuid()}); a job removes only its own folders")
        job_fd = open_child(root_fd, job, st)
        if job_fd is None:
            raise MemoryRootError(f"{job_path}: {_JOB} was replaced while it was being removed; it must stay put")
        try:
            _remove_tree(job_fd, job_path, removed)
        finally:
            os.close(job_fd)
        os.rmdir(job, dir_fd=root_fd)
        removed.append(job_path)
    finally:
        os.close(root_fd)
    return removed
