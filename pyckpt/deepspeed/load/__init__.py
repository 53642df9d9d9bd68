"""Accelerated Universal Checkpoint loading for DeepSpeed: each rank reads only its own bytes.

``pyckpt.deepspeed.enable()`` replaces the universal load of DeepSpeed's ZeRO-1/2, BF16 and ZeRO-3
optimizers and the engine's ``load_checkpoint`` (declared and installed by
``pyckpt.deepspeed.integrations.deepspeed_engine``) with what :mod:`.hooks` runs;
``engine.load_checkpoint(...)`` with ``"checkpoint": {"load_universal": true}`` then parses the state
files with pyckpt's safe reader and gathers each rank's element runs natively into its flat partitions
and optimizer-state buffers (:mod:`.stage12_restore`, :mod:`.stage3_restore`). A load that names a plain
ZeRO checkpoint instead, and ``pyckpt.deepspeed.load_checkpoint(engine, dir)``, resume from the ZeRO
shards directly, read as the universal folder they would convert to (:mod:`.direct`).

Import rule: the load backend reads through ``universal`` (layout, slice rules, restore metadata) and
``zero`` (the virtual universal view of a ZeRO checkpoint) and everything below them, the tier
(``..tiers``) and ``..settings``; not the save glue (:mod:`..save`), the framework integrations
(``..integrations``, which call it) nor ``huggingface``.
"""
