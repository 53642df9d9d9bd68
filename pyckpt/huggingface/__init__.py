"""Hugging Face model folders written from a checkpoint's state: weight file names, the shard split
and index of ``huggingface_hub``, what ``from_pretrained`` expects beside the weights, AutoEP's
expert tensors under the model's own names, the export and a lazy state dict.

Import rule: ``universal`` (reading a Universal Checkpoint back), ``zero`` and everything below
them; not ``deepspeed``.
"""
