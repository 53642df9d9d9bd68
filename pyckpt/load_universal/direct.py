"""Resume straight from a ZeRO checkpoint at another world size: DeepSpeed's universal load, fed by
the checkpoint's universal view (:mod:`.zero_view`) instead of a converted folder.

DeepSpeed's ``load_checkpoint`` runs as under ``"checkpoint": {"load_universal": true}`` (the engine
flag is raised for the call only): it reads the tag's model-state file for the scheduler, counters and
``client_state``, skips the module weights, and hands the optimizer state to the hooked
``_load_universal_checkpoint``, which finds the view registered for the tag folder and gathers each
rank's runs from the ZeRO shards. Each rank builds the view itself (the shards' pickles are read,
not their tensors) inside the planning step, so a broken checkpoint fails every rank together.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from ..deepspeed.discovery import follow_pointer
from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from . import zero_view
from .model_state_file import MODEL_STATES_SUFFIX


def _is_zero_tag_folder(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith("_optim_states.pt") for n in names) and "zero" not in names


def zero_target(load_dir: str, tag: Optional[str]) -> Optional[Tuple[str, str]]:
    """(load_dir, tag) when this load names a plain ZeRO checkpoint rather than a universal one:
    ``tag`` given and its folder holds ZeRO shards and no ``zero/``; or no tag, no
    ``latest_universal`` and a ``latest`` naming such a folder. None otherwise."""
    load_dir = os.fspath(load_dir)
    if tag is not None:
        return (load_dir, str(tag)) if _is_zero_tag_folder(os.path.join(load_dir, str(tag))) else None
    if os.path.lexists(os.path.join(load_dir, "latest_universal")) or \
            not os.path.lexists(os.path.join(load_dir, "latest")):
        return None
    folder = follow_pointer(load_dir, "latest")
    return (load_dir, os.path.basename(folder)) if _is_zero_tag_folder(folder) else None


def load_zero(engine, load_dir: str, tag: str, original, *args, **kwargs):
    """``original`` (DeepSpeed's ``load_checkpoint``) over the view of ``<load_dir>/<tag>``."""
    folder = os.path.join(load_dir, tag)
    if not any(n.endswith(MODEL_STATES_SUFFIX) for n in os.listdir(folder)):
        raise CheckpointFormatError(f"{folder}: no *_model_states.pt file")
    zero_view.register(folder, lambda: zero_view.ZeroView(folder))
    config = engine._config
    saved = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        return original(engine, load_dir, tag, *args, **kwargs)
    finally:
        config.load_universal_checkpoint = saved
        zero_view.unregister(folder)


def load_checkpoint(engine, load_dir, tag: Optional[str] = None, **kwargs):
    """Restore ``engine`` from a DeepSpeed ZeRO checkpoint saved at any data-parallel world size,
    without converting it: ``load_dir`` is the folder holding ``latest`` (the Hugging Face Trainer's
    ``checkpoint-N/``), or the tag folder itself; ``tag`` overrides ``latest``. Returns what
    DeepSpeed's ``engine.load_checkpoint`` returns: ``(load_path, client_state)``. Called on every
    rank, like ``engine.load_checkpoint``; the other keyword arguments are its own."""
    load_dir = os.fspath(load_dir)
    if tag is None and _is_zero_tag_folder(load_dir):
        load_dir, tag = os.path.split(os.path.abspath(load_dir))
    elif tag is None and os.path.lexists(os.path.join(load_dir, "latest")):
        # `latest`, as DeepSpeed's own load reads it, even where a `latest_universal` lies beside it
        tag = os.path.basename(follow_pointer(load_dir, "latest"))
    target = zero_target(load_dir, tag)
    if target is None:
        where = os.path.join(load_dir, tag) if tag is not None else os.path.join(load_dir, "latest")
        raise CheckpointFormatError(f"{where}: not a ZeRO checkpoint tag folder (no *_optim_states.pt, or it "
                                    "already has a universal zero/ folder: load that with load_universal)")
    from deepspeed.runtime.engine import DeepSpeedEngine

    from . import hooks

    already = hooks.installed()
    if not hooks.install():
        raise UnsupportedCheckpointError("pyckpt resumes from ZeRO checkpoints with DeepSpeed "
                                         f"{', '.join(hooks.PROVEN_VERSIONS)} only")
    try:
        return load_zero(engine, *target, hooks.universal_load(DeepSpeedEngine), **kwargs)
    finally:
        if not already:
            hooks.uninstall()
