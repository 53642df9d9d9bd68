"""Putting an output folder in place: complete or absent, never replacing what it must not.

A run writes into a hidden staging folder beside OUTPUT and publishes it with one atomic rename;
``latest_universal`` (or another pointer file) is replaced atomically after that. Around it:

* **A lock per output** (``.<name>.pyckpt-lock`` beside it, a POSIX record lock, which NFS carries
  between nodes): two runs into one OUTPUT never interleave. A run removes the file while it still
  holds the lock; a run that was waiting on it may then hold a lock on a file no longer there, so
  every locker checks, once locked, that the path still names the file it locked, and otherwise
  locks anew. A killed run's file stays until the next run into OUTPUT (or ``clean()``) ends.
* **No replacement without consent**: without ``overwrite`` the rename is ``RENAME_NOREPLACE``, so an
  OUTPUT that appeared meanwhile (even an empty folder, which plain rename(2) would replace) stays.
* **An atomic swap with consent**: ``RENAME_EXCHANGE`` swaps old and new, so OUTPUT always exists.
  Filesystems without it get two renames (OUTPUT aside, then staging in); a kill between them
  leaves the old output under ``.<name>.pyckpt-old-*``, which the next run or ``--clean`` renames
  back before anything else.
* **Orphans are found by the lock**: staging names carry host, pid and a random part, but what makes
  removing one safe is holding OUTPUT's lock: no live pyckpt run can own staging for it then, on any
  node. Every run cleans before it starts; ``clean()`` does only that.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import signal
import stat
import warnings
from typing import Callable, List, Optional

from ..native import _core
from ..errors import CheckpointFormatError, OutputExistsError, OutputLockError, PointerNameError, RanksFailedError

STAGING, OLD, POINTER_TMP, LOCK = "pyckpt-tmp", "pyckpt-old", "pyckpt-ptr", "pyckpt-lock"


def pointer_name_problem(name: str) -> str:
    """Why a pointer file (``latest``, ``latest_universal``) holding ``name`` would not lead DeepSpeed
    back to the folder of that name, or '' if it would. DeepSpeed reads a pointer as
    ``read().strip()``; a control character is refused too (a newline or an escape sequence in a
    one-line pointer file and in every message that names it)."""
    if name != name.strip():
        return "starts or ends with whitespace, which DeepSpeed strips when it reads the name back"
    bad = re.search(r"[\x00-\x1f\x7f-\x9f]", name)
    if bad:
        return f"contains the control character {bad.group()!r}"
    return ""


def check_pointer_name(output: str, pointer: str) -> None:
    """PointerNameError unless ``pointer`` beside ``output`` can name it (see :func:`pointer_name_problem`)."""
    parent, base = os.path.split(os.path.abspath(os.fspath(output)))
    problem = pointer_name_problem(base)
    if problem:
        raise PointerNameError(f"{parent}: the output folder name {base!r} {problem}; {pointer}, which names it, "
                               "would not lead DeepSpeed back to it. Choose a name without whitespace at either "
                               "end or control characters")


def _fault_point(name: str) -> None:
    """Test hook: ``PYCKPT_TEST_KILL_AT=<name>`` kills this process with SIGKILL at that step, so
    fault-injection tests can stop a run between any two renames. Costs one environment lookup."""
    if os.environ.get("PYCKPT_TEST_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _rank_fault_point(rank: int) -> None:
    """Test hook: ``PYCKPT_TEST_FAIL_RANK=<rank>`` makes that rank of a spread run fail once it has
    written its share, as a full disk would, so tests can see every rank raise and nothing remain."""
    if os.environ.get("PYCKPT_TEST_FAIL_RANK") == str(rank):
        raise OSError(errno.EIO, f"injected failure on rank {rank} (PYCKPT_TEST_FAIL_RANK)")


def owner_id() -> str:
    # os.uname and os.urandom rather than socket and secrets: the same name and randomness, without
    # their imports (a tenth of a short export's start-up)
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", os.uname().nodename)[:64] or "host"
    return f"{host}-{os.getpid()}-{os.urandom(4).hex()}"


def _no_unsupported(exc: OSError) -> bool:
    return exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def remove_path(path: str) -> None:
    """Removes a file, a link (not its target) or a folder tree."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class OutputLock:
    """An exclusive POSIX lock on ``.<name>.pyckpt-lock`` beside the output, held until release(),
    which removes the file. With ``wait=False`` a lock another run holds is not waited for: ``held``
    is False then."""

    def __init__(self, output: str, notify: Optional[Callable[[str], None]] = None, wait: bool = True):
        parent, base = os.path.split(output)
        self.path = os.path.join(parent, f".{base}.{LOCK}")
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


