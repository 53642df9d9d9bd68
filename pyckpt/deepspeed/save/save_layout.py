"""The files a save of an engine writes, learned by running DeepSpeed's save without writing anything.

A memory save writes DeepSpeed's own files, whose names follow DeepSpeed's rules for the engine's
layout and whose sizes follow from the pickles and the storages in them. The simplest exact way to
know them before a job's first save is to ask DeepSpeed: its ``save_checkpoint`` runs once with the
checkpoint engine replaced by :class:`LayoutCheckpointEngine`, which pickles each file it is handed
(as torch.save would, the storages referenced, never copied; DeepSpeed's clones deferred, so
unfilled) and records the size of the file torch.save would write, and which makes no folder and
writes no file; the recovery script DeepSpeed copies beside the files is not copied either.

DeepSpeed's save is collective (a barrier, the tag check's all-reduces, ZeRO-3's gathers), so this
is too: every rank calls it. A failure on one rank is recorded, not raised, so that every rank still
reaches every collective of the call; the caller agrees on it afterwards.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Tuple

from ...execution.distributed import describe_failure
from ...formats.torch_save_file import MemoryRange, TorchSaveFile
from ...native import torch_save_size
from .own_save import deepspeeds_own
from .snapshot import CheckpointEngineStandIn, DeferredClones, deferring_clones, pickled_file

# The tag the layout's save is given: never a folder (nothing is made), only checked by DeepSpeed to be
# the same on every rank; its files' names do not depend on it.
LAYOUT_TAG = "pyckpt-layout"


def file_size(file: TorchSaveFile) -> int:
    """The size of the file torch.save writes for ``file``'s records."""
    return torch_save_size(file.archive_name,
                           [(name, p.nbytes if isinstance(p, MemoryRange) else len(p))
                            for name, p in file.closed_records()])


class LayoutCheckpointEngine(CheckpointEngineStandIn):
    """Stands in for DeepSpeed's checkpoint engine during a save that writes nothing: each file is
    pickled and its path and size recorded in ``files``; no folder is made; the first failure is kept
    in ``failure`` and the files after it are skipped."""

    def __init__(self, inner, files: List[Tuple[str, int]], clones: DeferredClones):
        super().__init__(inner)
        self._files = files
        self._clones = clones
        self.failure: Optional[str] = None

    def makedirs(self, path, exist_ok=False):
        return None

    def create(self, info):
        return None

    def save(self, state_dict, path):
        if self.failure is not None:
            return None
        try:
            file, storages = pickled_file(state_dict, os.fspath(path))
            for key, storage in storages:
                file.add(f"data/{key}", MemoryRange(0, 0, storage.nbytes()))
            self._files.append((file.path, file_size(file)))
        except Exception as exc:  # every rank must still reach DeepSpeed's next collective
            self.failure = f"laying out {os.fspath(path)}: {describe_failure(exc)}"
        finally:
            self._clones.clear()
        return None


def save_layout(engine, folder: str, exclude_frozen_parameters: bool = False) -> Tuple[List[Tuple[str, int]], Optional[str]]:
    """Every rank: (the (name below the tag folder, size) of each file this rank's save of ``engine``
    writes, why they could not be learned or None), from DeepSpeed's save into ``folder`` run without
    writing (see the module doc). Call on every rank, at a point where a save could be."""
    files: List[Tuple[str, int]] = []
    clones = DeferredClones()
    inner = engine.checkpoint_engine
    stand_in = LayoutCheckpointEngine(inner, files, clones)
    failure = None
    with contextlib.ExitStack() as stack:
        engine.checkpoint_engine = stand_in
        stack.callback(setattr, engine, "checkpoint_engine", inner)
        if getattr(engine, "_copy_recovery_script", None) is not None:
            engine._copy_recovery_script = lambda save_path: None  # a file copy: nothing is written here
            stack.callback(delattr, engine, "_copy_recovery_script")
        stack.enter_context(deferring_clones(clones))
        stack.enter_context(deepspeeds_own(engine))
        try:
            engine.save_checkpoint(folder, tag=LAYOUT_TAG, client_state={}, save_latest=False,
                                   exclude_frozen_parameters=exclude_frozen_parameters)
        except Exception as exc:
            failure = f"DeepSpeed's save_checkpoint raised: {describe_failure(exc)}"
    failure = stand_in.failure or failure
    tag_folder = os.path.join(folder, LAYOUT_TAG)
    return [(os.path.relpath(path, tag_folder), size) for path, size in files], failure
