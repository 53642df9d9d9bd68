"""``pyckpt.deepspeed.enable()``: the load backend (:mod:`.load`) and, with ``save=``, DeepSpeed's own
``save_checkpoint`` made atomic or asynchronous for the frameworks that call it (:mod:`.save.engine_hook`),
the Hugging Face Trainer's ``checkpoint-N/`` (:mod:`.trainer_save`), accelerate's ``save_state`` folder
(:mod:`.accelerate_save`) and Lightning's removal of older checkpoints (:mod:`.lightning_save`) included.

``save`` is off by default: ``enable()`` has meant "resume anywhere" since its first release, and a save
routed through pyckpt stages, locks and agrees across ranks, which a job should ask for by name.
"""

from __future__ import annotations

import logging

from . import accelerate_save, lightning_save, load, trainer_save
from .save import engine_hook, memory_save
from .tiers import resume_events

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
        engine_hook.set_mode(self._save_before)
        if self._installed_save:
            _uninstall_save()

    def __repr__(self) -> str:
        save = engine_hook.mode()
        return f"<pyckpt: accelerated universal load {'enabled' if self else 'not enabled'}, " \
               f"save {save or 'DeepSpeed' + chr(39) + 's own'}>"


def enable(trust_pickles: bool = False, *, reshard: bool = True, memory=None, save=None) -> Enabled:
    """See :func:`pyckpt.deepspeed.load.enable` for the load side. ``save="atomic"`` routes
    ``DeepSpeedEngine.save_checkpoint``, as the Hugging Face Trainer, accelerate and Lightning call it,
    through pyckpt's collective save: DeepSpeed's files byte for byte, complete or invisible, agreed by every
    rank, ``latest`` written last; the Trainer's whole ``checkpoint-N/`` appears only once complete and its
    rotation never removes one being written. ``save="async"`` also returns once the state is snapshotted and
    writes in the background (joined by the next save, ``engine.destroy()``, the end of ``Trainer.train`` and
    exit). ``save=None`` (default) leaves saves to DeepSpeed."""
    mode = engine_hook.check_mode(save)
    loaded = load.enable(trust_pickles, reshard=reshard, memory=memory)
    if memory is not None:  # a job that resumes from memory persists it at its end, as one that saved does
        resume_events.listen(memory_save.after_resume)
    installed = False
    before = engine_hook.mode()
    if mode is not None and loaded:
        installed = not engine_hook.installed()
        if engine_hook.install():  # else DeepSpeed and the frameworks stay stock (it warned)
            engine_hook.set_mode(mode)  # before the frameworks: they patch only while a mode is set
            trainer_save.install()
            accelerate_save.install()
            lightning_save.install()
            log.info("pyckpt: DeepSpeed's save_checkpoint is %s", "atomic and asynchronous"
                     if engine_hook.mode() == "async" else "atomic")
    return Enabled(loaded, before, installed)


def _uninstall_save() -> None:
    trainer_save.uninstall()
    accelerate_save.uninstall()
    lightning_save.uninstall()
    engine_hook.uninstall()


def disable() -> None:
    """Give loads and saves back to DeepSpeed."""
    load.disable()
    _uninstall_save()
