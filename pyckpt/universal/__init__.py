"""DeepSpeed's Universal Checkpoint layout: writing the state as its folder (:mod:`.write`, and the
complete-or-absent conversion :mod:`.convert`), reading a folder back (:mod:`.read`, :mod:`.layout`),
the slice rules a load applies to its tensors (:mod:`.slice`, :mod:`.restore_meta`,
:mod:`.expert_slice`), and checking a folder (:mod:`.verify`).

Import rule: ``zero`` (the state a conversion writes), ``execution`` and everything below; not
``huggingface`` nor ``deepspeed``.
"""
