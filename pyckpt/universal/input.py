"""What an export reads: a DeepSpeed ZeRO checkpoint, or a Universal Checkpoint converted from one,
as ``zero_to_fp32``'s state dict and, when asked, every trainable parameter's Adam state.

Both inputs give the same state dict (:mod:`pyckpt.universal.read`), so every export (Hugging Face,
DCP, the lazy state dict) starts here and none knows which it was given. A ZeRO checkpoint's optimizer
shards are read once for the masters and the moments together.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from ..errors import CheckpointFormatError, metadata_errors
from ..planning.state import STEP
from ..zero.consolidated import ConsolidatedState, consolidate
from ..zero.discovery import discover
from ..zero.names import check_tag
from ..zero.optimizer_state import zero3_step
from .read import UniversalCheckpoint, consolidate_universal, discover_universal, find_universal_folder, \
    universal_optimizer_states


def tagged(input, tag: Optional[str]):
    """INPUT/TAG when a tag is named (zero_to_fp32's -t): one folder name inside INPUT."""
    if tag is None:
        return input
    check_tag(tag, os.path.join(os.fspath(input), "(--tag)"))
    return os.path.join(os.fspath(input), tag)


def discover_input(path):
    """The files of the DeepSpeed checkpoint at ``path``, discovered and checked (no tensor read): a
    Universal Checkpoint (its folder, or the folder whose ``latest_universal`` names it), else a ZeRO
    checkpoint (a tag folder, or the folder holding ``latest``), whose discovery refuses what is neither."""
    universal = find_universal_folder(path)
    return discover_universal(universal) if universal else discover(path)


def read_consolidated(input, tag: Optional[str] = None, exclude_frozen: bool = False, dense_only: bool = False,
                      optimizer: bool = False):
    """(checkpoint, zero_to_fp32's state dict as byte pieces) of INPUT: a ZeRO checkpoint (tag folder, or the
    folder holding ``latest``) or a Universal Checkpoint made from one (its folder, or the folder holding
    ``latest_universal``), which gives the same state dict (``deepspeed.universal_read``). ``optimizer``:
    a ZeRO checkpoint's Adam moments and steps are read in the same pass, for :func:`optimizer_states`."""
    path = tagged(input, tag)
    with metadata_errors(input):
        ck = discover_input(path)
    with metadata_errors(ck.folder):
        if isinstance(ck, UniversalCheckpoint):
            return ck, consolidate_universal(ck, exclude_frozen=exclude_frozen, dense_only=dense_only)
        return ck, consolidate(ck, exclude_frozen=exclude_frozen, dense_only=dense_only, optimizer=optimizer)


def optimizer_states(ck, state: ConsolidatedState, trainable) -> Tuple[Dict[str, Dict[str, object]], List[dict]]:
    """(name -> {exp_avg, exp_avg_sq, step}, param groups) of the parameters in ``trainable`` (names to
    shapes): from a Universal Checkpoint's files, or from what :func:`read_consolidated` read of a ZeRO
    checkpoint's shards (``optimizer=True``), ZeRO-3's one step given to every parameter."""
    with metadata_errors(ck.folder):
        if isinstance(ck, UniversalCheckpoint):
            states, groups = universal_optimizer_states(ck, trainable)
        elif state.optimizer_states is None:
            raise ValueError("read_consolidated(optimizer=True) reads a ZeRO checkpoint's optimizer state")
        else:
            states, groups = state.optimizer_states, ck.optim[0].param_groups
            if ck.stage == 3:
                step = zero3_step(ck)
                states = {name: dict(held, **{STEP: step}) for name, held in states.items()}
    if not isinstance(groups, list) or not groups:
        raise CheckpointFormatError(f"{ck.folder}: the optimizer state holds no param groups")
    return states, groups
