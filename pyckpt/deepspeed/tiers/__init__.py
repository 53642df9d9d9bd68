"""Where a DeepSpeed job's checkpoints live besides durable storage: node-local memory (a tmpfs folder),
a peer node's memory, and ``save_dir``. The files are DeepSpeed's own in every tier, published by the
same agreed atomic rule, so every reader works on any tier unchanged. This folder holds the tier's
rules: the policy (:mod:`.policy`), the memory root itself, treated like any other hostile folder
(:mod:`.memory_root`: owner, mode, links, budget), whose a memory checkpoint is (:mod:`.job_identity`:
the job's folder, its run and save dir), the names of its folders and files (:mod:`.folder_names`),
what a node's share of a checkpoint is (:mod:`.node_manifest`), the one walk of its folders
(:mod:`.folder_walk`), the nodes (:mod:`.nodes`: numbering, layout, the ring) and their replica links
(:mod:`.links`), the replica protocol (:mod:`.replica_protocol`, :mod:`.replica_receiver`,
:mod:`.replica_sender`, the ring's :mod:`.ring_sender`), and which checkpoint a resume reads
(:mod:`.resume_choice`).

Import rule: everything below the integration floor (``huggingface``, ``universal``, ``zero``,
``execution``, ``planning``, ``formats``) and the vocabulary (``errors``, ``tensors``, ``native``);
neither the save glue (:mod:`..save`) nor the load backend (:mod:`..load`), which both import it.
"""
