"""Reading DeepSpeed ZeRO-1/2/3 checkpoints into the logical checkpoint state: discovery of the
files, typed records of their pickled metadata (schema, names, model states, optimizer shards), the
ZeRO-1/2 and ZeRO-3 partition rules, the tensor-parallel merge (Megatron and AutoTP), AutoEP
experts (:mod:`.autoep`), and zero_to_fp32's consolidated view of the state (:mod:`.consolidated`).

Import rule: ``planning``, ``formats`` and the vocabulary; no output format (``universal``,
``huggingface``) and no integration (``deepspeed``).
"""
