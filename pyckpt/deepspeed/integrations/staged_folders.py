"""A framework's checkpoint folder (the Trainer's ``checkpoint-N``, accelerate's ``checkpoint_<i>``) staged
under a hidden name and renamed into place in one step once complete, for ``enable(save=...)``.

The framework writes its folder in several steps around DeepSpeed's save; under pyckpt those steps run into
``<parent>/.<name><suffix>/<name>``, which the frameworks' own listings (``get_last_checkpoint``, their
rotations, accelerate's ``load_state``) do not see. :class:`PendingFolder` renames it to ``<parent>/<name>``
on the main process when every process's files are there and, with an asynchronous save, when DeepSpeed's
background write is published (a thread waits for it, so training goes on), then runs the framework's
rotation. The next save, the end of training and the interpreter's exit join that wait; a killed run's
staging folders are removed by the next save into the same parent (:func:`clean_staging`).

What is already at ``<parent>/<name>`` is the framework's to replace only as far as the framework itself
would replace it (:func:`into_place`): the frameworks write a checkpoint file by file into a folder that
exists, so whatever of it the new checkpoint does not overwrite stays (a user's notes, a file of an
earlier save); a file, or a link, where the folder goes stops the save, as it stops the framework's own
(:func:`check_target`).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import threading
from typing import Callable, List, Optional, Tuple

from ...errors import printable
from ...execution.durable import fsync_path
from ...native import _core

log = logging.getLogger("pyckpt")

_PENDING: "set[PendingFolder]" = set()
_LOCK = threading.Lock()


class PendingFolder:
    """One staged checkpoint folder waiting for DeepSpeed's files: the main process renames it into place,
    then runs ``after`` (the framework's rotation). ``owner`` is the Trainer or Accelerator that saved it.
    ``write``, where given, is the framework's own part of the folder left to write (the Trainer's model
    files from a snapshot): it runs in the same background thread, and the folder is published only if it
    succeeds. A failure is raised by :meth:`join`, which says whether the folder was published; with
    nothing left to wait for, :meth:`start` publishes at once (its failure, too, raised by join)."""

    def __init__(self, owner, staged: str, staging_run: str, final: str, handle, after: Optional[Callable] = None,
                 write: Optional[Callable] = None):
        self.owner = owner
        self.staged, self.staging_run, self.final = staged, staging_run, final
        self.handle, self.after, self.write = handle, after, write
        self.error: Optional[BaseException] = None
        self.published = False
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        with _LOCK:
            _PENDING.add(self)
        if self.handle is None and self.write is None:
            self._run()
            return
        self.thread = threading.Thread(target=self._run, name="pyckpt-publish-folder", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        """Whether :meth:`join` would return at once."""
        return self.thread is None or not self.thread.is_alive()

    def _run(self) -> None:
        try:
            failed = None
            if self.write is not None:
                try:
                    self.write()
                except BaseException as exc:
                    failed = exc
            if self.handle is not None:
                self.handle.outcome()  # DeepSpeed's files done with the staging folder before it may go
            if failed is not None:
                shutil.rmtree(self.staging_run, ignore_errors=True)
                raise failed
            self.finish()
        except BaseException as exc:  # raised by join()
            shutil.rmtree(self.staging_run, ignore_errors=True)
            self.error = exc

    def finish(self) -> None:
        """The staged folder into place, then ``after``, once DeepSpeed's files are published."""
        ok, message = self.handle.outcome() if self.handle is not None else (True, None)
        if not ok:
            shutil.rmtree(self.staging_run, ignore_errors=True)
            log.warning("pyckpt: %s was not published (DeepSpeed's files failed: %s); the previous checkpoint "
                        "stays the newest", self.final, message)
            return
        into_place(self.staged, self.final)
        self.published = True
        shutil.rmtree(self.staging_run, ignore_errors=True)
        if self.after is not None:
            self.after()

    def join(self) -> bool:
        if self.thread is not None:
            self.thread.join()
        with _LOCK:
            _PENDING.discard(self)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.published


def check_target(final: str) -> None:
    """``final`` can take a checkpoint folder: absent, or a folder. A file there stops the save, as it stops
    the framework's own (its ``os.makedirs(..., exist_ok=True)`` raises FileExistsError), and is kept; so
    does a link, which the framework would write through and pyckpt does not."""
    if os.path.islink(final):
        raise FileExistsError(f"{printable(final)}: is a link where the checkpoint folder goes; pyckpt writes "
                              "through no link, and keeps it as it is (save elsewhere, or remove the link)")
    if os.path.lexists(final) and not os.path.isdir(final):
        raise FileExistsError(f"{printable(final)}: exists and is not a folder, so the checkpoint folder cannot be "
                              "made there (the framework's own save stops here too); it is kept as it is")


