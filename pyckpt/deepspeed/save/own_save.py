"""DeepSpeed's own ``save_checkpoint``, called from inside a save pyckpt runs.

Under ``enable(save=...)`` the engine's ``save_checkpoint`` routes through pyckpt's collective save
(:mod:`..integrations.deepspeed_engine`). Every save pyckpt runs calls DeepSpeed's own method by that
same name (into its staging folder, or without writing, :mod:`.save_layout`), so the engine is marked
as inside one for the call, and the routing hands it to DeepSpeed's method as it is.
"""

from __future__ import annotations

import contextlib

# the engine's attribute that says a pyckpt save is running through it
INSIDE = "_pyckpt_inside_save"


@contextlib.contextmanager
def deepspeeds_own(engine):
    """Within the block, ``engine.save_checkpoint`` is DeepSpeed's own, whatever ``enable(save=...)`` says."""
    before = getattr(engine, INSIDE, False)
    setattr(engine, INSIDE, True)
    try:
        yield
    finally:
        setattr(engine, INSIDE, before)
