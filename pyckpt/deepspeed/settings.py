"""What ``pyckpt.deepspeed.enable()`` set, in one object: the load's settings (read by :mod:`.load.hooks`)
and the save mode (read by the framework integrations, :mod:`.integrations`).

Nothing here imports the rest of the package: the load backend reads it, so it sits below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SAVE_MODES = ("atomic", "async")


@dataclass
class Settings:
    """``trust_pickles``: files pyckpt's allowlist refuses may go to DeepSpeed's own readers;
    ``reshard``: a plain load of a ZeRO checkpoint saved at another topology reshards;
    ``resume_tier``: the memory tier a resume looks in (``enable(resume_tier=)``), or None;
    ``save``: None (DeepSpeed's own save), "atomic" or "async"; ``save_held``: an asynchronous save mode
    made atomic because a framework above DeepSpeed runs stock (:func:`hold_async`)."""

    trust_pickles: bool = False
    reshard: bool = True
    resume_tier: Any = None
    save: Optional[str] = None
    save_held: bool = False


SETTINGS = Settings()


def check_save_mode(save) -> Optional[str]:
    """``save`` as enable() takes it: None/False (DeepSpeed's own save), "atomic", "async" or True ("atomic")."""
    if save is None or save is False:
        return None
    if save is True:
        return "atomic"
    if save not in SAVE_MODES:
        raise ValueError(f"enable(save=...) takes None, 'atomic' or 'async', not {save!r}")
    return save


def save_mode() -> Optional[str]:
    """The save mode in effect: "atomic" for "async" while :func:`hold_async` holds it."""
    if SETTINGS.save == "async" and SETTINGS.save_held:
        return "atomic"
    return SETTINGS.save


def set_save_mode(value: Optional[str]) -> Optional[str]:
    """Sets the save mode; returns the one before."""
    before, SETTINGS.save = SETTINGS.save, value
    return before


def hold_async() -> None:
    """Asynchronous saves made atomic from now on: a framework above DeepSpeed could not be patched and runs
    stock, and a stock framework does not wait for a background write (it would rotate away, or remove, its
    older checkpoint while the newer one is still being written)."""
    SETTINGS.save_held = True


def release_async() -> None:
    SETTINGS.save_held = False
