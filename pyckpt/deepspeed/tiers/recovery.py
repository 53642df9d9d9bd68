"""Which checkpoint a resume reads: the newest complete one across the memory tier and ``save_dir``.

A checkpoint counts where its tier's pointer (``latest``) names a folder whose model-state file is
DeepSpeed's (:mod:`.checkpoint_record`); its step is the one that file records. The newest step wins;
at equal steps memory wins (it is the faster read, and the files are the same). Every rank computes
the choice from what it sees and the ranks agree on it before any state changes (the caller's
agreement), so a rank that saw another step stops the load everywhere instead of mixing steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from .checkpoint_record import read_checkpoint


@dataclass(frozen=True)
class Choice:
    tier: str  # "memory" or "durable"
    load_dir: str  # the folder holding `latest` and the tag folder
    tag: str
    step: int

    def agreed_key(self) -> tuple:
        """What every rank must agree on (paths may differ between nodes: not compared)."""
        return (self.tier, self.tag, self.step)


def _pointed(load_dir: str, tier: str) -> Optional[Choice]:
    from ...zero.discovery import follow_pointer

    if not os.path.isfile(os.path.join(load_dir, "latest")) or os.path.islink(os.path.join(load_dir, "latest")):
        return None
    try:
        folder = follow_pointer(load_dir, "latest")
    except Exception:  # a pointer that names nothing readable: not a checkpoint of this tier
        return None
    record = read_checkpoint(folder)
    if record is None:
        return None
    return Choice(tier, load_dir, os.path.basename(folder), record.step)


def candidates(save_dir: str, memory_folder: Optional[str]) -> List[Choice]:
    """The checkpoint each tier's ``latest`` names, where it is a readable DeepSpeed checkpoint."""
    found = []
    if memory_folder is not None:
        found.append(_pointed(memory_folder, "memory"))
    found.append(_pointed(os.fspath(save_dir), "durable"))
    return [c for c in found if c is not None]


def newest(save_dir: str, memory_folder: Optional[str]) -> Optional[Choice]:
    """The newest checkpoint by recorded step; memory first among equals. None where neither tier has one."""
    found = candidates(save_dir, memory_folder)
    if not found:
        return None
    return max(found, key=lambda c: (c.step, c.tier == "memory"))
