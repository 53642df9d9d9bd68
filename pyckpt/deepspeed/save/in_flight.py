"""What an engine has in flight: its asynchronous save and its memory checkpoint's persistence.

An engine has at most one of each. Every save joins both before it starts (a background write waits on
the same store client as the new save's agreement would, and a persistence must never copy a checkpoint
the new save's pruning could remove); ``engine.destroy()`` and the frameworks' own steps after a save
(a Trainer folder renamed into place once the checkpoint under it is published, Lightning's removal of
an older checkpoint) ask here too. The handles live on the engine, so that they end with it; no other
module reads them.
"""

from __future__ import annotations

from typing import Optional

from .background import AsyncSave

_SAVE = "_pyckpt_async_save"
_PERSIST = "_pyckpt_persist"


def begin_save(engine, handle: AsyncSave) -> None:
    """``handle`` is now ``engine``'s save in flight (the caller joined the previous one)."""
    setattr(engine, _SAVE, handle)


def save_in_flight(engine) -> Optional[AsyncSave]:
    """The engine's asynchronous save last started, finished or not, until a join takes it; None for an
    object that is not an engine pyckpt saved."""
    return getattr(engine, _SAVE, None)


def join_save(engine) -> bool:
    """Joins the save in flight (its failure reported here, once); True when there was none or it was
    published."""
    pending = getattr(engine, _SAVE, None)
    if pending is None:
        return True
    setattr(engine, _SAVE, None)
    return bool(pending.wait())


def begin_persistence(engine, handle: AsyncSave) -> None:
    """``handle`` is now ``engine``'s persistence in flight (the caller joined the previous one)."""
    setattr(engine, _PERSIST, handle)


def join_persistence(engine) -> bool:
    """Joins ``engine``'s persistence in flight (node leaders); True when none failed."""
    pending = getattr(engine, _PERSIST, None)
    setattr(engine, _PERSIST, None)
    return True if pending is None else bool(pending.wait())


def join_all(engine) -> None:
    """Joins the save, then the persistence: what every new save waits for."""
    join_save(engine)
    join_persistence(engine)
