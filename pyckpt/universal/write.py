"""A checkpoint state written as DeepSpeed's Universal Checkpoint layout: the plan of its files.

``zero/<name>/<state>.pt`` per parameter state, ``zero/optimizer_state.pt``, and the model-state
files beside them (re-saved or copied), in the order the reader found them, as DeepSpeed 0.19.8's
ds_to_universal lays them out.
"""

from __future__ import annotations

from typing import Dict, Tuple

from ..planning.collector import pauses_collector
from ..planning.plan import Plan
from ..planning.state import CheckpointState
from ..zero.discovery import ZeroCheckpoint
from ..zero.read import read_zero_state
from .layout import OPTIMIZER_STATE, param_state_path


def universal_plan(state: CheckpointState) -> Plan:
    plan = Plan()
    plan.notes.extend(state.notes)
    for item in state.order:
        if item[0] == "param":
            _, name, key = item
            plan.add_archive(param_state_path(name, key), state.params[name][key])
        elif item[0] == "optimizer":
            plan.add_archive(OPTIMIZER_STATE, state.optimizer)
        else:
            mf = state.model_files[item[1]]
            if mf.source is not None:
                plan.add_copy(mf.source, mf.name)
            else:
                plan.add_archive(mf.name, mf.obj)
    return plan


@pauses_collector
def build_plan(ck: ZeroCheckpoint, inject_missing_state: bool = False, dense_only: bool = False,
               strict: bool = True) -> Tuple[Plan, Dict[str, int]]:
    """The Universal Checkpoint plan of a ZeRO checkpoint, and the reader's counts."""
    state, counts = read_zero_state(ck, inject_missing_state, dense_only, strict)
    return universal_plan(state), counts
