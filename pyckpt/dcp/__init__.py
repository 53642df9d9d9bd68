"""torch.distributed.checkpoint (DCP) folders written from a checkpoint's state, so that a job moving
to FSDP2 or torchtitan keeps its weights and its Adam moments: the layout of keys and chunks
(:mod:`.layout`), the ``.metadata`` file (:mod:`.metadata`), and the export (:mod:`.export`).

Import rule: ``huggingface`` (the model state an export consolidates, AutoEP's names), ``universal``,
``zero`` and everything below them; not ``deepspeed``.
"""
