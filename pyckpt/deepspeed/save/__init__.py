"""Saving DeepSpeed training checkpoints so that a failure costs nothing already saved.

``pyckpt.deepspeed.save_checkpoint(engine, save_dir, ...)``, called on every rank, runs DeepSpeed's
own ``save_checkpoint`` into a hidden staging folder, agrees on every rank's success, and only then
publishes the checkpoint and ``latest`` (see :mod:`.entry` and :mod:`.collective_save`).

Import rule: the save glue may import the conversions it can run after a save (``huggingface``'s
export, ``universal``'s convert) and everything below them; not the load backend (:mod:`..load`).
"""

from __future__ import annotations

from ...errors import CollectiveCallError, SaveError
from .background import AsyncSave, wait_for_saves
from .entry import save_checkpoint
from .tier_preparation import prepare_memory_tier

__all__ = ["save_checkpoint", "prepare_memory_tier", "wait_for_saves", "AsyncSave", "SaveError", "CollectiveCallError"]
