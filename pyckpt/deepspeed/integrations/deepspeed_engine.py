"""DeepSpeed's engine and optimizers under ``enable()``: the rows pyckpt replaces and their installation.

The load (:mod:`..load.hooks` runs it): the universal load of the three optimizer classes
(``_load_universal_checkpoint``) and the engine's ``load_checkpoint``, applied together or not at all.
The save: ``DeepSpeedEngine.save_checkpoint`` through pyckpt's collective save, for callers that call
DeepSpeed's (the Hugging Face Trainer, accelerate's ``save_state``, Lightning's ``DeepSpeedStrategy``, a
user's loop). Under ``enable(save="atomic")`` the engine's own method writes the same files as
DeepSpeed's, byte for byte, and nothing else (no ``training_state.json``), but complete or invisible:
staged under a hidden name, every rank's success agreed, then renamed into place and ``latest``
replaced (left alone where the caller passes ``save_latest=False``, as DeepSpeed leaves it).
``save="async"`` returns once every rank holds a snapshot of the state, writes in the background and
publishes when every rank's files are complete; the next save, ``engine.destroy()`` and the
interpreter's exit join it. A failure raises :class:`~pyckpt.errors.SaveError` on every rank, where
DeepSpeed's own save would have raised on one and hung the others. pyckpt's save itself calls the
engine's original method into its staging folder; the engine is marked while it does, so that inner
call is DeepSpeed's own.

Both are proven on the DeepSpeed versions of :data:`PROVEN` (tests/deepspeed/load/test_load_backend.py,
tests/deepspeed/save/test_enable_save.py); on another, DeepSpeed stays stock with one warning, unless
``PYCKPT_UNPROVEN_OK=deepspeed`` (:mod:`.patching`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

from ...errors import UnsupportedCheckpointError
from ..load import direct
from ..load import hooks
from ..save.own_save import INSIDE as _INSIDE
from ..settings import SETTINGS, save_mode
from .patching import Patch, Row

log = logging.getLogger("pyckpt")

PROVEN = ("0.19.8", )
ENGINE_MODULE = "deepspeed.runtime.engine"


def _optimizer_row(module: str, cls: str, planner: Callable) -> Row:
    return Row("deepspeed", module, cls,
               {"_load_universal_checkpoint": lambda original, _module: hooks.universal_load_of(planner, original)},
               PROVEN)


LOAD_ROWS = tuple(_optimizer_row(module, cls, planner) for (module, cls), planner in hooks.PLANNERS.items()) + (
    Row("deepspeed", ENGINE_MODULE, "DeepSpeedEngine",
        {"load_checkpoint": lambda original, _module: hooks.engine_load(original)}, PROVEN),)
LOAD = Patch("the accelerated universal load", LOAD_ROWS, "DeepSpeed's own loader stays in place")

_ANNOUNCED: list = []  # the one line a job prints, on its first save


def _save_checkpoint(original: Callable, _module=None) -> Callable:
    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False):
        if save_mode() is None or getattr(self, _INSIDE, False):
            return original(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                            exclude_frozen_parameters=exclude_frozen_parameters)
        from ..save import save_checkpoint as collective

        if not _ANNOUNCED and getattr(self, "global_rank", 0) == 0:
            _ANNOUNCED.append(True)
            log.warning("pyckpt: DeepSpeed's save_checkpoint is %s (pyckpt.deepspeed.enable(save=%r)): %s",
                        "atomic and asynchronous" if save_mode() == "async" else "atomic", SETTINGS.save,
                        "published whole when every rank's files are complete")
        result = collective(self, save_dir, tag, client_state=dict(client_state or {}),
                            exclude_frozen_parameters=exclude_frozen_parameters,
                            async_save=save_mode() == "async", save_latest=bool(save_latest),
                            training_state=False)
        # DeepSpeed's save returns True; an asynchronous one returns once the snapshot is taken
        return True if result is not False else result

    save_checkpoint.__pyckpt_hooked__ = True
    return save_checkpoint


SAVE_ROWS = (Row("deepspeed", ENGINE_MODULE, "DeepSpeedEngine", {"save_checkpoint": _save_checkpoint}, PROVEN),)
SAVE = Patch("pyckpt's save_checkpoint", SAVE_ROWS,
             "DeepSpeed's own save_checkpoint stays in place: enable(save=...) saves nothing through pyckpt")


class LoadEnabled:
    """What the load side of ``enable()`` returns: truthy when the load rows are in place; as a context
    manager, it removes them again on exit if this call installed them, and restores the settings it
    changed."""

    def __init__(self, active: bool, installed_here: bool, trust_before: bool, reshard_before: bool,
                 memory_before=None):
        self.active = active
        self._installed_here = installed_here
        self._trust_before = trust_before
        self._reshard_before = reshard_before
        self._memory_before = memory_before

    def __bool__(self) -> bool:
        return self.active

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        hooks.trust_pickles(self._trust_before)
        hooks.reshard(self._reshard_before)
        hooks.memory_tier(self._memory_before)
        if self._installed_here:
            LOAD.uninstall()

    def __repr__(self) -> str:
        return f"<pyckpt accelerated universal load: {'enabled' if self.active else 'not enabled'}>"


def enable_load(trust_pickles: bool = False, *, reshard: bool = True, memory=None) -> LoadEnabled:
    """The load side of :func:`pyckpt.deepspeed.enable` (its arguments as documented there): the load rows
    installed and the settings set; a falsy handle, DeepSpeed left alone with one warning, where they cannot
    apply."""
    already = LOAD.installed()
    active = LOAD.install()
    before = hooks.trust_pickles(trust_pickles if active else None)
    reshard_before = hooks.reshard(reshard if active else None)
    memory_before = hooks.memory_tier(memory if active else False)
    return LoadEnabled(active, installed_here=active and not already, trust_before=before,
                       reshard_before=reshard_before, memory_before=memory_before)


def load_checkpoint(engine, load_dir, tag: Optional[str] = None, *, trust_pickles: bool = False, **kwargs):
    """Restore ``engine`` from a DeepSpeed ZeRO checkpoint saved at any data-parallel world size,
    without converting it (:func:`..load.direct.resume`): ``load_dir`` is the folder holding ``latest``
    (the Hugging Face Trainer's ``checkpoint-N/``), or the tag folder itself; ``tag`` overrides
    ``latest``. Returns what DeepSpeed's ``engine.load_checkpoint`` returns: ``(load_path,
    client_state)``. Called on every rank, like ``engine.load_checkpoint``; the other keyword arguments
    are its own. ``trust_pickles``: as for ``pyckpt.deepspeed.enable``, for this call. There is no
    DeepSpeed loader to leave this load to: where the load rows cannot apply, it raises."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    already = LOAD.installed()
    if not LOAD.install():
        raise UnsupportedCheckpointError("pyckpt resumes from ZeRO checkpoints with DeepSpeed "
                                         f"{', '.join(PROVEN)} only (PYCKPT_UNPROVEN_OK=deepspeed accepts another)")
    trust_before = hooks.trust_pickles(trust_pickles)
    try:
        return direct.resume(engine, os.fspath(load_dir), tag,
                             hooks.mapped_load(LOAD.original(DeepSpeedEngine, "load_checkpoint")), **kwargs)
    finally:
        hooks.trust_pickles(trust_before)
        if not already:
            LOAD.uninstall()

