"""Resuming from a plain ZeRO checkpoint through DeepSpeed's universal load: telling such a load
apart, and running DeepSpeed's ``load_checkpoint`` over the checkpoint's universal view.

DeepSpeed's ``load_checkpoint`` runs as under ``"checkpoint": {"load_universal": true}`` (the engine
flag is raised for the call only): it reads the tag's model-state file for the scheduler, counters and
``client_state``, skips the module weights, and hands the optimizer state to the hooked
``_load_universal_checkpoint``, which finds the view registered for the tag folder (:mod:`.zero_view`)
and gathers each rank's runs from the ZeRO shards. Each rank builds the view itself (the shards'
pickles are read, not their tensors) inside the planning step, so a broken checkpoint fails every
rank together.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from ...errors import CheckpointFormatError, UnsafePickleError, UnsupportedCheckpointError
from ...universal.layout import STATES_FOLDER
from ...zero.discovery import follow_pointer
from . import topology, zero_view
from .pickle_policy import TRUST_HINT
from .model_state_file import MODEL_STATES_SUFFIX


def is_zero_tag_folder(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith("_optim_states.pt") for n in names) and STATES_FOLDER not in names


def zero_target(load_dir: str, tag: Optional[str]) -> Optional[Tuple[str, str]]:
    """(load_dir, tag) when this load names a plain ZeRO checkpoint rather than a universal one:
    ``tag`` given and its folder holds ZeRO shards and no ``zero/``; or no tag, no
    ``latest_universal`` and a ``latest`` naming such a folder. None otherwise."""
    if tag is None and os.path.lexists(os.path.join(os.fspath(load_dir), "latest_universal")):
        return None
    return plain_target(load_dir, tag)


def resumable_target(engine, load_dir: str, tag: Optional[str]) -> Optional[Tuple[str, str]]:
    """:func:`zero_target`, checked to be a checkpoint ``engine`` can resume from directly (what
    :func:`load_zero` needs, read before anything changes; the callers agree on it across ranks)."""
    target = zero_target(load_dir, tag)
    if target is not None:
        check_resumable(engine, os.path.join(*target))
    return target


def plain_target(load_dir: str, tag: Optional[str]) -> Optional[Tuple[str, str]]:
    """(load_dir, tag) of the ZeRO checkpoint a load without the universal flag reads (``latest``'s
    tag when None, as DeepSpeed reads it), or None where that is not a plain ZeRO tag folder (DeepSpeed's
    own load then says what is wrong)."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        if not os.path.lexists(os.path.join(load_dir, "latest")):
            return None
        tag = os.path.basename(follow_pointer(load_dir, "latest"))
    return (load_dir, str(tag)) if is_zero_tag_folder(os.path.join(load_dir, str(tag))) else None


def reshard_target(engine, load_dir: str, tag: Optional[str], trust_pickles: bool = False):
    """For a load without the universal flag: ``(load_dir, tag, saved, current)`` when it names a plain
    ZeRO checkpoint saved at another topology than ``engine`` runs at, checked to be one the direct
    resume serves; None where DeepSpeed's own load applies (the same topology, or no ZeRO checkpoint).
    A topology change it cannot serve raises, naming both topologies and what would serve it. A
    model-state file pyckpt's reader refuses to unpickle is refused (UnsafePickleError) unless the
    user trusts the checkpoint: then the load is DeepSpeed's own, as without pyckpt."""
    target = plain_target(load_dir, tag)
    if target is None:
        return None
    folder = os.path.join(*target)
    try:
        was = topology.saved(folder)
    except UnsafePickleError as exc:
        if trust_pickles:
            return None
        raise UnsafePickleError(f"{exc}; {TRUST_HINT}") from None
    now = topology.current(engine)
    if was.partitioned_like(now):
        return None
    change = f"{folder} was saved at {was}; this engine runs {now}"
    if (was.stage == 3) != (now.stage == 3) and was.stage is not None:
        raise UnsupportedCheckpointError(f"{change}: resharding between ZeRO-3 and ZeRO-1/2 is not served; run "
                                         f"with ZeRO-{was.stage} (any data-parallel size), or convert the checkpoint "
                                         "with `pyckpt convert` and load the universal folder")
    try:
        check_resumable(engine, folder)
    except UnsupportedCheckpointError as exc:
        raise UnsupportedCheckpointError(f"{change}: {str(exc).split(': ', 1)[-1]}") from None
    return target + (was, now)


def check_resumable(engine, folder: str) -> None:
    if not any(n.endswith(MODEL_STATES_SUFFIX) for n in os.listdir(folder)):
        raise CheckpointFormatError(f"{folder}: no *_model_states.pt file")
    # Under the universal flag DeepSpeed takes the weights from the optimizer's load only: an engine
    # that would not reach it would come back with its module weights untouched.
    if not engine.zero_optimization() or engine.zero_nvme_offload_optimizer():
        raise UnsupportedCheckpointError(f"{folder}: resuming straight from a ZeRO checkpoint needs an engine with "
                                         "ZeRO stage 1-3 and no NVMe optimizer offload; load it with "
                                         "engine.load_checkpoint as saved")


def load_zero(engine, load_dir: str, tag: str, original, *args, **kwargs):
    """``original`` (DeepSpeed's ``load_checkpoint``) over the view of ``<load_dir>/<tag>``, which
    :func:`resumable_target` found and checked."""
    folder = os.path.join(load_dir, tag)
    zero_view.register(folder, lambda: zero_view.ZeroView(folder))
    config = engine._config
    saved = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        out = original(engine, load_dir, tag, *args, **kwargs)
        if not zero_view.used(folder):
            raise UnsupportedCheckpointError(f"{folder}: DeepSpeed's load did not reach pyckpt's optimizer-state load "
                                             f"(optimizer {type(engine.optimizer).__name__}); nothing but the "
                                             "model-state metadata was restored")
        return out
    finally:
        config.load_universal_checkpoint = saved
        zero_view.unregister(folder)
