"""A c10d rendezvous store held by the test process for the torchrun agents it launches.

Picking a free port and handing it to the agents leaves a window of seconds (the agents' interpreter
and torch start-up) in which any other process on the machine may take the port as an ephemeral one;
then no agent can host the store, every agent waits as a client and the launch fails after 60 s
(seen under xdist). A store bound here to port 0 and kept open until the agents are done has no such
window; the agents are told they are clients of it (``is_host=false``)."""

from __future__ import annotations

import contextlib
import datetime


@contextlib.contextmanager
def held_rendezvous(timeout_s: int = 600):
    """Yields the torchrun arguments that make each agent meet at a store this process hosts."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false"]
    finally:
        del store
