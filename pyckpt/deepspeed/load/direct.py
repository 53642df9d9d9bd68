"""The body of ``pyckpt.deepspeed.load_checkpoint``: resume from a ZeRO checkpoint at another world size
without converting it (the mechanics: :mod:`.resume`)."""

from __future__ import annotations

import os
from typing import Callable, Optional

from ...zero.discovery import follow_pointer
from ...errors import CheckpointFormatError
from . import hooks
from .resume import is_zero_tag_folder, load_zero, resumable_target


def resume(engine, load_dir: str, tag: Optional[str], universal_load: Callable, **kwargs):
    """Restore ``engine`` from a DeepSpeed ZeRO checkpoint saved at any data-parallel world size,
    without converting it: ``load_dir`` is the folder holding ``latest`` (the Hugging Face Trainer's
    ``checkpoint-N/``), or the tag folder itself; ``tag`` overrides ``latest``. Returns what
    DeepSpeed's ``engine.load_checkpoint`` returns: ``(load_path, client_state)``. Called on every
    rank, like ``engine.load_checkpoint``; the other keyword arguments are its own.
    ``universal_load`` is DeepSpeed's own ``load_checkpoint`` with the model-state file mapped
    (:func:`.hooks.mapped_load`), called with the optimizers' universal load in place
    (``pyckpt.deepspeed.load_checkpoint`` puts it there)."""
    hooks.agree_arguments(tag, (), kwargs)
    # read on every rank, so all agree before any goes on
    target = hooks.agreed_step("finding the checkpoint", lambda: _target(engine, load_dir, tag))
    return load_zero(engine, *target, universal_load, **kwargs)


def _target(engine, load_dir: str, tag: Optional[str]):
    if tag is None and is_zero_tag_folder(load_dir):
        load_dir, tag = os.path.split(os.path.abspath(load_dir))
    elif tag is None and os.path.lexists(os.path.join(load_dir, "latest")):
        # `latest`, as DeepSpeed's own load reads it, even where a `latest_universal` lies beside it
        tag = os.path.basename(follow_pointer(load_dir, "latest"))
    target = resumable_target(engine, load_dir, tag)
    if target is None:
        where = os.path.join(load_dir, tag) if tag is not None else os.path.join(load_dir, "latest")
        raise CheckpointFormatError(f"{where}: not a ZeRO checkpoint tag folder (no *_optim_states.pt, or it "
                                    "already has a universal zero/ folder: load that with load_universal)")
    return target
