"""The free slot of a node's memory folder: the files of a retired share, kept for the next save to
write over in place.

tmpfs pages are the node's memory, and a fresh file's pages are allocated (and zeroed) as the save
writes them. A memory save therefore never starts from nothing once the tier is warm: when a share
leaves the tier (pruned beyond ``keep``, or retired before a save so that the tier holds no more than
``max(keep, 2)`` checkpoints), its folder becomes ``<node folder>/.pyckpt-slot``, and each rank of the
next save moves the file it is about to write from there into its staging folder and writes over it
(``write_archives(reuse_outputs=True)``): the same pages, no new allocation. DeepSpeed names a tag's
files by rank and layout, not by tag, so a steady run finds every file it writes there.

The slot is never a checkpoint: a hidden name (which listings of shares skip, and no tag can take),
its manifest removed right after the rename. Whatever a save did not take is removed once it is
published; a killed save leaves at most one slot, which the next save takes from or removes.
Only a regular file with one link is taken (a recovery's assembly links shares' files; those stay
where they are).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Optional

from ...errors import CheckpointFormatError
from ...execution.leftovers import remove_path
from .folder_names import SLOT
from .folder_walk import TAG_DEPTH, held_bytes

NAME = SLOT


def path(node_folder: str) -> str:
    return os.path.join(node_folder, NAME)


def retire(node_folder: str, share: str) -> None:
    """``share`` (a tag folder of ``node_folder`` leaving the tier) becomes the free slot, or is removed
    where a slot is already there. Either way it stops being a share at the rename."""
    slot = path(node_folder)
    if os.path.lexists(slot):
        remove_path(share)
        return
    os.rename(share, slot)
    from .node_manifest import NAME as MANIFEST

    try:
        os.unlink(os.path.join(slot, MANIFEST))
    except FileNotFoundError:
        pass


def take(node_folder: str, staging: str, target: str) -> bool:
    """Moves the slot's file of the same name as ``target`` (a path below ``staging``) to ``target``,
    where the slot holds one as a regular file with one link and ``target`` does not exist yet. True
    when moved (the write then reuses its pages)."""
    rel = os.path.relpath(target, staging)
    if rel.startswith("..") or os.path.isabs(rel):
        return False
    source = os.path.join(path(node_folder), rel)
    try:
        st = os.lstat(source)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or os.path.lexists(target):
        return False
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EXDEV, errno.ENOTDIR):
            return False
        raise
    return True


def discard(node_folder: str) -> None:
    """Removes what the last save did not take from the slot."""
    slot = path(node_folder)
    if os.path.lexists(slot):
        remove_path(slot)


def size(node_folder: str) -> int:
    """Bytes the slot's files hold (tmpfs pages a save reuses), links not followed; 0 where there is no
    slot (or a link in its place). A slot nests no deeper than the tag folder it was."""
    slot = path(node_folder)
    try:
        fd = os.open(slot, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return held_bytes(fd, slot, TAG_DEPTH, CheckpointFormatError, "the free slot was a tag folder, which nests "
                          f"at most {TAG_DEPTH} folders")
    finally:
        os.close(fd)


def oldest_to_retire(found, keep: int, protect: Optional[str] = None) -> list:
    """Of ``found`` ((path, manifest) of the run's shares on this node), the ones to retire before a
    save so that, with the new one, the node holds no more than ``max(keep, 2)`` checkpoints: oldest
    first, never the newest complete one."""
    ranked = sorted(found, key=lambda pm: pm[1].step)
    room = len(ranked) + 1 - max(keep, 2)
    out = [p for p, _ in ranked[:max(0, min(room, len(ranked) - 1))]]
    return [p for p in out if os.path.basename(p) != protect]


def retire_before_save(folder: str, owner, model: str, keep: int, protect: Optional[str] = None) -> None:
    """Before a save into ``folder`` (a node's folder or a replica folder): the run's oldest shares
    (``owner(manifest)``, this ``model``) beyond what it may hold with the new one leave, the first as
    the free slot the save writes over (:func:`oldest_to_retire`)."""
    from .node_manifest import shares

    found = [(p, m) for p, m in shares(folder) if owner(m) and m.model == model]
    for share in oldest_to_retire(found, keep, protect):
        retire(folder, share)
