"""The job's process group under torchrun's elastic restarts (``--max-restarts``).

torchrun's workers meet in the store its agent hosts (``TORCHELASTIC_USE_AGENT_STORE=True``), and
``torch.distributed``'s ``env://`` rendezvous connects to it without a prefix per attempt
(``torch.distributed.rendezvous._create_c10d_store`` assumes a fresh store for every retry). Where the
agent keeps one store across restarts, a restarted worker finds the keys the previous attempt's workers
left there: gloo's full-mesh connect reads a killed rank's old address from them and fails ("Gloo
connectFullMesh failed ... Connection refused"; seen with torch 2.13 on CPU). :func:`init_distributed`
connects to the same store under a prefix naming the attempt (``TORCHELASTIC_RESTART_COUNT``), so each
attempt's ranks meet only one another, then hands over to DeepSpeed's own ``deepspeed.init_distributed``.

``deepspeed`` is imported only when :func:`init_distributed` runs.
"""

from __future__ import annotations

import os
from typing import Optional

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
NEEDED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# the keys of attempt N live under "pyckpt-attempt-N/" in the agent's store
PREFIX = "pyckpt-attempt-"


def attempt_prefix() -> Optional[str]:
    """The store prefix of this worker's attempt under torchrun's agent store, or None where the
    process was not started so (another launcher, plain ``python``, a store of its own)."""
    if os.environ.get(AGENT_STORE) != "True" or not all(os.environ.get(n) for n in NEEDED):
        return None
    restart = os.environ.get(RESTART_COUNT, "0")
    if not restart.isdigit():
        raise ValueError(f"{RESTART_COUNT}={restart!r} is not a whole number; torchrun sets it to the attempt's "
                         f"number (0, 1, ...)")
    return f"{PREFIX}{int(restart)}"


def init_distributed(dist_backend: Optional[str] = None, **kwargs) -> None:
    """DeepSpeed's ``deepspeed.init_distributed(dist_backend, **kwargs)``, the process group keyed by
    torchrun's attempt first (module docstring). Call it on every rank where the script would call
    DeepSpeed's, before ``deepspeed.initialize`` (and before the Hugging Face ``TrainingArguments`` or
    accelerate's ``Accelerator`` are made: they then find the group ready and use it).

    Under torchrun's agent store, with no process group yet and none of ``init_method``, ``rank``,
    ``world_size`` or ``dist_init_required=False`` given (each says the caller sets the group up its own
    way), the default group is initialised here: ``torch.distributed.init_process_group`` on the
    agent's store under the attempt's prefix, with ``dist_backend`` (default: the accelerator's, as
    DeepSpeed picks it) and ``timeout`` (default: DeepSpeed's). DeepSpeed's ``init_distributed`` then
    runs with every argument as given and adopts that group. Anywhere else this is DeepSpeed's call
    unchanged."""
    import deepspeed
    import torch.distributed as dist

    prefix = attempt_prefix()
    own_way = any(kwargs.get(k) not in (None, -1) for k in ("init_method", "rank", "world_size"))
    if (prefix is not None and not own_way and kwargs.get("dist_init_required") is not False
            and not dist.is_initialized()):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.constants import default_pg_timeout

        backend = dist_backend or get_accelerator().communication_backend_name()
        timeout = kwargs.get("timeout") or default_pg_timeout
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, agent), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    deepspeed.init_distributed(dist_backend=dist_backend, **kwargs)
