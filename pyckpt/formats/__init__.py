"""Byte formats, with no DeepSpeed knowledge: the torch.save ZIP container and the pickles in it
(reading them without running code, writing them back)."""
