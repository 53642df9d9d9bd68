"""A barrier that names who did not come: the guard against a collective save called on some ranks.

DeepSpeed's ``save_checkpoint`` is collective; wrapped in ``if rank == 0:`` it blocks in its first
barrier until the process group's timeout (30 minutes by default, forever with some NCCL settings)
and then fails without saying why. Each rank here posts its arrival in the process group's own
key-value store and waits for everyone's with a timeout of its own, so a call on some ranks fails
fast with the ranks that are missing. The store is the one ``init_process_group`` set up (TCP or
file), whatever the collective backend is, so this works the same under gloo and NCCL.
"""

from __future__ import annotations

import datetime
from typing import List

from ...errors import CollectiveCallError


def _default_store():
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


class Arrival:
    """One round of arrivals under ``name`` (the same on every rank that makes the same call)."""

    def __init__(self, name: str, rank: int, world_size: int, store=None):
        self.prefix = f"pyckpt/arrival/{name}/"
        self.rank = rank
        self.world_size = world_size
        self.store = store if store is not None else _default_store()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def wait(self, timeout_s: float, what: str) -> None:
        """Returns once every rank has arrived; raises :class:`CollectiveCallError` naming the
        missing ranks after ``timeout_s`` seconds otherwise (this rank's arrival is withdrawn)."""
        self.store.set(self._key(self.rank), b"1")
        keys = [self._key(r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return
        except Exception as exc:  # the store's timeout error type differs between store kinds
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
        missing = self.missing()
        self.done()
        came = [r for r in range(self.world_size) if r not in set(missing)]
        raise CollectiveCallError(
            f"{what} is collective: every rank must call it, but within {timeout_s:g} s it was called on "
            f"rank(s) {_ranks(came)} and not on rank(s) {_ranks(missing)}. Call it on every rank, not under an "
            "`if rank == 0:` guard (DeepSpeed's save_checkpoint hangs there); rank 0 alone does the writes that "
            "need no collective")

    def missing(self) -> List[int]:
        return [r for r in range(self.world_size) if not self.store.check([self._key(r)])]

    def done(self) -> None:
        """Withdraws this rank's arrival. Call it only after a later collective every rank passed
        (then nobody still waits for it), or after giving up, so the same name can be used again."""
        try:
            self.store.delete_key(self._key(self.rank))
        except Exception:  # a store without deletion keeps one tiny key per call; nothing depends on it
            pass


def _ranks(ranks: List[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > limit else "") if ranks else "none"

