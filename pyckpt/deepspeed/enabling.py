"""``pyckpt.deepspeed.enable()``: the load backend (:mod:`.load`) and, with ``save=``, DeepSpeed's own
``save_checkpoint`` made atomic or asynchronous for the frameworks that call it, the Hugging Face
Trainer's ``checkpoint-N/``, accelerate's ``save_state`` folder and Lightning's removal of older
checkpoints included (:mod:`.integrations`: every replaced method one row, with the versions it was
proven on). What it sets is one object, :data:`.settings.SETTINGS`.

``save`` is off by default: ``enable()`` has meant "resume anywhere" since its first release, and a save
routed through pyckpt stages, locks and agrees across ranks, which a job should ask for by name.
"""

from __future__ import annotations

import logging

from .integrations import accelerate_save, deepspeed_engine, lightning_save, trainer_save
from .save import memory_save
from .settings import SETTINGS, check_save_mode, release_async, save_mode, set_save_mode
from .tiers import resume_events
from .tiers.policy import one_tier

log = logging.getLogger("pyckpt")


class Enabled:
    """What ``enable()`` returns: truthy when the load hooks are in place; as a context manager it puts back
    what the call changed (the load settings, the save mode and hooks it installed)."""

    def __init__(self, loaded, save_before, installed_save: bool):
        self._loaded = loaded
        self._save_before = save_before
        self._installed_save = installed_save

    def __bool__(self) -> bool:
        return bool(self._loaded)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._loaded.__exit__(*exc)
        set_save_mode(self._save_before)
        if self._installed_save:
            _uninstall_save()

    def __repr__(self) -> str:
        save = save_mode()
        return f"<pyckpt: accelerated universal load {'enabled' if self else 'not enabled'}, " \
               f"save {save or 'DeepSpeed' + chr(39) + 's own'}>"


def enable(trust_pickles: bool = False, *, reshard: bool = True, resume_tier=None, save=None, memory=None) -> Enabled:
    """Route DeepSpeed's universal checkpoint loads through pyckpt. Returns a falsy handle (and leaves
    DeepSpeed alone, with one warning) on a DeepSpeed version pyckpt was not proven against
    (``PYCKPT_UNPROVEN_OK=deepspeed`` accepts it).

    With ``reshard`` (the default), ``engine.load_checkpoint(dir, tag)`` of a plain ZeRO checkpoint
    saved at another topology (data-parallel, tensor-parallel or AutoEP size) resumes straight from
    its shards, as :func:`pyckpt.deepspeed.load_checkpoint` does, with one line logged on rank 0; at the
    topology it was saved at the load stays DeepSpeed's own. A change it cannot serve fails on every rank
    before any state changes, naming both topologies. ``reshard=False`` leaves every plain load to DeepSpeed.

    pyckpt unpickles nothing its allowlist of checkpoint types refuses: a model-state file whose
    ``client_state`` holds other objects, or a universal folder this backend hands back to DeepSpeed
    holding such a file, stops the load with ``UnsafePickleError`` naming the file.
    ``trust_pickles=True`` gives those files to DeepSpeed's own readers instead, as without pyckpt.

    ``resume_tier`` (a :class:`pyckpt.deepspeed.MemoryTier`, the one the saves use; ``memory=`` is its former
    name, still taken) is where a resume looks: a
    load that names no tag (``engine.load_checkpoint(save_dir)``; the Trainer's resume through
    :func:`pyckpt.deepspeed.resume_point`) takes the newest checkpoint of the memory tier and ``save_dir``
    by recorded step, agreed by every rank, and says so in one line on rank 0. A load naming a tag
    (accelerate's ``load_state`` passes one) reads that tag, never the tier.

    ``save="atomic"`` routes ``DeepSpeedEngine.save_checkpoint``, as the Hugging Face Trainer, accelerate
    and Lightning call it, through pyckpt's collective save: DeepSpeed's files byte for byte, complete or
    invisible, agreed by every rank, ``latest`` written last; the Trainer's whole ``checkpoint-N/`` appears
    only once complete and its rotation never removes one being written. ``save="async"`` also returns once
    the state is snapshotted and writes in the background (joined by the next save, ``engine.destroy()``,
    the end of ``Trainer.train`` and exit). ``save=None`` (default) leaves saves to DeepSpeed. A framework
    on a version its rows were not proven on stays stock, with one warning (``PYCKPT_UNPROVEN_OK``, a
    comma-separated list of framework names or ``all``, accepts it); saves are then atomic, not
    asynchronous."""
    mode = check_save_mode(save)
    memory = one_tier(resume_tier, memory, "resume_tier")
    loaded = deepspeed_engine.enable_load(trust_pickles, reshard=reshard, memory=memory)
    if memory is not None:  # a job that resumes from memory persists it at its end, as one that saved does
        resume_events.listen(memory_save.after_resume)
    installed = False
    before = SETTINGS.save
    if mode is not None and loaded:
        installed = not deepspeed_engine.SAVE.installed()
        if deepspeed_engine.SAVE.install():  # else DeepSpeed and the frameworks stay stock (it warned)
            set_save_mode(mode)  # before the frameworks: they patch only while a mode is set
            trainer_save.install()
            accelerate_save.install()
            lightning_save.install()
            log.info("pyckpt: DeepSpeed's save_checkpoint is %s", "atomic and asynchronous"
                     if save_mode() == "async" else "atomic")
    return Enabled(loaded, before, installed)


def _uninstall_save() -> None:
    trainer_save.uninstall()
    accelerate_save.uninstall()
    lightning_save.uninstall()
    deepspeed_engine.SAVE.uninstall()
    set_save_mode(None)
    release_async()


def disable() -> None:
    """Give loads and saves back to DeepSpeed."""
    deepspeed_engine.LOAD.uninstall()
    _uninstall_save()


def enabled() -> bool:
    """Whether DeepSpeed's load runs through pyckpt."""
    return deepspeed_engine.LOAD.installed()
