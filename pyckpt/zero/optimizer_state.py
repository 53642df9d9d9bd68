"""Optimizer-state rules of the Universal Checkpoint layout (DeepSpeed 0.19.8 ``ds_to_universal``).

Which per-parameter state files a universal folder holds, how the step every dp rank saved
becomes one ``step.pt``, and what ``zero/optimizer_state.pt`` keeps of rank 0's shard.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from .shards import Step, ZeroShard

# The per-parameter universal files, each a flat state in the ZeRO partitions: the fp32 master
# and Adam's two moments.
STATES = ("fp32", "exp_avg", "exp_avg_sq")

# ds_to_universal drops these from rank 0's ZeRO-1/2 shard when it writes zero/optimizer_state.pt:
# they are per-rank and are rebuilt by the loader from the per-parameter files.
SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def agreed_step(steps: List[Step], disagree: Callable[[List[Step]], Exception]) -> Optional[Step]:
    """The one step that every rank holding a parameter saved; ``disagree(steps)`` is raised if
    they differ (a mixed-up or foreign shard), None if none saved one."""
    if not steps:
        return None
    first = steps[0].key()
    if any(s.key() != first for s in steps[1:]):
        raise disagree(steps)
    return steps[0]


def universal_optimizer_state(rank0: ZeroShard, dp: int) -> dict:
    """``zero/optimizer_state.pt``: rank 0's shard without its per-rank parts, hyper-parameters on top."""
    if rank0.stage == 3:
        out = dict(rank0.saved)
    else:
        out = {}
        for key, value in rank0.saved.items():
            if key in SHARDED_KEYS:
                continue
            if key == "partition_count" and value:
                value = [dp] * len(value)
            elif key == "group_paddings" and value:
                value = [0] * len(value)
            out[key] = value
    out["param_groups"] = rank0.param_groups
    return out
