"""Accelerated Universal Checkpoint loading for DeepSpeed: each rank reads only its own bytes.

``enable()`` replaces the universal load of DeepSpeed's ZeRO-1/2, BF16 and ZeRO-3 optimizers
(:mod:`.hooks`); ``engine.load_checkpoint(...)`` with ``"checkpoint": {"load_universal": true}`` then
parses the state files with pyckpt's safe reader and gathers each rank's element runs natively into
its flat partitions and optimizer-state buffers (:mod:`.stage12_restore`, :mod:`.stage3_restore`).
A load that names a plain ZeRO checkpoint instead, and ``load_checkpoint(engine, dir)``, resume from
the ZeRO shards directly, read as the universal folder they would convert to (:mod:`.direct`).
Public as ``pyckpt.deepspeed.enable`` / ``disable`` / ``load_checkpoint``.

Import rule: the load backend reads through ``universal`` (layout, slice rules, restore metadata) and
``zero`` (the virtual universal view of a ZeRO checkpoint) and everything below them; not the save
glue (:mod:`..save`) nor ``huggingface``.
"""

from __future__ import annotations


class _Enabled:
    """What ``enable()`` returns: truthy when the hooks are in place; as a context manager, it
    removes them again on exit if this call installed them, and restores the settings it changed."""

    def __init__(self, active: bool, installed_here: bool, trust_before: bool, reshard_before: bool,
                 memory_before=None):
        self.active = active
        self._installed_here = installed_here
        self._trust_before = trust_before
        self._reshard_before = reshard_before
        self._memory_before = memory_before

    def __bool__(self) -> bool:
        return self.active

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        from . import hooks

        hooks.trust_pickles(self._trust_before)
        hooks.reshard(self._reshard_before)
        hooks.memory_tier(self._memory_before)
        if self._installed_here:
            disable()

    def __repr__(self) -> str:
        return f"<pyckpt accelerated universal load: {'enabled' if self.active else 'not enabled'}>"


def enable(trust_pickles: bool = False, *, reshard: bool = True, memory=None) -> _Enabled:
    """Route DeepSpeed's universal checkpoint loads through pyckpt. Returns a falsy handle (and
    leaves DeepSpeed alone, with a warning) on a DeepSpeed version pyckpt was not proven against.

    With ``reshard`` (the default), ``engine.load_checkpoint(dir, tag)`` of a plain ZeRO checkpoint
    saved at another topology (data-parallel, tensor-parallel or AutoEP size) resumes straight from
    its shards, as ``load_checkpoint`` below does, with one line logged on rank 0; at the topology it
    was saved at the load stays DeepSpeed's own. A change it cannot serve fails on every rank before
    any state changes, naming both topologies. ``reshard=False`` leaves every plain load to DeepSpeed.

    pyckpt unpickles nothing its allowlist of checkpoint types refuses: a model-state file whose
    ``client_state`` holds other objects, or a universal folder this backend hands back to DeepSpeed
    holding such a file, stops the load with ``UnsafePickleError`` naming the file.
    ``trust_pickles=True`` gives those files to DeepSpeed's own readers instead, as without pyckpt.

    ``memory`` (a :class:`pyckpt.deepspeed.MemoryTier`, the one the saves use): a load that names no tag
    (``engine.load_checkpoint(save_dir)``; the Trainer's resume through
    :func:`pyckpt.deepspeed.resume_point`) takes the newest checkpoint of the memory tier and ``save_dir``
    by recorded step, agreed by every rank, and says so in one line on rank 0. A load naming a tag
    (accelerate's ``load_state`` passes one) reads that tag, never the tier."""
    from . import hooks

    already = hooks.installed()
    active = hooks.install()
    before = hooks.trust_pickles(trust_pickles if active else None)
    reshard_before = hooks.reshard(reshard if active else None)
    memory_before = hooks.memory_tier(memory if active else False)
    return _Enabled(active, installed_here=active and not already, trust_before=before,
                    reshard_before=reshard_before, memory_before=memory_before)


def disable() -> None:
    """Give the universal load back to DeepSpeed."""
    from . import hooks

    hooks.uninstall()


def enabled() -> bool:
    from . import hooks

    return hooks.installed()


def load_checkpoint(engine, load_dir, tag=None, *, trust_pickles: bool = False, **kwargs):
    """Resume ``engine`` from a plain ZeRO checkpoint at any world size, without converting it
    (see :func:`pyckpt.deepspeed.load.direct.load_checkpoint`; ``trust_pickles`` as for
    :func:`enable`)."""
    from .direct import load_checkpoint as load

    return load(engine, load_dir, tag, trust_pickles=trust_pickles, **kwargs)
