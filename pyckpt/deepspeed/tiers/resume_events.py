"""Who hears that a job resumed from its memory tier.

A job that saved to the tier persists its newest memory checkpoint at a normal end and removes its
folder (:mod:`..save.memory_save`); a job that resumed from memory and ends without saving must do the
same, or the step it resumed stays in tmpfs alone and is gone with the node. Recovery (the load side)
cannot call the save side (neither imports the other), so it says so here, and the save side, which
owns the end of a job, listens (:func:`pyckpt.deepspeed.enable` with ``memory=`` subscribes it).
"""

from __future__ import annotations

from typing import Callable, List

_LISTENERS: List[Callable] = []


def listen(listener: Callable) -> None:
    """``listener(tier, links, folder, identity, run)`` is called on each node's leader after every
    resume from memory (``folder``: the node's memory folder)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def resumed(tier, links, folder: str, identity, run: str) -> None:
    for listener in list(_LISTENERS):
        listener(tier, links, folder, identity, run)
