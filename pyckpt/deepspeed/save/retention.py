"""``keep_last``: after a save is published, older checkpoints beyond the K newest are removed.

What the Hugging Face Trainer calls ``save_total_limit``, done so that no fault costs the newest
complete checkpoint: only folders that hold DeepSpeed checkpoint files count; the folder
``latest`` or ``latest_universal`` names is never removed, nor one whose output lock another run
holds; a checkpoint's own conversions (``<tag>_universal``, ``<tag>_hf``) go with it unless a
pointer names them. Each removal first renames the folder to a hidden staging name under its
lock (one atomic step: a checkpoint is whole or gone from view), then deletes it; a kill between
the two leaves a staging folder that the next save removes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from typing import List, Optional

from ...errors import CheckpointFormatError
from ...formats.torch_zip import read_capped, regular_fd

from ...execution.publish import STAGING, OutputLock, OutputLockError, owner_id, remove_path

log = logging.getLogger("pyckpt")

POINTERS = ("latest", "latest_universal")
_CHECKPOINT_FILE = re.compile(r"(.*model_states\.pt|.*optim_states\.pt|zero_pp_rank_.*\.pt|.*expert_.*\.pt)")
CONVERSIONS = ("_universal", "_hf")


class PointerUnreadable(OSError):
    """A pointer file that is there but is no regular file of the folder (a link, a FIFO, a folder)."""


def read_pointer(save_dir: str, pointer: str = "latest") -> Optional[str]:
    """The name ``save_dir/<pointer>`` holds, as DeepSpeed reads it (stripped), or None if there is
    no such file. A pointer that is a link (to a secret, to /proc) or anything but a regular file
    is not followed or read: PointerUnreadable. O_NONBLOCK keeps a FIFO from blocking the open."""
    path = os.path.join(save_dir, pointer)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise PointerUnreadable(exc.errno, f"{path}: not a regular file ({exc.strerror})") from None
    try:
        fd = regular_fd(fd, path)
        data = read_capped(fd, path, POINTER_BYTES)
    except CheckpointFormatError as exc:
        raise PointerUnreadable(errno.EINVAL, str(exc)) from None
    return data.decode("utf-8", errors="replace").strip() or None


POINTER_BYTES = 4096  # a tag name; anything longer names no checkpoint pyckpt or DeepSpeed wrote


def _pointed(save_dir: str) -> set:
    """The names the pointers hold; PointerUnreadable if one cannot be read, since pruning without
    knowing what it names could remove the checkpoint a resume would load."""
    return {name for name in (read_pointer(save_dir, p) for p in POINTERS) if name}


def _is_checkpoint(folder: str) -> bool:
    if os.path.isdir(os.path.join(folder, "zero")):  # a Universal Checkpoint: a conversion, not a save
        return False
    try:
        with os.scandir(folder) as it:
            return any(e.is_file(follow_symlinks=False) and _CHECKPOINT_FILE.fullmatch(e.name) for e in it)
    except OSError:
        return False


def checkpoints(save_dir: str) -> List[str]:
    """The checkpoint tags in ``save_dir``, oldest first (by the folder's modification time: its
    files were written into it while it was staged, and publishing renames it unchanged)."""
    found = []
    with os.scandir(save_dir) as it:
        for e in it:
            if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                continue
            if _is_checkpoint(e.path):
                found.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
    return [name for _, name in sorted(found)]


def _remove(save_dir: str, name: str) -> bool:
    output = os.path.join(save_dir, name)
    try:
        lock = OutputLock(output, wait=False)
    except (OutputLockError, OSError):
        return False
    if not lock.held:
        return False  # another run (a conversion, a save of this tag) owns it
    try:
        doomed = os.path.join(save_dir, f".{name}.{STAGING}-{owner_id()}")
        try:
            os.rename(output, doomed)
        except FileNotFoundError:
            return False
        remove_path(doomed)
        return True
    finally:
        lock.release()


def keep_last(save_dir: str, k: int, newest: Optional[str] = None) -> List[str]:
    """Removes checkpoints of ``save_dir`` beyond the ``k`` newest; returns the names removed.
    ``newest`` (the tag just published) always counts as the newest."""
    tags = checkpoints(save_dir)
    if newest in tags:
        tags.remove(newest)
        tags.append(newest)
    protected = _pointed(save_dir)
    removed = []
    for tag in tags[:-k] if k < len(tags) else []:
        if tag in protected:
            continue
        if _remove(save_dir, tag):
            removed.append(tag)
            for suffix in CONVERSIONS:
                if tag + suffix not in protected and os.path.isdir(os.path.join(save_dir, tag + suffix)):
                    if _remove(save_dir, tag + suffix):
                        removed.append(tag + suffix)
    for name in removed:
        log.info("pyckpt: removed %s (keep_last=%d)", os.path.join(save_dir, name), k)
    return removed
