"""AutoEP (DeepSpeed's automatic expert parallelism) in a ZeRO checkpoint, split by concern: the
layer metadata and expert placement (``layers``), and the ZeRO-1/2 and partition-native ZeRO-3 expert
consolidations (``stage12``, ``stage3``).

Import rule: as :mod:`pyckpt.zero`; the load side's expert slicing is
:mod:`pyckpt.universal.expert_slice`, and the Hugging Face names of experts
:mod:`pyckpt.huggingface.autoep_names`.
"""