def stale_entries(parent: str, base: str) -> List[str]:
    """Names beside OUTPUT that an earlier run into it left behind (only meaningful under its lock)."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    prefixes = tuple(f".{base}.{kind}-" for kind in (STAGING, OLD, POINTER_TMP))
    return sorted(n for n in names if n.startswith(prefixes) or _is_legacy_old(n, base))


def _is_legacy_old(name: str, base: str) -> bool:
    """``<name>.pyckpt-old-<pid>``: a swapped-out output of pyckpt 0.1, which took no lock."""
    return re.fullmatch(re.escape(base) + r"\.pyckpt-old-\d+", name) is not None


def _is_old(name: str, base: str) -> bool:
    return name.startswith(f".{base}.{OLD}-") or _is_legacy_old(name, base)


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
            if _is_old(name, base) and not os.path.lexists(output) and os.path.isdir(path) and not os.path.islink(path):
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
    pattern = re.compile(r"\.(.+)\.(?:(?:%s|%s|%s)-.+|%s)" % (STAGING, OLD, POINTER_TMP, LOCK))
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return []
    return sorted({m.group(1) for m in map(pattern.fullmatch, names) if m})


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
        self.staging = os.path.join(self.parent, f".{self.base}.{STAGING}-{self.owner}")
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
        except BaseException:
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
        _fault_point("before-publish")
        old = None
        if os.path.lexists(self.output):
            if not self.overwrite:
                raise OutputExistsError(f"{self.output} appeared while converting (pass --overwrite to replace it)")
            old = self._swap()
        else:
            self._rename_noreplace()
        self.published = True
        _fault_point("after-publish")
        if self.fsync:
            _fsync_dir(self.parent)
        if self.pointer:
            self._write_pointer()
        _fault_point("after-pointer")
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
        aside = os.path.join(self.parent, f".{self.base}.{OLD}-{self.owner}")
        os.rename(self.output, aside)
        _fault_point("between-renames")
        try:
            os.rename(self.staging, self.output)
        except BaseException:
            os.rename(aside, self.output)
            raise
        return aside

    def _write_pointer(self) -> None:
        tmp = os.path.join(self.parent, f".{self.base}.{POINTER_TMP}-{self.owner}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, self.base.encode())
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _fault_point("before-pointer-rename")
            os.replace(tmp, self.pointer)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        self.pointer_written = True
        if self.fsync:
            _fsync_dir(self.parent)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_published(plan, output: str, *, overwrite: bool = False, fsync: bool = False,
                    pointer: Optional[str] = "latest_universal", workers: Optional[int] = None,
                    progress: bool = False, notify: Optional[Callable[[str], None]] = None, ranks=None) -> dict:
    """Runs ``plan`` into a staging folder beside ``output`` and publishes it (see :class:`Publisher`).

    An exception raised once the output is in place carries ``pyckpt_published`` (the output),
    ``pyckpt_pointer`` (the pointer file's name, or None) and ``pyckpt_pointer_written``, so the
    caller can tell the user what is on disk although the run did not finish.

    With ``ranks`` (a :class:`~pyckpt.execution.distributed.TorchRanks` of more than one process,
    every one calling with the same plan and arguments) the output files are shared out among them
    (:func:`write_published_together`); the byte counts returned are the totals of all ranks."""
    from .distributed import several
    from .executor import execute

    if several(ranks):
        return write_published_together(plan, output, ranks, overwrite=overwrite, fsync=fsync, pointer=pointer,
                                        workers=workers, progress=progress, notify=notify)
    with Publisher(output, overwrite=overwrite, fsync=fsync, pointer=pointer, notify=notify) as out:
        try:
            stats = execute(plan, out.staging, workers, progress, fsync=fsync)
            out.publish()
        except BaseException as exc:
            if out.published:
                _mark_published(exc, output, pointer, out.pointer_written)
            raise
    return stats


def _mark_published(exc: BaseException, output: str, pointer: Optional[str], pointer_written: bool) -> None:
    exc.pyckpt_published = output
    exc.pyckpt_pointer = pointer
    exc.pyckpt_pointer_written = pointer_written


def write_published_together(plan, output: str, ranks, *, overwrite: bool = False, fsync: bool = False,
                             pointer: Optional[str] = "latest_universal", workers: Optional[int] = None,
                             progress: bool = False, notify: Optional[Callable[[str], None]] = None) -> dict:
    """:func:`write_published` by several processes: rank 0 locks, cleans and makes the staging folder,
    every rank writes its share of the files into it, and only when all succeeded does rank 0 publish.
    A failure anywhere leaves no output and no staging folder, and raises
    :class:`~pyckpt.errors.RanksFailedError` on every rank."""
    from .distributed import agreed, describe_failure, split_outputs
    from .executor import execute

    share = split_outputs(plan, ranks.size)[ranks.rank]
    lead = ranks.rank == 0
    with contextlib.ExitStack() as stack:
        with agreed(ranks, "preparing the output") as vote:
            if lead:
                # rank 0 holds the lock to the end; leaving this block by any route removes staging
                out = stack.enter_context(Publisher(output, overwrite=overwrite, fsync=fsync, pointer=pointer,
                                                    notify=notify))
                vote.value = out.staging
        staging = vote.values[0]
        with agreed(ranks, "writing the output files") as vote:
            vote.value = execute(share, staging, workers, progress, fsync=fsync)
            _rank_fault_point(ranks.rank)
        totals = {key: sum(stats[key] for stats in vote.values) for key in vote.values[0]}
        # Publishing is rank 0's alone; the others wait on its outcome (one broadcast), so that they
        # too return only once the output is in place, or raise when it is not.
        failure, outcome = None, None
        if lead:
            try:
                out.publish()
            except Exception as exc:
                failure = exc
                outcome = (describe_failure(exc), out.published, out.pointer_written)
        outcome = ranks.broadcast(outcome)
        if outcome is not None:
            message, published, pointer_written = outcome
            error = RanksFailedError("publishing the output", {0: message}, ranks.size)
            if published:
                _mark_published(error, output, pointer, pointer_written)
            raise error from failure
    return totals


def agreed_plan(ranks, what: str, given_input, output: str, dry_run: bool, make_plan: Callable[[], tuple]) -> tuple:
    """``make_plan()``, whose result starts with (the checkpoint read, its plan), run by every process of
    ``ranks`` (or alone): every process must plan the same bytes, and a real run's output must lie apart
    from the checkpoint (:func:`check_apart`). A failure on any process fails every process
    (:func:`~pyckpt.execution.distributed.agreed`). Returns ``make_plan``'s result."""
    from .distributed import agreed, plan_digest

    with agreed(ranks, what, same=True) as vote:
        result = make_plan()
        checkpoint, plan = result[0], result[1]
        if not dry_run:
            check_apart(given_input, checkpoint.folder, output, plan.input_files)
        if ranks:
            vote.value = plan_digest(plan)
    return result


# The pointer files of a save folder: part of the checkpoint whichever of them led to the tag folder.
POINTERS = ("latest", "latest_universal")


def _is_or_inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _spellings(path: str) -> set:
    """Where ``path`` lies once its folders are resolved, and what it resolves to itself: a link is
    replaced where it lies, while its target is what a reader of it reads."""
    head, base = os.path.split(os.path.abspath(path))
    return {os.path.join(os.path.realpath(head), base), os.path.realpath(path)}


def check_apart(given_input, tag_folder: str, output: str, input_files=()) -> None:
    """OUTPUT may not be, lie inside, or contain any file or folder the checkpoint consists of.

    With --overwrite any of these would replace input with output, so it is refused whatever
    ``overwrite`` says. What the checkpoint consists of: the folder it is read from (``tag_folder``:
    a ZeRO tag folder, a Universal folder with its ``zero/`` tree), the folder the user named
    (``given_input``: that folder, or the save folder holding ``latest``), the pointer files
    (``latest``, ``latest_universal``) beside the tag folder and in the folder named, the tag folder
    that ``latest`` names there (the save folder's current checkpoint, whichever tag was given), and
    ``input_files``, the other files the plan read (a model config, a tokenizer beside the
    checkpoint). Links and ``.``/``..`` are resolved first, so another spelling of the same path is
    caught too. OUTPUT inside the folder holding ``latest`` is DeepSpeed's usual layout (a
    ``global_stepN_universal`` beside ``global_stepN``) and allowed, as long as it is none of these."""
    out = os.path.realpath(output)

    def refuse(relation: str, what: str) -> None:
        raise CheckpointFormatError(f"{output}: the output {relation} {what}; writing there could replace the "
                                    "checkpoint being read. Choose an output outside it (e.g. beside the tag "
                                    "folder)")

    given = os.path.realpath(os.fspath(given_input))
    for src, may_hold_output in ((os.path.realpath(tag_folder), False), (given, True)):
        inside = _is_or_inside(out, src)
        contains = src.startswith(out.rstrip(os.sep) + os.sep)
        if out == src or contains or (inside and not may_hold_output):
            refuse("is" if out == src else ("contains" if contains else "lies inside"),
                   f"the input checkpoint folder {src}")
    folders = {os.path.dirname(os.path.abspath(tag_folder)), os.path.dirname(os.path.realpath(tag_folder))}
    if os.path.isdir(given):
        folders.add(given)
    parts = [os.path.join(f, name) for f in sorted(folders) for name in POINTERS]
    parts += [os.path.join(f, tag) for f in sorted(folders) if (tag := _latest_tag(f))]
    parts += [os.fspath(f) for f in input_files]
    for path in parts:
        if not os.path.lexists(path):
            continue
        for spelling in sorted(_spellings(path)):
            inside = _is_or_inside(out, spelling)
            if inside or spelling.startswith(out.rstrip(os.sep) + os.sep):
                kind = "folder" if os.path.isdir(path) else "file"
                refuse("is" if out == spelling else ("lies inside" if inside else "contains"),
                       f"the input checkpoint's {kind} {path}")


def _latest_tag(folder: str) -> str:
    """The tag folder name ``latest`` in ``folder`` names: that checkpoint is the save folder's
    current one even when another tag folder was given; '' when there is none to read. A ``latest``
    that cannot be read is not this check's to refuse (discovery refuses it where it is the input)."""
    from ..formats.confined import read_small_text

    try:
        tag = read_small_text(folder, "latest").strip()
    except (CheckpointFormatError, OSError):
        return ""
    return tag if tag not in ("", ".", "..") and "/" not in tag and "\x00" not in tag else ""