def into_place(staged: str, final: str) -> None:
    """``staged`` published as ``final``, replacing only what the framework's own save would overwrite:

    * ``final`` absent: ``staged`` renamed to it in one step;
    * ``final`` a folder of which the new checkpoint overwrites every entry (at every depth, a file by a
      file, a folder by a folder: the same step saved again): exchanged in one step, the old one removed
      after, so ``final`` is complete throughout;
    * ``final`` a folder holding anything the new checkpoint does not write (a user's notes, a file an
      earlier save wrote and this one does not): the new files moved into it, over those of the same name,
      the rest kept, as the framework's save writes beside them (``latest`` moved last); the folder is then
      not published in one step, as the framework's own is not;
    * anything else (a file or a link at ``final``, a file where the checkpoint has a folder or the
      reverse, a link inside): FileExistsError naming it, before anything is moved.
    """
    check_target(final)
    try:
        _core.rename_noreplace(staged, final)
        fsync_path(os.path.dirname(final))
        return
    except FileExistsError:
        check_target(final)
    if _overwrites_all(staged, final):
        _core.rename_exchange(staged, final)
        shutil.rmtree(staged, ignore_errors=True)  # the old folder, now at the staged name
        fsync_path(os.path.dirname(final))
        return
    moves = _merge_moves(staged, final)
    for source, target, over in moves:
        if over:
            os.replace(source, target)
        else:
            _core.rename_noreplace(source, target)
    for folder in dict.fromkeys(os.path.dirname(target) for _, target, _ in moves):
        fsync_path(folder)
    log.info("pyckpt: %s held files the checkpoint does not write: its files were moved in beside them",
             printable(final))


def _overwrites_all(new: str, old: str) -> bool:
    """Whether every entry under ``old`` is under ``new`` too, of the same kind (a regular file for a
    regular file, a folder for a folder), and ``old`` holds no link nor anything else: what the framework's
    save of ``new`` into ``old`` would leave is then ``new`` itself."""
    stack = [(new, old)]
    while stack:
        new_dir, old_dir = stack.pop()
        with os.scandir(old_dir) as entries:
            for entry in entries:
                counterpart = os.path.join(new_dir, entry.name)
                if entry.is_symlink() or os.path.islink(counterpart):
                    return False
                if entry.is_dir(follow_symlinks=False):
                    if not os.path.isdir(counterpart):
                        return False
                    stack.append((counterpart, entry.path))
                elif not (entry.is_file(follow_symlinks=False) and os.path.isfile(counterpart)):
                    return False
    return True


def _merge_moves(staged: str, final: str) -> List[Tuple[str, str, bool]]:
    """(source, target, over an existing file) for moving ``staged``'s entries into ``final``: a folder
    that is missing moves whole, one that exists is entered, a regular file replaces a regular file. A file
    where the checkpoint has a folder, a folder where it has a file, or a link on the way is a conflict the
    framework's own save fails on too (or, for the link, writes through): FileExistsError, nothing moved."""
    moves, last = [], []
    stack = [(staged, final)]
    while stack:
        source_dir, target_dir = stack.pop()
        for name in sorted(os.listdir(source_dir)):
            source, target = os.path.join(source_dir, name), os.path.join(target_dir, name)
            if not os.path.lexists(target):
                (last if name == "latest" else moves).append((source, target, False))
                continue
            if os.path.islink(target):
                raise FileExistsError(f"{printable(target)}: is a link where the checkpoint writes {printable(name)}; "
                                      "pyckpt writes through no link, and keeps it as it is")
            source_is_dir = os.path.isdir(source) and not os.path.islink(source)
            if source_is_dir and os.path.isdir(target):
                stack.append((source, target))
            elif not source_is_dir and os.path.isfile(target):
                (last if name == "latest" else moves).append((source, target, True))
            else:
                held = "folder" if os.path.isdir(target) else "file" if os.path.isfile(target) else "special file"
                raise FileExistsError(f"{printable(target)}: holds a {held} where the checkpoint writes a "
                                      f"{'folder' if source_is_dir else 'file'} (the framework's own save fails here "
                                      "too); kept as it is")
    return moves + last


def join_pending(owner=None) -> None:
    """Every staged checkpoint folder of this process (or of ``owner``) published, or its failure raised."""
    with _LOCK:
        pending = [p for p in _PENDING if owner is None or p.owner is owner]
    for p in pending:
        p.join()


@atexit.register
def _join_at_exit() -> None:
    try:
        join_pending()
    except Exception as exc:  # nobody is left to catch it
        log.error("pyckpt: a Trainer checkpoint could not be published at exit: %s", exc)


def clean_staging(parent: str, suffix: str, keep: str) -> None:
    """Staging folders (``.<name><suffix>``) a killed run left beside the checkpoints, not the ones this
    process still waits on."""
    with _LOCK:
        busy = {p.staging_run for p in _PENDING} | {keep}
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(parent, name)
        if name.startswith(".") and name.endswith(suffix) and path not in busy and not os.path.islink(path) \
                and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            log.info("pyckpt: removed %s, left by a save that did not finish", path)


def make_staging(beside: str, staging_run: str, suffix: str) -> None:
    """A new, empty ``staging_run`` (``beside/.<name><suffix>``): the staging folders a killed run left in
    ``beside`` removed first, this one's included."""
    clean_staging(beside, suffix, keep=staging_run)
    shutil.rmtree(staging_run, ignore_errors=True)
    os.makedirs(staging_run)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def agree(problem: Optional[BaseException]) -> None:
    """Every process raises the first problem any process found (a main process's check of the folder, its
    publication), or none does: a collective, every process calls it at the same point (where the one that
    found it raised alone, the others would wait in the next collective)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p is not None), None)
    if problem is not None:
        raise problem
