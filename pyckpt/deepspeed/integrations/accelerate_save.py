"""accelerate's ``Accelerator.save_state`` folder complete or absent under ``enable(save=...)``.

``save_state`` (accelerate 1.15) writes one checkpoint folder in several steps: DeepSpeed's save
(``model.save_checkpoint(folder, "pytorch_model")``), then each process's RNG state, the samplers and the
registered objects; with ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=K)`` the
folder is ``<project_dir>/checkpoints/checkpoint_<i>`` and the oldest are removed first to make room, and
``load_state()`` takes the highest-numbered one. A kill between those steps leaves a folder that load
takes although part of it is missing. Here accelerate's own steps run unchanged into a hidden staging
folder (beside the final one, or in the project folder under automatic naming, whose ``checkpoints/``
``load_state`` lists whole); when every process's files are there (and, with ``save="async"``,
DeepSpeed's background write is published) the main process renames it into place in one step.

The automatic naming's rotation removes what accelerate's own would remove (:func:`rotation_victims`,
its rule read from ``save_state``), but after the new folder is in place, so a crash never leaves fewer
complete checkpoints than before; where accelerate's rotation fails (an entry of ``checkpoints/`` whose
name holds no number), the save fails the same way before anything is written or removed. A folder of the
user's given as ``output_dir`` keeps its files, as accelerate writes beside them
(:func:`.staged_folders.into_place`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Callable, List, Optional

from ...errors import printable
from ..save.in_flight import save_in_flight
from ..settings import save_mode
from .patching import Row, install_save_patch, save_patch
from .staged_folders import PendingFolder, agree, barrier, check_target, join_pending, make_staging

log = logging.getLogger("pyckpt")

STAGING_SUFFIX = ".pyckpt-accelerate"


# The number accelerate sorts ``checkpoints/`` by: the first run of digits in an entry's name (its
# save_state matches them in the last component of the entry's path).
_DIGITS = re.compile(r"([0-9]+)(?=[^/]*$)")


def rotation_victims(parent: str, limit: Optional[int]) -> List[str]:
    """What accelerate 1.15's ``save_state`` with automatic naming removes from ``parent`` (``checkpoints/``)
    before it writes the next folder: with ``total_limit`` set and every entry of ``parent`` (files and
    hidden ones included) plus the new one more than it, the entries sorted by the number in their names
    (ties in listing order), as many from the lowest as make room.

    Where accelerate's rotation fails, this raises as it does, before anything is removed: an entry whose
    name holds no number (its sort's IndexError; accelerate removes nothing then either), a victim that is
    not a folder (``shutil.rmtree``'s NotADirectoryError, or OSError for a link; accelerate has removed the
    victims sorted before it by then)."""
    if limit is None:
        return []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    if len(names) + 1 <= limit:
        return []

    def number(name: str) -> int:
        found = _DIGITS.findall(name)
        if not found:
            raise IndexError(f"{printable(os.path.join(parent, name))}: has no number in its name, and accelerate's "
                             f"rotation (total_limit={limit}) sorts every entry of {printable(parent)} by one (stock "
                             "accelerate stops here too); move it out of that folder")
        return int(found[0])
    names.sort(key=number)
    victims = [os.path.join(parent, name) for name in names[:len(names) + 1 - limit]]
    for path in victims:
        if os.path.islink(path):
            raise OSError(f"{printable(path)}: is a link, the oldest entry accelerate's rotation (total_limit={limit}) "
                          "would remove, and removing a link's tree fails (stock accelerate stops here too); kept")
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{printable(path)}: is not a folder, yet the oldest entry accelerate's rotation "
                                     f"(total_limit={limit}) would remove (stock accelerate stops here too); kept")
    return victims


def _remove(victims: List[str]) -> Callable[[], None]:
    def remove() -> None:
        for path in victims:
            if os.path.islink(path) or not os.path.isdir(path):  # replaced since the save began
                log.warning("pyckpt: kept %s: no longer the folder accelerate's rotation chose", printable(path))
                continue
            shutil.rmtree(path, ignore_errors=True)
    return remove


def _main_process(accelerator) -> bool:
    """The process that renames and rotates: rank 0 of the job (accelerate's own notion can be wrong where it
    did not set the process group up itself: under torchrun on CPU every process calls itself the main one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return accelerator.is_main_process


def _wrap(original: Callable, module=None) -> Callable:
    def save_state(self, output_dir=None, safe_serialization: bool = True, **kwargs):
        from accelerate.utils import DistributedType

        mode = save_mode()
        if mode is None or self.distributed_type != DistributedType.DEEPSPEED:
            return original(self, output_dir, safe_serialization, **kwargs)
        join_pending(self)
        config = self.project_configuration
        automatic = config.automatic_checkpoint_naming
        if automatic:
            parent = os.path.join(self.project_dir, "checkpoints")
            final = os.path.join(parent, f"checkpoint_{self.save_iteration}")
            if os.path.exists(final):
                return original(self, output_dir, safe_serialization, **kwargs)  # accelerate's own refusal
            # load_state() takes the highest number among every entry of checkpoints/, hidden ones too: the
            # staging folder stays out of it, in the project folder (the same filesystem)
            beside = os.path.abspath(self.project_dir)
        else:
            final = os.path.abspath(os.fspath(output_dir))
            parent = beside = os.path.dirname(final)
        staging_run = os.path.join(beside, "." + os.path.basename(final) + STAGING_SUFFIX)
        staged = os.path.join(staging_run, os.path.basename(final))
        lead = _main_process(self)
        victims: List[str] = []
        problem = None
        if lead:
            try:
                check_target(final)
                os.makedirs(parent, exist_ok=True)
                if automatic:  # chosen as accelerate chooses them before its save; removed after this one
                    victims = rotation_victims(parent, config.total_limit)
                make_staging(beside, staging_run, STAGING_SUFFIX)
            except Exception as exc:  # raised on every process, below
                problem = exc
        agree(problem)
        config.automatic_checkpoint_naming = False
        try:
            location = original(self, staged, safe_serialization, **kwargs)
        finally:
            config.automatic_checkpoint_naming = automatic
        barrier()  # every process's files are in the staged folder
        handle = next(filter(None, map(save_in_flight, self._models)), None) if mode == "async" else None
        problem = None
        if lead:
            folder = PendingFolder(self, staged, staging_run, final, handle, _remove(victims) if victims else None)
            folder.start()
            if mode == "atomic":
                try:
                    folder.join()
                except Exception as exc:
                    problem = exc
        if mode == "atomic":
            agree(problem)  # no process goes on before the folder is in place, or all raise
        return final if location == staged else location
    save_state.__pyckpt_hooked__ = True
    return save_state


PROVEN = ("1.15.0", )
ROW = Row("accelerate", "accelerate.accelerator", "Accelerator", {"save_state": _wrap}, PROVEN)
PATCH = save_patch("accelerate's staged save_state folder", ROW)


def install() -> None:
    install_save_patch(PATCH)


def uninstall() -> None:
    PATCH.uninstall()
