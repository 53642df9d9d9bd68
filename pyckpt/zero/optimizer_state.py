"""Optimizer-state rules of the Universal Checkpoint layout (DeepSpeed 0.19.8 ``ds_to_universal``).

How the steps that dp ranks and ZeRO-3 sub-groups saved become one (the state names themselves are
:mod:`pyckpt.planning.state`'s), and what ``zero/optimizer_state.pt`` keeps of rank 0's shard.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from ..errors import CheckpointFormatError
from .shards import Step, ZeroShard

# ds_to_universal drops these from rank 0's ZeRO-1/2 shard when it writes zero/optimizer_state.pt:
# they are per-rank and are rebuilt by the loader from the per-parameter files.
SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def agreed_step(steps: List[Step], disagree: Callable[[List[Step]], Exception]) -> Optional[Step]:
    """The one step that every holder saved (the ranks holding a parameter; ZeRO-3's sub-groups, one
    torch optimizer state each, in every rank's shard or in a universal ``optimizer_state.pt``): torch's
    Adam steps every parameter at once, so they must agree. ``disagree(steps)`` is raised if they differ
    (a mixed-up or foreign shard), None if none saved one. Steps compare by :meth:`Step.key`."""
    if not steps:
        return None
    first = steps[0].key()
    if any(s.key() != first for s in steps[1:]):
        raise disagree(steps)
    return steps[0]


def zero3_step(ck):
    """The one Adam step of a ZeRO-3 checkpoint (a NewTensor, or a number): ZeRO-3 keeps one per flat
    sub-group partition, and every rank and sub-group must agree on it, as torch's Adam steps every
    parameter at once."""
    found = [Step(shard.file, g.state["step"]) for shard in ck.optim for g in shard.groups if "step" in g.state]
    step = agreed_step(found, lambda _: CheckpointFormatError(
        f"{ck.folder}: the ZeRO-3 partitions disagree on the Adam step (one step per sub-group and rank), so no one "
        "step per parameter can be told"))
    if step is None:
        raise CheckpointFormatError(f"{ck.folder}: no Adam step in the optimizer state: the optimizer never stepped")
    return step.output()


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
