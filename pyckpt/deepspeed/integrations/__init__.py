"""pyckpt inside the frameworks that call DeepSpeed: every method pyckpt replaces on a framework's class,
declared as one row with the versions it was proven on (:mod:`.patching`, the rows in :mod:`.table`).

One module per framework: DeepSpeed's engine and optimizers (:mod:`.deepspeed_engine`: the load and
``save_checkpoint``), the Hugging Face Trainer (:mod:`.trainer_save`, what runs after its save:
:mod:`.trainer_after_save`, the memory tier under it: :mod:`.trainer_memory`), accelerate
(:mod:`.accelerate_save`) and Lightning (:mod:`.lightning_save`); a framework's checkpoint folder staged and
renamed into place: :mod:`.staged_folders`.

Import rule: this folder sits above the load backend (``..load``) and the save glue (``..save``) and calls
them; neither imports it. It may import the tier (``..tiers``), ``..settings`` and every folder below
``deepspeed``. Importing it imports no framework: each module imports its framework where it patches it.
"""
