"""DeepSpeed's save with its file writes made unable to leave a rank behind.

``DeepSpeedEngine.save_checkpoint`` interleaves file writes with collectives (a barrier after the
folder is made, the tag check's all-reduces, ZeRO-3's persistent-parameter all-gather, a final
barrier). A write that raises on one rank sends that rank out of the call while the others wait
in the next collective for good (DeepSpeed 0.19.8, engine.py ``save_checkpoint``). So for the
duration of the call every write DeepSpeed makes is caught and recorded instead: the checkpoint
engine's ``makedirs``/``create``/``save``/``commit`` and the recovery-script copy, the only file
writes on that path. The failing rank then skips its remaining writes but still reaches every
collective, and the caller agrees on the outcome afterwards.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional

from ...execution.distributed import describe_failure


class WriteFailures:
    """The writes that failed on this rank during one save (the first one is the cause)."""

    def __init__(self):
        self.messages: List[str] = []

    def __bool__(self) -> bool:
        return bool(self.messages)

    def record(self, action: str, path, exc: BaseException) -> None:
        where = f" {os.fspath(path)}" if path is not None else ""
        self.messages.append(f"{action}{where}: {describe_failure(exc)}")

    def first(self) -> Optional[str]:
        return self.messages[0] if self.messages else None


class GuardedCheckpointEngine:
    """Stands in for ``engine.checkpoint_engine`` during one save: writes are caught, and after
    the first failure skipped (they could only fail again or waste the time)."""

    def __init__(self, inner, failures: WriteFailures):
        self._inner = inner
        self._failures = failures

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _guard(self, action: str, path, call, *args, **kwargs):
        if self._failures:
            return None
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            self._failures.record(action, path, exc)
            return None

    def makedirs(self, path, exist_ok=False):
        return self._guard("creating", path, self._inner.makedirs, path, exist_ok=exist_ok)

    def create(self, info):
        return self._guard("starting the checkpoint", None, self._inner.create, info)

    def save(self, state_dict, path):
        return self._guard("writing", path, self._inner.save, state_dict, path)

    def commit(self, info):
        return self._guard("committing the checkpoint", None, self._inner.commit, info)


@contextlib.contextmanager
def guarded(engine, failures: WriteFailures):
    """Within the block, ``engine``'s checkpoint writes record failures in ``failures``."""
    inner = engine.checkpoint_engine
    # the bound method (the instance attribute below shadows it); DeepSpeed versions without it copy
    # no recovery scripts this way
    copy_script = getattr(engine, "_copy_recovery_script", None)

    def copy_recovery_script(save_path):
        if failures:
            return
        try:
            copy_script(save_path)
        except Exception as exc:
            failures.record("copying DeepSpeed's recovery scripts into", save_path, exc)

    engine.checkpoint_engine = GuardedCheckpointEngine(inner, failures)
    if copy_script is not None:
        engine._copy_recovery_script = copy_recovery_script
    try:
        yield
    finally:
        engine.checkpoint_engine = inner
        if copy_script is not None:
            del engine._copy_recovery_script
