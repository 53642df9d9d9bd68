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

Until the tier holds ``max(keep, 2)`` checkpoints no share leaves it before a save, so the job's
second save (and, with a larger ``keep``, the next ones) would find no slot and allocate new pages
in the call. :func:`prepare_ahead` makes the slot beforehand: once a share is published and the next
save will retire none, a background thread creates the share's files in a new slot, each allocated
(written as zeros), the leader's own files mapped as the writer keeps a file it wrote over
(``native.prepare_output_map``; the other ranks map theirs at their next save).
The node then holds what it holds in the steady state (``max(keep, 2)`` checkpoints' pages, the slot
counted), and only where they fit the tier's budget as a checkpoint would. Whoever next reads or
removes the node folder joins the thread first (:func:`settle`).

Once the tier is full, the next save writes over the oldest share's files; a file its writer created
(the job's first saves, or a share from before a restart) has no kept mapping in that process, and
mapping it in the call costs about 0.1 s per GB of page tables. :func:`map_ahead` maps them before
that save, in each writer's own process. Both threads run at Linux's idle priority: they take a core the
training leaves idle, and what is left when the next save starts (:func:`settle`) runs while the ranks
wait there.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from typing import Dict, Iterable, Optional, Tuple

from ...errors import CheckpointFormatError
from ...execution.leftovers import remove_path
from .folder_names import NEXT_SLOT, SLOT
from .folder_walk import TAG_DEPTH, held_bytes

NAME = SLOT

log = logging.getLogger("pyckpt")

# The slots being made ahead, by node folder: the thread making each (joined by settle()).
_AHEAD: Dict[str, threading.Thread] = {}
_AHEAD_LOCK = threading.Lock()


def path(node_folder: str) -> str:
    return os.path.join(node_folder, NAME)


def next_path(node_folder: str) -> str:
    """The slot after the free slot: made with it before a job's first save (:mod:`..save.tier_preparation`),
    so that the second save too writes over pages allocated and mapped beforehand; it becomes the free
    slot once the first save has taken that one's files (:func:`promote_next`)."""
    return os.path.join(node_folder, NEXT_SLOT)


def promote_next(node_folder: str) -> bool:
    """The next slot becomes the free slot where there is none (a real folder, never a link). True when
    it did."""
    spare = next_path(node_folder)
    try:
        st = os.lstat(spare)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or os.path.lexists(path(node_folder)):
        return False
    os.rename(spare, path(node_folder))
    return True


def discard_next(node_folder: str) -> None:
    """Removes the next slot (a job that ends without saving)."""
    spare = next_path(node_folder)
    if os.path.lexists(spare):
        remove_path(spare)


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


def _in_folder(files: Iterable[Tuple[str, int]]) -> list:
    """The (name, size) of ``files`` directly in the tag folder (a name of one component): the only ones
    made or mapped ahead."""
    return [(name, size) for name, size in files if "/" not in name and name not in (".", "..")]


def prepare_ahead(node_folder: str, files: Iterable[Tuple[str, int]], room, mine=frozenset()) -> bool:
    """Starts making the free slot of ``node_folder`` from ``files`` ((name, size) of the share just
    published there, whose layout the next save repeats) in a background thread; ``room(nbytes)``
    says why that many bytes do not fit the tier now (None: they do); the names in ``mine`` (the
    files this process writes) are also mapped here. Only files directly in the tag folder are made;
    a slot already there, or one being made, is left as it is. True when started."""
    flat = [(name, int(size), name in mine) for name, size in _in_folder(files)]
    if not flat:
        return False
    settle(node_folder)
    if os.path.lexists(path(node_folder)):
        return False
    return _ahead(node_folder, "pyckpt-free-slot", _make, (node_folder, flat, room))


def _ahead(key: str, name: str, work, args: tuple, background: bool = True) -> bool:
    """Runs ``work(*args)`` in a background thread that :func:`settle` of ``key`` joins, or (not
    ``background``) now, at the caller's priority. True."""
    if not background:
        work(*args, idle=False)
        return True
    thread = threading.Thread(target=work, args=args, name=name, daemon=False)
    with _AHEAD_LOCK:
        _AHEAD[key] = thread
    thread.start()
    return True


def next_retired(node_folder: str, remaining, keep: int) -> Optional[str]:
    """The folder whose files the next save into ``node_folder`` writes over: the free slot where one is
    there, else the share that save retires first (``remaining``: the run's shares left, (path, manifest)),
    else None (the next save retires none)."""
    slot = path(node_folder)
    if os.path.lexists(slot):
        return slot
    out = oldest_to_retire(remaining, keep)
    return out[0] if out else None


def map_ahead(folder: str, files: Iterable[Tuple[str, int]], background: bool = True) -> bool:
    """Maps this process's ``files`` ((name, size), the names this process writes at every save) of
    ``folder`` (:func:`next_retired`) in a background thread, as the writer keeps the mapping of a
    file it wrote over: the next save takes them, same inodes, and copies into them without setting up
    their page tables in the call (about 0.1 s per GB; a file the writer created, rather than wrote
    over, has no mapping yet). Joined by :func:`settle`; not ``background``: mapped in the call. True when
    started (or done)."""
    flat = [(name, int(size)) for name, size in _in_folder(files)]
    if not flat:
        return False
    settle(folder)
    return _ahead(folder, "pyckpt-map-ahead", _map, (folder, flat), background)


def _map(folder: str, files, idle: bool = True) -> None:
    from ...native import map_output

    if idle:
        _yield_to_training()
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, or no folder: the next save maps what it takes
        return
    try:
        for name, size in files:
            map_output(fd, name, size, os.path.join(folder, name))
    except Exception as exc:  # noqa: BLE001 - only a cache of mappings: the next save maps what it takes
        log.debug("pyckpt: could not map %s ahead: %s", folder, exc)
    finally:
        os.close(fd)


def make_own(slot: str, files: Iterable[Tuple[str, int]], background: bool = True) -> bool:
    """Makes this process's ``files`` ((name, size), the files it writes at every save) in ``slot``, a free
    slot (or the next one) its node's leader made empty (before a job's first save:
    :mod:`..save.tier_preparation`): each allocated (written as zeros) and mapped as the writer keeps the
    mapping of a file it wrote over; in a background thread joined by :func:`settle`, or (not
    ``background``) in the call. A file that cannot be made is not left half-made; the save allocates
    what the slot lacks. True when started (or done)."""
    flat = [(name, int(size), True) for name, size in _in_folder(files)]
    if not flat:
        return False
    settle(slot)
    return _ahead(slot, "pyckpt-free-slot", _make_own, (slot, flat), background)


def _fill(slot: str, files, made: list) -> None:
    """Creates ``files`` ((name, size, mapped)) in the folder ``slot``, allocated, the ``mapped`` ones
    mapped; the names created are appended to ``made`` as they are."""
    from ...native import prepare_output_map

    fd = os.open(slot, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name, size, mapped in files:
            try:
                prepare_output_map(fd, name, size, os.path.join(slot, name), mapped)
            except FileExistsError:
                raise
            except BaseException:
                made.append(name)  # created, then the allocation failed (a full tmpfs): its pages go back too
                raise
            made.append(name)
    finally:
        os.close(fd)


def _make_own(slot: str, files, idle: bool = True) -> None:
    if idle:
        _yield_to_training()
    made: list = []
    try:
        _fill(slot, files, made)
    except Exception as exc:  # noqa: BLE001 - a slot is an optimisation; the next save allocates instead
        gone = isinstance(exc, FileNotFoundError)  # the slot was taken or removed meanwhile: nothing to undo
        log.log(logging.INFO if gone else logging.WARNING, "pyckpt: could not make this rank's files in %s%s: %s",
                slot, "" if gone else " (those made are removed)", exc)
        for name in made:
            try:
                os.unlink(os.path.join(slot, name))
            except OSError:
                pass


def _make(node_folder: str, files, room, idle: bool = True) -> None:
    if idle:
        _yield_to_training()
    slot = path(node_folder)
    try:
        problem = room(sum(size for _, size, _ in files))
        if problem:
            log.info("pyckpt: no free slot made ahead in %s: %s", node_folder, problem)
            return
        os.mkdir(slot, 0o700)
    except FileExistsError:
        return
    except Exception as exc:  # noqa: BLE001 - a slot is an optimisation; the next save allocates instead
        log.warning("pyckpt: could not make a free slot in %s: %s", node_folder, exc)
        return
    try:
        _fill(slot, files, [])
    except Exception as exc:  # noqa: BLE001 - a full tmpfs: its pages back to the node, the save goes on
        log.warning("pyckpt: could not make a free slot in %s (removed): %s", node_folder, exc)
        try:
            remove_path(slot)
        except OSError:
            pass


def _yield_to_training() -> None:
    """Runs this thread only on a core nothing else wants (Linux's SCHED_IDLE, which applies to the
    calling thread alone): the slot is made while training runs, and allocating a checkpoint's pages
    costs a core for about 0.4 s per GB (mapping them, about 0.1 s more), which the ranks' steps would
    otherwise wait for. What is left when the next save starts runs then, on the cores the ranks leave
    idle while they wait for it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or a policy a sandbox refuses: made at normal priority
        pass


def settle(node_folder: Optional[str] = None) -> None:
    """Joins the making of ``node_folder``'s free slot or the mapping of its files (every such thread
    of this process without one)."""
    with _AHEAD_LOCK:
        keys = [node_folder] if node_folder is not None else list(_AHEAD)
        threads = [(k, _AHEAD.get(k)) for k in keys]
    for key, thread in threads:
        if thread is None:
            continue
        thread.join()
        with _AHEAD_LOCK:
            if _AHEAD.get(key) is thread:
                del _AHEAD[key]
