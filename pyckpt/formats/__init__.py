"""Byte formats, with no DeepSpeed knowledge: the torch.save ZIP container and the pickles in it
(reading them without running code, writing them back), safetensors, confinement of paths to a folder.

Import rule: the vocabulary (``errors``, ``tensors``, ``native``) and each other; nothing above.
"""
