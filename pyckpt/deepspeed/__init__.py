"""pyckpt inside a DeepSpeed job: the names DeepSpeed users import.

``enable()`` / ``disable()`` / ``enabled()`` route DeepSpeed's universal checkpoint loads through
pyckpt (:mod:`.load`) and, with ``enable(save="atomic" | "async")``, DeepSpeed's own ``save_checkpoint``
as frameworks call it (:mod:`.enabling`; every method replaced is a row of :mod:`.integrations`),
``load_checkpoint(engine, dir)`` resumes from plain ZeRO shards at any world
size (:mod:`.load.direct`), and ``save_checkpoint(engine, dir)`` saves so that a failure costs
nothing already saved (:mod:`.save`), ``prepare_memory_tier(engine, dir, save_tier=tier)`` readies the
memory tier for the first save while training starts (:mod:`.save.tier_preparation`); ``MemoryCheckpoints`` and ``resume_point`` put the memory tier
under the Hugging Face Trainer (:mod:`.integrations.trainer_memory`), ``wait_for_replication()`` waits until the
memory tier's newest checkpoint is on the peer node (:mod:`.replication_wait`), and ``init_distributed``
is DeepSpeed's own with the process group kept apart per torchrun restart (:mod:`.elastic_group`).

Import rule: this folder is the top of the library. It may import every folder below it
(``huggingface``, ``universal``, ``zero``, ``execution``, ``planning``, ``formats``) and the
vocabulary (``errors``, ``tensors``, ``native``); nothing in the library imports it, only the front
ends and users.
"""

from ..errors import CollectiveCallError, RankLoadError, SaveError
from .enabling import disable, enable, enabled
from .integrations.deepspeed_engine import load_checkpoint
from .save import AsyncSave, prepare_memory_tier, save_checkpoint, wait_for_saves
from .integrations.trainer_memory import resume_point
from .tiers.policy import MemoryTier
from .replication_wait import wait_for_replication
from .elastic_group import init_distributed

# MemoryCheckpoints (a transformers TrainerCallback) is reached through __getattr__ below and left out of
# __all__: importing it imports transformers, which neither `import pyckpt.deepspeed` nor `import *` needs.
__all__ = ["enable", "disable", "enabled", "load_checkpoint", "save_checkpoint", "wait_for_saves", "AsyncSave",
           "prepare_memory_tier",
           "MemoryTier", "wait_for_replication", "init_distributed", "resume_point", "SaveError",
           "CollectiveCallError", "RankLoadError"]


def __getattr__(name: str):
    if name == "MemoryCheckpoints":
        from .integrations.trainer_memory import _callback_class

        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
