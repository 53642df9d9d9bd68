"""Saving DeepSpeed training checkpoints so that a failure costs nothing already saved.

``pyckpt.deepspeed.save_checkpoint(engine, save_dir, ...)``, called on every rank, runs DeepSpeed's
own ``save_checkpoint`` into a hidden staging folder, agrees on every rank's success, and only then
publishes the checkpoint and ``latest`` (see :mod:`.collective_save`). Public as
``pyckpt.deepspeed.save_checkpoint``.
"""

from __future__ import annotations

from .arrival import CollectiveCallError
from .collective_save import SaveError, save_checkpoint

__all__ = ["save_checkpoint", "SaveError", "CollectiveCallError"]
