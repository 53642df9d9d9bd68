"""Waiting until the memory tier's newest checkpoint has reached the peer node.

A memory save returns once the checkpoint is published in this node's memory; each node's leader then
sends it to the next node in the background (:class:`~.tiers.ring_sender.Sender`, newest-wins), and
training never waits for that. :func:`wait_for_replication` is the one place a job does wait: before a
planned shutdown of a node, before it trusts that losing any one node costs nothing, or in a test.
"""

from __future__ import annotations

import sys
from typing import Optional

from ..errors import check_number
from ..execution.distributed import TorchRanks
from .save import wait_for_saves
from .tiers import links


def wait_for_replication(timeout: Optional[float] = None) -> bool:
    """Waits until every node's newest memory checkpoint is held, verified, by its peer node.

    Collective: every rank calls it (as it calls ``save_checkpoint``). Each rank first joins its
    asynchronous saves (:func:`~.save.wait_for_saves`: a save offers its checkpoint to the peer once
    published), then each node's leader waits up to ``timeout`` seconds (None: no limit) for its
    background sender to have sent the newest checkpoint it was offered and the peer to have checked
    every file's size and CRC-32 and published the replica; the ranks then agree. Returns True on every
    rank when every node's newest memory checkpoint is replicated (also at once on one node, or before
    any memory save); False on every rank when any node's is not: its send failed (the sender logged
    why, and the next save retries) or is still under way at the timeout."""
    if timeout is not None:
        check_number("timeout", timeout, low=0)
    wait_for_saves()
    mine = links.replicated(timeout)
    dist = sys.modules.get("torch.distributed")  # imported by any job with a process group
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return mine
    return all(TorchRanks().all_gather(mine))
