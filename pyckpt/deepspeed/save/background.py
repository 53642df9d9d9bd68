"""The second half of an asynchronous save: write the snapshot, agree, publish, in the background.

One thread per rank (the GIL released while the native writer runs) writes the rank's snapshotted
files into the staging folder, then posts its outcome in the process group's key-value store and,
on rank 0, waits for every rank's, publishes (or removes the staging folder) and posts the result
for the others. No collective of the training's process group runs here: a background thread
must not interleave collectives with the training's, and the store is served by its own
connection.

:class:`AsyncSave` is the handle ``save_checkpoint(..., async_save=True)`` returns: ``done()``,
``wait()`` (the outcome: True, or False / SaveError per ``on_error``), joined by the next save,
by ``pyckpt.deepspeed.wait_for_saves()`` and at interpreter exit.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import threading
import time
import weakref
from typing import Callable, List, Optional, Tuple

from ...errors import SaveError
from ...execution.distributed import describe_failure
from ...formats.torch_save_file import plan_files
from ...native import op_table, write_archives

log = logging.getLogger("pyckpt")

_PENDING: "weakref.WeakSet[AsyncSave]" = weakref.WeakSet()


class AsyncSave:
    """A save whose files are being written in the background (see module doc)."""

    def __init__(self, what: str, on_error: str, rank: int):
        self.what = what
        self.on_error = on_error
        self.rank = rank
        self.ok: Optional[bool] = None
        self.message: Optional[str] = None
        self.stall_s = 0.0  # how long the save call blocked the caller
        self.written_s = 0.0  # from the call to this rank's files written
        self.published_s = 0.0  # from the call to the outcome known here
        self._thread: Optional[threading.Thread] = None
        self._reported = False
        self._after: List[Callable[[], None]] = []

    def start(self, body: Callable[["AsyncSave"], tuple]) -> "AsyncSave":
        def run():
            try:
                self.ok, self.message = body(self)
            except BaseException as exc:  # the thread must always leave an outcome
                self.ok, self.message = False, f"{self.what}: the background write failed: {describe_failure(exc)}"

        self._thread = threading.Thread(target=run, name="pyckpt-async-save", daemon=False)
        _PENDING.add(self)
        self._thread.start()
        return self

    def finished(self, ok: bool, message: Optional[str]) -> "AsyncSave":
        """A handle for a save that is already over and reported (the synchronous fallback, or a
        refusal raised or warned by the call itself)."""
        self.ok, self.message = ok, message
        self._reported = True
        return self

    def then(self, step: Callable[[], bool]) -> None:
        """Runs ``step`` once the checkpoint is published, on the thread that joins this save (steps may be
        collective); ``step`` returns False where it reported its own failure, which the join returns."""
        self._after.append(step)

    def done(self) -> bool:
        """Whether the background work has ended (the outcome is then known on this rank)."""
        return self._thread is None or not self._thread.is_alive()

    def outcome(self) -> Tuple[Optional[bool], Optional[str]]:
        """(published, why not) once the background work has ended, waiting for it; nothing is reported or run
        (the caller's join does that): for a watcher on another thread, such as a framework folder waiting to
        be renamed into place."""
        if self._thread is not None:
            self._thread.join()
        return self.ok, self.message

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Joins the background work and returns True if the checkpoint was published. A failure
        raises :class:`SaveError` (``on_error="raise"``) or is logged once and returns False
        (``"warn"``); it is reported once, by the first join that sees it."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.what} is still being written after {timeout} s")
        _PENDING.discard(self)
        if self.ok and self._after:
            # conversions of the published checkpoint: collective, so they run here, on the caller's thread
            after, self._after = self._after, []
            for step in after:
                if not step():
                    self.ok, self._reported = False, True  # the conversion raised or warned already
                    return False
        if self.ok:
            return True
        if self._reported:
            return False
        self._reported = True
        if self.on_error == "raise":
            raise SaveError(self.message or f"{self.what} failed", published=False)
        if self.rank == 0:
            log.warning("pyckpt: %s", self.message)
        return False

    def __bool__(self) -> bool:  # `if save_checkpoint(...)` keeps its meaning for a finished save
        return bool(self.wait())

    def __repr__(self):
        state = "writing" if not self.done() else ("published" if self.ok else "failed")
        return f"<AsyncSave {self.what}: {state}>"


def wait_for_saves() -> None:
    """Joins every asynchronous save of this process still being written (failures are reported
    as each save's ``on_error`` says)."""
    for save in list(_PENDING):
        save.wait()


@atexit.register
def _join_at_exit() -> None:
    for save in list(_PENDING):
        try:
            save.wait()
        except Exception as exc:  # nobody is left to catch it: say it
            log.error("pyckpt: %s", exc)


def write_files(files, sources, root: str, fsync: bool, workers: int = 0) -> None:
    """The snapshot's files, written by the native writer with the GIL released."""
    outputs, rows = plan_files(files)
    write_archives(sources, outputs, op_table(rows), root=root, workers=workers, fsync=fsync)


def _wait_keys(store, keys: List[str], timeout: datetime.timedelta) -> None:
    """Until every key of ``keys`` is in ``store``, asking in short polls: a background thread must not
    block in ``store.wait``, which holds the process's one store client for the whole wait, so that a
    save's arrival on the main thread (or another background thread's round) could not get through to
    the store until the wait ended, and the wait may need that very arrival (the ranks would deadlock).
    TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.0005
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every key arrived within {timeout.total_seconds():g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


class StoreAgreement:
    """Every rank's outcome of one save, through the process group's store, under keys of its own."""

    def __init__(self, store, namespace: str, rank: int, world_size: int, timeout_s: float):
        self.store = store
        self.prefix = f"pyckpt/async/{namespace}/"
        self.rank = rank
        self.world_size = world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def post(self, outcome: Optional[str]) -> None:
        self.store.set(f"{self.prefix}rank/{self.rank}", json.dumps(outcome))

    def gather(self) -> List[Optional[str]]:
        keys = [f"{self.prefix}rank/{r}" for r in range(self.world_size)]
        try:
            _wait_keys(self.store, keys, self.timeout)
        except Exception as exc:
            missing = [r for r in range(self.world_size) if not self.store.check([keys[r]])]
            raise TimeoutError(f"rank(s) {missing} reported no outcome within {self.timeout.total_seconds():g} s "
                               f"({describe_failure(exc)})") from None
        return [json.loads(self.store.get(k)) for k in keys]

    def announce(self, ok: bool, message: Optional[str]) -> None:
        self.store.set(f"{self.prefix}result", json.dumps([ok, message]))

    def result(self) -> tuple:
        key = f"{self.prefix}result"
        _wait_keys(self.store, [key], self.timeout)
        ok, message = json.loads(self.store.get(key))
        return ok, message

    def forget(self) -> None:
        """This rank's own key, once the result is known everywhere it is needed."""
        try:
            self.store.delete_key(f"{self.prefix}rank/{self.rank}")
        except Exception:
            pass
