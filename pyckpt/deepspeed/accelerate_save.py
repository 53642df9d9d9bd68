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
The automatic naming's rotation is done here, after the folder is in place, with accelerate's rule
(the highest numbers kept), so it never removes one being written nor the newest complete one.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable

from .save import engine_hook
from .framework_folders import MethodOnImport, PendingFolder, barrier, clean_staging, join_pending

STAGING_SUFFIX = ".pyckpt-accelerate"


def _number(name: str) -> int:
    found = re.findall(r"([0-9]+)(?=[^/]*$)", name)
    return int(found[0]) if found else -1


def _rotate(parent: str, limit):
    def rotate():
        if limit is None:
            return
        names = [n for n in os.listdir(parent) if not n.startswith(".")]
        names.sort(key=_number)
        for name in names[:max(0, len(names) - limit)]:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return rotate


def _main_process(accelerator) -> bool:
    """The process that renames and rotates: rank 0 of the job (accelerate's own notion can be wrong where it
    did not set the process group up itself: under torchrun on CPU every process calls itself the main one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return accelerator.is_main_process


def _wrap(original: Callable) -> Callable:
    def save_state(self, output_dir=None, safe_serialization: bool = True, **kwargs):
        from accelerate.utils import DistributedType

        mode = engine_hook.mode()
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
        if lead:
            os.makedirs(parent, exist_ok=True)
            clean_staging(beside, STAGING_SUFFIX, keep=staging_run)
            shutil.rmtree(staging_run, ignore_errors=True)
            os.makedirs(staging_run)
        barrier()
        config.automatic_checkpoint_naming = False
        try:
            location = original(self, staged, safe_serialization, **kwargs)
        finally:
            config.automatic_checkpoint_naming = automatic
        barrier()  # every process's files are in the staged folder
        engine = next((m for m in self._models if hasattr(m, "_pyckpt_async_save")), None)
        handle = getattr(engine, "_pyckpt_async_save", None) if mode == "async" else None
        if lead:
            after = _rotate(parent, config.total_limit) if automatic else None
            PendingFolder(self, staged, staging_run, final, handle, after).start()
        if mode == "atomic":
            barrier()
        return final if location == staged else location
    save_state.__pyckpt_hooked__ = True
    return save_state


_SAVE_STATE = MethodOnImport("accelerate.accelerator", "Accelerator", "save_state", _wrap)


def install() -> None:
    _SAVE_STATE.install()


def uninstall() -> None:
    _SAVE_STATE.uninstall()
