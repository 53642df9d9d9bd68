"""``engine.destroy()`` as a join point: the save in flight is joined and the snapshot let go first.

The end of the engine's life is a join point like the next save: its failure is reported there, and
the host buffers an asynchronous save keeps between saves (:mod:`.snapshot`) are freed with it. The
hook is an instance attribute over the class's ``destroy``, removed again when it runs.
"""

from __future__ import annotations

from .in_flight import join_save


def join_at_destroy(engine) -> None:
    """``engine.destroy()`` joins the save in flight first (its failure reported there) and lets go of
    the snapshot buffers: the end of the engine's life is a join point like the next save."""
    if getattr(engine, "_pyckpt_joins_at_destroy", False):
        return
    original = engine.destroy

    def destroy(*args, **kwargs):
        try:
            join_save(engine)
        finally:
            engine._pyckpt_arena = None
            engine._pyckpt_slot_host = None  # a memory save's pinned copies of device storages
            del engine.destroy  # the class's own again
            engine._pyckpt_joins_at_destroy = False
            original(*args, **kwargs)

    engine.destroy = destroy
    engine._pyckpt_joins_at_destroy = True
