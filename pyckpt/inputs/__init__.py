"""Any checkpoint pyckpt reads, given as a path: what it is and the reader that opens it
(:mod:`.dispatch`), and the verbs that take any of them (:mod:`.export`: Hugging Face files from a
DCP folder or a DeepSpeed checkpoint).

Import rule: the format folders (``dcp``, ``huggingface``, ``universal``, ``zero``) and everything
below them; not ``deepspeed``, which may use it.
"""
