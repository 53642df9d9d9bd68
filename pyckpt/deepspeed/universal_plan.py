"""The Universal Checkpoint plan of a ZeRO checkpoint: ZeRO-1/2 or ZeRO-3 rules by its stage.

The plan is also the consolidated view other capabilities start from: the ``zero/<name>/fp32.pt``
tensor of every trainable parameter is its full fp32 value, TP-merged and with experts gathered.
"""

from __future__ import annotations

from typing import Dict, Tuple

from ..planning.plan import Plan
from ..planning.collector import pauses_collector
from .discovery import ZeroCheckpoint
from .zero12 import plan_zero12
from .zero3 import plan_zero3


@pauses_collector
def build_plan(ck: ZeroCheckpoint, inject_missing_state: bool = False, dense_only: bool = False,
               strict: bool = True) -> Tuple[Plan, Dict[str, int]]:
    plan = Plan()
    if ck.stage <= 2:
        counts = plan_zero12(ck, plan, inject_missing_state, dense_only, strict)
    else:
        counts = plan_zero3(ck, plan, strict)
    return plan, counts
