"""A ZeRO checkpoint read into its logical state (ZeRO-1/2 or ZeRO-3 rules by its stage).

The state is also the consolidated view other capabilities start from: the ``fp32`` state of every
trainable parameter is its full fp32 value, TP-merged and with experts gathered.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from ..planning.collector import pauses_collector
from ..planning.state import CheckpointState
from .discovery import ZeroCheckpoint
from .stage12 import plan_zero12
from .stage3 import plan_zero3


@pauses_collector
def read_zero_state(ck: ZeroCheckpoint, inject_missing_state: bool = False, dense_only: bool = False,
                    strict: bool = True, states: Optional[Sequence[str]] = None
                    ) -> Tuple[CheckpointState, Dict[str, int]]:
    """The checkpoint's parameters and optimizer state; ``states`` limits which per-parameter states
    are read (e.g. ``("fp32",)`` for an export), all of them by default."""
    state = CheckpointState(tuple(states) if states is not None else None)
    if ck.stage <= 2:
        counts = plan_zero12(ck, state, inject_missing_state, dense_only, strict)
    else:
        counts = plan_zero3(ck, state, strict)
    return state, counts

