"""The CRC-32 of this node's newest memory checkpoint, read while a restarted job builds its engine.

A recovery reads every file it puts together once for its CRC-32 before any rank loads (a byte that
changed in memory since the save passes that checkpoint over). A restarted job knows its memory tier
from ``enable(memory=...)``, seconds before it loads: the node's first local rank then reads the
files of its node's newest share of the job in a background thread, while the engine is built, and
the recovery takes each CRC read here for a file that is the same file unchanged since (its device,
inode, size and modification time), reading only the others. Nothing is decided here: a share this
did not read, or read and found damaged, is read again by the recovery, and any failure here is
silent (the recovery meets it and says so).

After its own share the node's newest replica of each other node's share is read (what a recovery
after the loss of that node puts together from this one). Once the recovery asks, the read ahead
goes on only with the files it asked for, so that a restart that lost no node never waits for
replicas it does not read.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from . import node_manifest as nm
from .job_identity import named
from .memory_root import node_folders
from .nodes import this_node

_lock = threading.Lock()
_read: Dict[tuple, int] = {}  # (st_dev, st_ino, st_size, st_mtime_ns) -> the CRC-32 read
_thread: Optional[threading.Thread] = None
_wanted: Optional[set] = None  # (st_dev, st_ino) of the files the recovery asked for, once it has
# replicas are read this many files at a time, so that a recovery's request stops the read ahead soon
_CHUNK = 4


def _key(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def start(tier) -> bool:
    """Begin reading this node's newest share of ``tier``'s job, on the node's first local rank of a job
    whose tier names its folder (an explicit job, ``$PYCKPT_JOB_ID`` or torchrun's run id); whether a
    read began."""
    global _thread, _wanted
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    if not named(tier.job):
        return False  # the folder is named after the save dir, which the load names later
    with _lock:
        if _thread is not None and _thread.is_alive():
            return False
        _wanted = None
        _thread = threading.Thread(target=_read_newest, args=(tier, ), name="pyckpt-precheck", daemon=True)
        _thread.start()
    return True


def _read_newest(tier) -> None:
    try:
        node = this_node()
        for n, folder in node_folders(tier.root_path, tier.job_name):
            if n != node:
                continue
            found = nm.shares(folder)
            if not found:
                return
            _read_share(max(found, key=lambda item: item[1].step), False)
            for replica in nm.replica_folders(folder):
                held = nm.shares(replica)
                if held:
                    _read_share(max(held, key=lambda item: item[1].step), True)
    except Exception:  # noqa: BLE001 - the recovery reads what this did not, and reports what it meets
        return


def _read_share(found, optional: bool) -> None:
    """The CRC-32s of a share's files (``found``: (path, manifest)); an ``optional`` one in small
    batches, each only the files the recovery asked for once it has asked."""
    path, manifest = found
    paths = [(os.path.join(path, name), size) for name, size, _ in manifest.files]
    step = _CHUNK if optional else max(1, len(paths))
    for i in range(0, len(paths), step):
        batch = paths[i:i + step]
        if optional:
            with _lock:
                wanted = _wanted
            if wanted is not None:
                batch = [(p, size) for p, size in batch if _ident(p) in wanted]
        for crc, st in nm.crcs(batch):
            with _lock:
                _read[_key(st)] = crc


def _ident(path: str) -> Optional[tuple]:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def crcs(paths: Sequence[Tuple[str, Optional[int]]]) -> List[Tuple[int, os.stat_result]]:
    """:func:`..node_manifest.crcs` of ``paths``, taking the CRC-32 read ahead for a regular file of the
    expected size that is the file read then, unchanged; the read ahead is waited for first (from here
    on it reads only these files)."""
    global _wanted
    wanted = {_ident(path) for path, _ in paths}
    with _lock:
        _wanted = wanted
        pending = _thread
    if pending is not None:
        pending.join()
    out: Dict[int, Tuple[int, os.stat_result]] = {}
    for i, (path, size) in enumerate(paths):
        try:
            st = os.lstat(path)
        except OSError:
            continue  # read below, where its error is said
        with _lock:
            crc = _read.get(_key(st))
        if crc is not None and stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size):
            out[i] = (crc, st)
    unread = [i for i in range(len(paths)) if i not in out]
    out.update(zip(unread, nm.crcs([paths[i] for i in unread])))
    return [out[i] for i in range(len(paths))]


def forget() -> None:
    """Drop what was read (tests; a job that saved again has other bytes in those files anyway)."""
    global _thread
    with _lock:
        pending = _thread
    if pending is not None:
        pending.join()
    global _wanted
    with _lock:
        _read.clear()
        _thread = None
        _wanted = None
