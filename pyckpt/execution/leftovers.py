"""What killed runs leave beside an output, found by its name and removed under the output's lock.

Staging names carry host, pid and a random part (:mod:`.staging_names`), but what makes removing an
entry safe is holding OUTPUT's lock (:mod:`.output_lock`): no live pyckpt run can own staging for it
then, on any node. Every run cleans before it starts; ``clean()`` does only that. A swap cut between
its two renames left the old output aside: cleaning renames it back before anything else.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Callable, List, Optional

from ..errors import OutputLockError
from .output_lock import OutputLock
from .staging_names import LOCK, OLD, leftover


def remove_path(path: str) -> None:
    """Removes a file, a link (not its target) or a folder tree."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def stale_entries(parent: str, base: str) -> List[str]:
    """Names beside OUTPUT that an earlier run into it left behind (only meaningful under its lock)."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if (found := leftover(n, base)) and found[1] != LOCK)


def clean(output: str, notify: Optional[Callable[[str], None]] = None, lock: bool = True) -> List[str]:
    """Removes what dead runs into ``output`` left; restores an old output a killed swap set aside.

    Returns the names handled. Takes OUTPUT's lock unless the caller already holds it."""
    output = os.path.abspath(output)
    parent, base = os.path.split(output)
    held = OutputLock(output, notify) if lock else None
    try:
        done = []
        for name in stale_entries(parent, base):
            path = os.path.join(parent, name)
            if leftover(name, base)[1] == OLD and not os.path.lexists(output) and os.path.isdir(path) \
                    and not os.path.islink(path):
                os.rename(path, output)  # the swap was cut between its two renames: undo the first
                done.append(f"{name} (restored as {base})")
                continue
            remove_path(path)
            done.append(name)
        return done
    finally:
        if held:
            held.release()


def orphans(save_dir: str) -> List[str]:
    """Output names beside which killed pyckpt runs left staging, swap, pointer or lock entries."""
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return []
    return sorted({found[0] for found in map(leftover, names) if found})


def clean_orphans(save_dir: str) -> List[str]:
    """Removes what killed saves (and conversions) into ``save_dir`` left, for every tag whose lock
    is free: a held lock means a live run owns that staging folder, and it is left alone. Returns
    the names removed (a lock file, removed on release, is not listed)."""
    removed = []
    for base in orphans(save_dir):
        output = os.path.join(save_dir, base)
        try:
            lock = OutputLock(output, wait=False)
        except OutputLockError:
            raise
        except OSError:  # its lock file cannot be opened here: nothing of it is ours to judge
            continue
        if not lock.held:
            continue
        try:
            removed += clean(output, lock=False)
        finally:
            lock.release()
    return removed
