"""A framework's checkpoint folder (the Trainer's ``checkpoint-N``, accelerate's ``checkpoint_<i>``) staged
under a hidden name and renamed into place in one step once complete, for ``enable(save=...)``.

The framework writes its folder in several steps around DeepSpeed's save; under pyckpt those steps run into
``<parent>/.<name><suffix>/<name>``, which the frameworks' own listings (``get_last_checkpoint``, their
rotations, accelerate's ``load_state``) do not see. :class:`PendingFolder` renames it to ``<parent>/<name>``
on the main process when every process's files are there and, with an asynchronous save, when DeepSpeed's
background write is published (a thread waits for it, so training goes on), then runs the framework's
rotation. The next save, the end of training and the interpreter's exit join that wait; a killed run's
staging folders are removed by the next save into the same parent (:func:`clean_staging`).
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import logging
import os
import shutil
import sys
import threading
from typing import Callable, Optional

from ..native import _core
from .save import engine_hook

log = logging.getLogger("pyckpt")

_PENDING: "set[PendingFolder]" = set()
_LOCK = threading.Lock()


class PendingFolder:
    """One staged checkpoint folder waiting for DeepSpeed's files: the main process renames it into place,
    then runs ``after`` (the framework's rotation). ``owner`` is the Trainer or Accelerator that saved it.
    ``write``, where given, is the framework's own part of the folder left to write (the Trainer's model
    files from a snapshot): it runs in the same background thread, and the folder is published only if it
    succeeds (its error is raised by :meth:`join`)."""

    def __init__(self, owner, staged: str, staging_run: str, final: str, handle, after: Optional[Callable] = None,
                 write: Optional[Callable] = None):
        self.owner = owner
        self.staged, self.staging_run, self.final = staged, staging_run, final
        self.handle, self.after, self.write = handle, after, write
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.handle is None and self.write is None:
            self.finish()
            return
        self.thread = threading.Thread(target=self._after_write, name="pyckpt-publish-folder", daemon=True)
        with _LOCK:
            _PENDING.add(self)
        self.thread.start()

    def _after_write(self) -> None:
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
        shutil.rmtree(self.staging_run, ignore_errors=True)
        if self.after is not None:
            self.after()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
        with _LOCK:
            _PENDING.discard(self)
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def into_place(staged: str, final: str) -> None:
    """``staged`` renamed to ``final`` in one step: a save of a step saved before swaps with the old folder,
    which is removed after (``final`` exists throughout)."""
    try:
        _core.rename_noreplace(staged, final)
    except FileExistsError:
        _core.rename_exchange(staged, final)
        shutil.rmtree(staged, ignore_errors=True)
    fd = os.open(os.path.dirname(final), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls ``patch(module)`` when the module ``name`` is imported after ``enable()`` (transformers and
    accelerate load theirs lazily), while a save mode is set."""

    def __init__(self, name: str, patch: Callable):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patch
        run = loader.exec_module

        def exec_module(mod):
            run(mod)
            if engine_hook.mode() is not None:
                patch(mod)
        loader.exec_module = exec_module
        return spec

    def install(self) -> None:
        """Patch the module now if it is loaded, else when it is imported."""
        module = sys.modules.get(self.name)
        if module is not None:
            self.patch(module)
        elif self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


_MISSING = object()


class MethodOnImport:
    """``<module>.<class_name>.<name>`` replaced by ``wrap(original)`` when the module is loaded (now, or on its
    import after ``enable()``), put back as it was by :meth:`uninstall`."""

    def __init__(self, module: str, class_name: str, name: str, wrap: Callable[[Callable], Callable]):
        self.class_name, self.name, self.wrap = class_name, name, wrap
        self.saved: dict = {}  # class -> its own attribute before, or _MISSING where it inherited one
        self.finder = PatchOnImport(module, self._patch)

    def _patch(self, module) -> None:
        cls = getattr(module, self.class_name)
        if cls in self.saved:
            return
        self.saved[cls] = cls.__dict__.get(self.name, _MISSING)
        setattr(cls, self.name, self.wrap(getattr(cls, self.name)))

    def install(self) -> None:
        self.finder.install()

    def uninstall(self) -> None:
        self.finder.uninstall()
        for cls, own in list(self.saved.items()):
            if own is _MISSING:
                delattr(cls, self.name)
            else:
                setattr(cls, self.name, own)
            del self.saved[cls]
