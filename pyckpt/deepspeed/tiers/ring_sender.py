"""The ring's sender: a node leader's background replication of its node's newest memory checkpoint to
the next node (:func:`.nodes.replica_target`). Sending is newest-wins: the thread always takes the
newest published checkpoint not yet sent; one saved while an older one is still on the way waits for
that one, and an intermediate one is skipped rather than queued (training never waits for
replication).
"""

from __future__ import annotations

import logging
import threading
from typing import List, Optional, Tuple

from ...execution.distributed import describe_failure
from .nodes import replica_target
from .replica_sender import send_folder

log = logging.getLogger("pyckpt")


class Sender:
    """A leader's background replication of its node's newest memory checkpoint to the ring's next
    node (``links``: the job's :class:`~.links.Nodes`); newest-wins (module docstring). :meth:`offer` never blocks; :meth:`flush` waits for the
    newest offered one to be sent or to fail (``pyckpt.deepspeed.wait_for_replication``, the end of a
    job)."""

    def __init__(self, links):
        self.links = links
        self.target = replica_target(links.node, links.count)
        self._cond = threading.Condition()
        self._pending: Optional[Tuple[str, str]] = None
        self._busy = False
        self._closed = False
        self.sent: List[Tuple[str, float]] = []  # (tag, seconds) of each replica the peer verified
        self.failed: List[Tuple[str, str]] = []  # (tag, why)
        self.last: Optional[Tuple[bool, str]] = None  # (verified, tag) of the last one tried
        self._thread = threading.Thread(target=self._run, name="pyckpt-replicate", daemon=True)
        self._thread.start()

    def offer(self, tag_folder: str, tag: str) -> None:
        with self._cond:
            self._pending = (tag_folder, tag)
            self._cond.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (None: no limit) until nothing is pending or in flight. True
        when the newest checkpoint offered was verified by the peer (or none was offered); False when
        it failed, or is still pending or on its way at the timeout (a replica verified earlier does
        not stand for a newer one), or the sender was closed before sending it."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (self._pending is None and not self._busy), timeout)
            if self._pending is not None or self._busy:
                return False
            return self.last is None or self.last[0]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending is not None)
                if self._closed:
                    return
                folder, tag = self._pending
                self._pending = None
                self._busy = True
            try:
                sent = send_folder(folder, self.links.node, tag, self.links.addresses[self.target], self.links.token)
                with self._cond:
                    self.sent.append((tag, sent.seconds))
                    self.last = (True, tag)
            except Exception as exc:  # the checkpoint stays in this node's memory; the next one retries
                why = describe_failure(exc)
                with self._cond:
                    first = not self.failed or self.failed[-1][1] != why
                    self.failed.append((tag, why))
                    self.last = (False, tag)
                if first:
                    log.warning("pyckpt: replicating %s to node %d failed: %s", tag, self.target, why)
            finally:
                with self._cond:
                    self._busy = False
                    del self.sent[:-100], self.failed[:-100]
                    self._cond.notify_all()
