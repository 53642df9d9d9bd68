"""The one walk of the memory tier's folders: a tag folder's files, a share's files by its manifest, and
the bytes a folder tree holds.

Every folder a walk enters is opened relative to the one above it with ``O_NOFOLLOW`` and must be the
very folder its listing showed, so a link (or a folder swapped for one) never leads a walk out of the
tree. The depth is bounded: a tag folder nests at most :data:`TAG_DEPTH` folders (a save records none
deeper), and a deeper tree is refused, not walked, since a walk holds one descriptor a level.

Two ways to meet what is not a regular file or a folder: a checkpoint's walk (:func:`tag_files`,
:func:`named_files`) refuses it in one line naming it, as a save writes none; a measure
(:func:`held_bytes`) counts regular files only and passes over anything else, and over what a
concurrent retention removed meanwhile.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ...errors import CheckpointFormatError

# Folders below a tag folder that a walk enters: DeepSpeed writes a tag folder's files flat, a few
# layouts one or two levels down; none of the tier's own trees goes deeper.
TAG_DEPTH = 8
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS = "a checkpoint's folder holds only regular files and folders, and links are not followed"
_TOO_DEEP = f"a checkpoint's tag folder nests at most {TAG_DEPTH} folders (a save writes none deeper)"


@dataclass(frozen=True)
class TagFile:
    name: str  # relative to the folder walked, sub-folders joined by '/'
    path: str
    stat: os.stat_result  # as listed, the link itself where it is one (never followed)


def kind_of(mode: int) -> str:
    """What a ``st_mode`` is, as a message names it ("a FIFO", "a symbolic link", ...)."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "an unknown kind of file"


def open_child(parent_fd: int, name: str, st: os.stat_result) -> Optional[int]:
    """A descriptor of the sub-folder ``name`` that ``st`` (its lstat) describes, or None when it is
    gone or no longer that folder (never a link's target)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    if not os.path.samestat(st, os.fstat(fd)):
        os.close(fd)
        return None
    return fd


def _open_top(folder: str, what: str, error: type) -> int:
    try:
        return os.open(folder, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(folder):
            raise error(f"{folder}: {what} is a symbolic link; it must be a real folder (links are not "
                        f"followed)") from None
        if exc.errno == errno.ENOTDIR:
            raise error(f"{folder}: {what} is not a folder") from None
        raise error(f"{folder}: {what} cannot be opened ({exc.strerror or exc})") from None


def _too_deep(path: str, depth: int, rule: str, error: type) -> Exception:
    where = "" if depth == 0 else f" more than {depth} levels down"
    return error(f"{path}: is a sub-folder{where}; {rule}")


def _walk(fd: int, path: str, prefix: str, level: int, depth: int, strict: bool, rule: str,
          error: type) -> Iterator[Tuple[str, str, os.stat_result]]:
    """(name below the top, path, lstat) of every regular file in the folder ``fd`` (at ``path``) and
    below, at most ``depth`` folders down. ``strict``: anything else, a sub-folder too deep, or an
    entry that changes while listed, is an ``error``; else such entries are passed over (a sub-folder
    too deep still is an ``error``: a walk never goes deeper)."""
    with os.scandir(fd) as entries:
        listed = sorted(entries, key=lambda e: e.name)
    for entry in listed:
        child = os.path.join(path, entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            if strict:
                raise error(f"{child}: vanished while its folder was listed; a checkpoint's folder must not "
                            f"change") from None
            continue  # removed by a concurrent save's retention
        if stat.S_ISREG(st.st_mode):
            yield prefix + entry.name, child, st
        elif stat.S_ISDIR(st.st_mode):
            if level >= depth:
                raise _too_deep(child, depth, rule, error)
            sub = open_child(fd, entry.name, st)
            if sub is None:
                if strict:
                    raise error(f"{child}: was replaced while its folder was listed; a checkpoint's folder must "
                                f"not change")
                continue
            try:
                yield from _walk(sub, child, prefix + entry.name + "/", level + 1, depth, strict, rule, error)
            finally:
                os.close(sub)
        elif strict:
            raise error(f"{child}: is {kind_of(st.st_mode)}; {_OTHERS}")


def tag_files(folder: str, depth: int = TAG_DEPTH, error: type = CheckpointFormatError,
              what: str = "the tag folder", folders: str = _TOO_DEEP) -> List[TagFile]:
    """Every regular file in ``folder`` and its sub-folders (at most ``depth`` levels down), sorted by
    name (``a/b`` for a file in a sub-folder). Refused with ``error``, in one line naming the entry:
    ``folder`` itself a link or no folder (``what`` names it), a link or anything but a regular file
    or a folder inside, a sub-folder deeper than ``depth`` (``folders`` says why), an entry that
    vanishes or is replaced while listed."""
    top = os.path.abspath(os.fspath(folder))
    fd = _open_top(top, what, error)
    try:
        found = [TagFile(name, path, st) for name, path, st in _walk(fd, top, "", 0, depth, True, folders, error)]
    finally:
        os.close(fd)
    return sorted(found, key=lambda f: f.name)


def named_files(folder: str, names: Sequence[str], depth: int = TAG_DEPTH,
                error: type = CheckpointFormatError) -> List[TagFile]:
    """The files ``names`` (relative to ``folder``, ``a/b`` below a sub-folder; a manifest's list) in
    that order, each found by the walk's rules: every folder on the way opened without following a
    link, at most ``depth`` levels down, the file itself a regular file (a link is not followed).
    Anything else, or a file missing, is an ``error`` naming it."""
    top = os.path.abspath(os.fspath(folder))
    fds: Dict[str, int] = {"": _open_top(top, "the tag folder", error)}
    out = []
    try:
        for name in names:
            parts = name.split("/")
            if len(parts) - 1 > depth:
                raise _too_deep(os.path.join(top, *parts[:depth + 1]), depth, _TOO_DEEP, error)
            if any(p in ("", ".", "..") for p in parts):
                raise error(f"{os.path.join(top, name)}: is not a name inside the tag folder")
            prefix = ""
            for part in parts[:-1]:
                below = prefix + part + "/"
                if below not in fds:
                    try:
                        fds[below] = os.open(part, _DIR_FLAGS, dir_fd=fds[prefix])
                    except OSError as exc:
                        raise error(f"{os.path.join(top, below)}: is not a real folder inside the tag folder "
                                    f"({exc.strerror or exc}; links are not followed)") from None
                prefix = below
            path = os.path.join(top, name)
            try:
                st = os.stat(parts[-1], dir_fd=fds[prefix], follow_symlinks=False)
            except OSError as exc:
                raise error(f"{path}: cannot be found ({exc.strerror or exc})") from None
            if not stat.S_ISREG(st.st_mode):
                raise error(f"{path}: is {kind_of(st.st_mode)}; {_OTHERS}")
            out.append(TagFile(name, path, st))
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def held_bytes(fd: int, path: str, depth: int, error: type, rule: str) -> int:
    """Bytes the regular files in the folder ``fd`` (at ``path``) and below hold (``st_blocks * 512``;
    a file with several hard links counted once), at most ``depth`` folders down: links, anything but
    regular files and folders, and entries removed meanwhile are passed over. A sub-folder deeper than
    ``depth`` is an ``error`` (``rule`` says why)."""
    seen = set()
    total = 0
    for _, _, st in _walk(fd, path, "", 0, depth, False, rule, error):
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total
