"""What a checkpoint folder says of itself: the step it records and the model it holds.

Every tier (node-local memory, a peer's replica, durable storage) holds the same files, DeepSpeed's
own; what decides which of them to keep, remove, replace or recover from is read from the model-state
file of model-parallel rank 0 that every DeepSpeed checkpoint holds, by pyckpt's allowlist reader
(nothing in it runs), never from names or folder times.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Optional, Tuple

from ...formats.torch_zip import SourceFile
from ...zero.model_states import read_model_states

# The model-state file of model-parallel rank 0 that every DeepSpeed checkpoint holds: ZeRO-1/2, ZeRO-3.
FIRST_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


@dataclass(frozen=True)
class JobCheckpoint:
    """What the model-state file of mp rank 0 says of a checkpoint folder: the step it records and
    the parameters (names and shapes, trainable and frozen) it was saved with."""

    name: str  # the model-state file's name: tells a ZeRO-3 checkpoint from a ZeRO-1/2 one
    step: int
    params: Tuple

    def same_job(self, other: "JobCheckpoint") -> bool:
        return (self.name, self.params) == (other.name, other.params)


def read_checkpoint(folder: str) -> Optional[JobCheckpoint]:
    """The record of the DeepSpeed checkpoint in ``folder``, or None when it is none: its model-state
    file of mp rank 0 is missing, no regular file (a link, a FIFO), or not DeepSpeed's model-state
    dict. Only the file's pickle is read, by pyckpt's allowlist reader; nothing in it runs."""
    for name in FIRST_MODEL_STATES:
        path = os.path.join(folder, name)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return None
        except OSError:
            continue
        try:
            ms = read_model_states(SourceFile(path))
        except Exception:  # unreadable, refused or not a torch file: not a checkpoint to judge
            return None
        fields = (ms.global_steps, ms.dp_world_size, ms.mp_world_size)
        if not isinstance(ms.ds_version, str) or any(isinstance(v, bool) or not isinstance(v, int) for v in fields):
            return None
        if ms.global_steps < 0 or ms.dp_world_size < 1 or ms.mp_world_size < 1:
            return None
        params = (tuple(ms.shapes.items()), tuple(ms.frozen.items()))
        return JobCheckpoint(name, ms.global_steps, params)
    return None
