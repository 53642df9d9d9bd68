"""Every class-level replacement pyckpt makes, one row each (:class:`.patching.Row`), and the patches that
apply them: what a reader, a test and ``enable()`` go by.

=============  ==============================================  ==============================  ==========
framework      class                                           replaced                        proven on
=============  ==============================================  ==============================  ==========
deepspeed      runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer  _load_universal_checkpoint   0.19.8
deepspeed      runtime.bf16_optimizer.BF16_Optimizer           _load_universal_checkpoint      0.19.8
deepspeed      runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3  _load_universal_checkpoint   0.19.8
deepspeed      runtime.engine.DeepSpeedEngine                  load_checkpoint                 0.19.8
deepspeed      runtime.engine.DeepSpeedEngine                  save_checkpoint                 0.19.8
transformers   trainer.Trainer                                 _save_checkpoint,               5.22.2
                                                               _maybe_log_save_evaluate,
                                                               _finalize_training, train
accelerate     accelerator.Accelerator                         save_state                      1.15.0
lightning      pytorch.strategies.deepspeed.DeepSpeedStrategy  remove_checkpoint               2.6.6
=============  ==============================================  ==============================  ==========

DeepSpeed's load rows apply together (``enable()``), its save row alone (``enable(save=...)``); each framework
above DeepSpeed is one patch of one row (``enable(save=...)``). tests/deepspeed/save/test_framework_patch.py
checks that these rows are every class attribute ``enable(save="async")`` replaces.
"""

from __future__ import annotations

from typing import Tuple

from . import accelerate_save, deepspeed_engine, lightning_save, trainer_save
from .patching import Patch, Row

PATCHES: Tuple[Patch, ...] = (deepspeed_engine.LOAD, deepspeed_engine.SAVE, trainer_save.PATCH,
                              accelerate_save.PATCH, lightning_save.PATCH)
ROWS: Tuple[Row, ...] = tuple(row for patch in PATCHES for row in patch.rows)
