"""Where a DeepSpeed job's checkpoints live besides durable storage: node-local memory (a tmpfs folder),
a peer node's memory, and ``save_dir``. The files are DeepSpeed's own in every tier, published by the
same agreed atomic rule, so every reader works on any tier unchanged; this folder holds only the policy
(where a save goes, how often it is persisted, which tier a resume reads) and the memory root itself,
treated like any other hostile folder (:mod:`.memory_root`: owner, mode, links, budget).

Import rule: everything below the integration floor (``huggingface``, ``universal``, ``zero``,
``execution``, ``planning``, ``formats``) and the vocabulary (``errors``, ``tensors``, ``native``);
neither the save glue (:mod:`..save`) nor the load backend (:mod:`..load`), which both import it.
"""
