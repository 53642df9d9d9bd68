"""``DeepSpeedEngine.save_checkpoint`` through pyckpt's collective save, for callers that call DeepSpeed's
(the Hugging Face Trainer, accelerate's ``save_state``, Lightning's ``DeepSpeedStrategy``, a user's loop).

Under ``pyckpt.deepspeed.enable(save="atomic")`` the engine's own method writes the same files as
DeepSpeed's, byte for byte, and nothing else (no ``training_state.json``), but complete or invisible:
staged under a hidden name, every rank's success agreed, then renamed into place and ``latest``
replaced (left alone where the caller passes ``save_latest=False``, as DeepSpeed leaves it).
``save="async"`` returns once every rank holds a snapshot of the state, writes in the background and
publishes when every rank's files are complete; the next save, ``engine.destroy()`` and the
interpreter's exit join it (:mod:`.background`). A failure raises :class:`~pyckpt.errors.SaveError` on
every rank, where DeepSpeed's own save would have raised on one and hung the others.

pyckpt's save itself calls the engine's original method into its staging folder; the engine is marked
while it does, so that inner call is DeepSpeed's own.

Where a framework above DeepSpeed could not be patched (a release that renamed what pyckpt replaces), it
runs stock, and a stock framework does not wait for a background write: it would rotate away, or remove,
its older checkpoint while the newer one is still being written. :func:`hold_async` then makes the saves
atomic, not asynchronous, until the save hooks are uninstalled.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Dict, Optional

log = logging.getLogger("pyckpt")

MODES = ("atomic", "async")
_ORIGINAL: Dict[type, Callable] = {}
_MODE: Dict[str, Optional[str]] = {"save": None, "held": None}
_INSIDE = "_pyckpt_inside_save"
_ANNOUNCED: list = []  # the one line a job prints, on its first save


def check_mode(save) -> Optional[str]:
    """``save`` as enable() takes it: None/False (DeepSpeed's own save), "atomic", "async" or True ("atomic")."""
    if save is None or save is False:
        return None
    if save is True:
        return "atomic"
    if save not in MODES:
        raise ValueError(f"enable(save=...) takes None, 'atomic' or 'async', not {save!r}")
    return save


def mode() -> Optional[str]:
    """The save mode in effect: "atomic" for "async" while :func:`hold_async` holds it."""
    if _MODE["save"] == "async" and _MODE["held"]:
        return "atomic"
    return _MODE["save"]


def hold_async() -> None:
    """Asynchronous saves made atomic from now on (a framework runs stock: see the module doc)."""
    _MODE["held"] = "held"


def set_mode(value: Optional[str]) -> Optional[str]:
    before, _MODE["save"] = _MODE["save"], value
    return before


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False):
        if mode() is None or getattr(self, _INSIDE, False):
            return original(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                            exclude_frozen_parameters=exclude_frozen_parameters)
        from .collective_save import save_checkpoint as collective

        if not _ANNOUNCED and getattr(self, "global_rank", 0) == 0:
            _ANNOUNCED.append(True)
            log.warning("pyckpt: DeepSpeed's save_checkpoint is %s (pyckpt.deepspeed.enable(save=%r)): %s",
                        "atomic and asynchronous" if mode() == "async" else "atomic", _MODE["save"],
                        "published whole when every rank's files are complete")
        setattr(self, _INSIDE, True)
        try:
            result = collective(self, save_dir, tag, client_state=dict(client_state or {}),
                                exclude_frozen_parameters=exclude_frozen_parameters,
                                async_save=mode() == "async", save_latest=bool(save_latest),
                                training_state=False)
        finally:
            setattr(self, _INSIDE, False)
        # DeepSpeed's save returns True; an asynchronous one returns once the snapshot is taken
        return True if result is not False else result

    save_checkpoint.__pyckpt_hooked__ = True
    return save_checkpoint


def install() -> bool:
    """DeepSpeedEngine.save_checkpoint replaced; False, with one warning and DeepSpeed left stock, where this
    DeepSpeed has no such method."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ..framework_patch import apply, need

    if DeepSpeedEngine in _ORIGINAL:
        return True

    def patch() -> None:
        original = need(DeepSpeedEngine, "save_checkpoint")
        _ORIGINAL[DeepSpeedEngine] = original
        DeepSpeedEngine.save_checkpoint = _wrap(original)
    return apply("deepspeed", patch, "DeepSpeed's own save_checkpoint stays in place: enable(save=...) saves nothing "
                 "through pyckpt")


def uninstall() -> None:
    for cls, original in list(_ORIGINAL.items()):
        cls.save_checkpoint = original
        del _ORIGINAL[cls]
    set_mode(None)
    _MODE["held"] = None


def installed() -> bool:
    return bool(_ORIGINAL)
