"""The job's nodes: which node a rank is on, as torchrun numbers nodes (its group rank, not the host
name, so two agents on one machine with a root each behave exactly as two hosts), the layout of ranks
on nodes (each node's leader and rank block), and the ring that places each node's replica on the next
node (node ``n``'s on ``(n + 1) % N``: each node holds its own files and one neighbour's, and losing any
one node loses no checkpoint).
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

from ...errors import check_number, quoted

# ten digits keep int() far from Python's digit limit
_ENV_INT = re.compile(r"[0-9]{1,18}")


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if not value:
        return None
    if not _ENV_INT.fullmatch(value):
        raise ValueError(f"${name} must be a non-negative integer, not {quoted(value)}")
    return int(value)


def node_of(rank: int, local_world_size: Optional[int] = None) -> int:
    """The node global ``rank`` is on, as torchrun numbers nodes (its GROUP_RANK): ``rank //
    local_world_size``, the argument or else ``$LOCAL_WORLD_SIZE``; 0 when neither is known (all ranks
    on one node)."""
    check_number("rank", rank, integer=True, low=0)
    if local_world_size is None:
        local_world_size = _env_int("LOCAL_WORLD_SIZE")
        if local_world_size is None:
            return 0
    check_number("local_world_size", local_world_size, integer=True, low=1)
    return rank // local_world_size


def this_node() -> int:
    """This process's node: ``$GROUP_RANK`` where torchrun set it, else :func:`node_of` ``$RANK`` (0
    when unset)."""
    group = _env_int("GROUP_RANK")
    if group is not None:
        return group
    return node_of(_env_int("RANK") or 0)


def layout(nodes_of_ranks: List[int]) -> Tuple[List[int], List[Tuple[int, int]]]:
    """Leaders and rank ranges from every rank's node, checked: nodes numbered 0..N-1, each holding a
    contiguous block of ranks (as torchrun places them). A ValueError says what is wrong."""
    count = max(nodes_of_ranks) + 1
    ranges: Dict[int, List[int]] = {}
    for rank, node in enumerate(nodes_of_ranks):
        ranges.setdefault(node, []).append(rank)
    if sorted(ranges) != list(range(count)):
        raise ValueError(f"the ranks' node numbers ({sorted(ranges)}) are not 0 to {count - 1}: set torchrun's "
                         f"GROUP_RANK / LOCAL_WORLD_SIZE consistently on every node")
    leaders, spans = [], []
    for n in range(count):
        ranks = ranges[n]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"node {n} holds ranks {ranks}, not one contiguous block; the memory tier expects "
                             f"torchrun's placement (node = rank // LOCAL_WORLD_SIZE)")
        leaders.append(ranks[0])
        spans.append((ranks[0], len(ranks)))
    return leaders, spans


def replica_target(node: int, nodes: int) -> Optional[int]:
    """The node that keeps ``node``'s replica: the next one in a ring; None on one node."""
    return None if nodes < 2 else (node + 1) % nodes
