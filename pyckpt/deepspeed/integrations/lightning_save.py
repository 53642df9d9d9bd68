"""Lightning's checkpoint removal waits for the newer checkpoint under ``enable(save="async")``.

Lightning's ``ModelCheckpoint`` (lightning 2.6) saves the new checkpoint through the strategy, then removes
the one it no longer keeps (``save_top_k``, ``save_last``) through ``strategy.remove_checkpoint``. With
``DeepSpeedStrategy`` the save is ``engine.save_checkpoint(filepath, tag="checkpoint")``; under
``save="async"`` that call returns once the state is snapshotted, so the removal would run while the new
checkpoint is still being written, and a crash then would leave neither. Here a removal asked for while
the engine's asynchronous save is in flight runs only once that save is published, at its join (the next
save, ``wait_for_saves()``, ``engine.destroy()``, exit); if the save fails, the older checkpoint stays.
Lightning's strategy refuses to run without CUDA; tests/workers/lightning_save_worker.py runs its
``save_checkpoint`` and ``remove_checkpoint`` on a real engine.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..save.in_flight import save_in_flight
from ..settings import save_mode
from .patching import Row, install_save_patch, save_patch

log = logging.getLogger("pyckpt")

MODULE = "lightning.pytorch.strategies.deepspeed"


def _wrap(original: Callable, module=None) -> Callable:
    def remove_checkpoint(self, filepath) -> None:
        engine = getattr(self, "deepspeed_engine", None) if save_mode() == "async" else None
        handle = save_in_flight(engine)
        if handle is None or (handle.done() and handle.ok):
            return original(self, filepath)
        if handle.done():
            log.warning("pyckpt: kept %s: the newer checkpoint was not published (%s)", filepath, handle.message)
            return None

        def remove_after_publication() -> bool:
            try:
                original(self, filepath)
            except Exception as exc:  # the newer checkpoint is published all the same
                log.warning("pyckpt: could not remove %s after the newer checkpoint was published: %s",
                            filepath, exc)
            return True
        handle.then(remove_after_publication)
    remove_checkpoint.__wrapped__ = original
    return remove_checkpoint


PROVEN = ("2.6.6", )
ROW = Row("lightning", MODULE, "DeepSpeedStrategy", {"remove_checkpoint": _wrap}, PROVEN)
PATCH = save_patch("Lightning's removal after the newer checkpoint", ROW)


def install() -> None:
    install_save_patch(PATCH)


def uninstall() -> None:
    PATCH.uninstall()
