"""One rank of a recovery across two "nodes" without DeepSpeed (tests/deepspeed/tiers/test_memory_recovery.py): a gloo
process group of two processes, each its own node (GROUP_RANK, LOCAL_WORLD_SIZE=1) with its own memory
root, calls pyckpt's recovery on the shares the test laid out, and writes what it found.

    python memory_recovery_worker.py SPEC.json      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

SPEC: {"save_dir": durable folder, "out": folder for rank<r>.json, "fail_tags": tags whose sending
fails on this rank (an injected fault)}.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from logged import pyckpt_warnings  # noqa: E402  (tests/helpers/logged.py)


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from pyckpt.deepspeed.load import memory_recovery
    from pyckpt.deepspeed.tiers.policy import MemoryTier
    from pyckpt.execution.distributed import TorchRanks

    real_send = memory_recovery.send_folder

    def send(folder, node, tag, *args, **kwargs):
        if tag in spec.get("fail_tags", []):
            raise OSError(f"injected: the link to the other node dropped while sending {tag}")
        return real_send(folder, node, tag, *args, **kwargs)

    memory_recovery.send_folder = send
    lines = pyckpt_warnings()
    tier = MemoryTier(job="job", keep=2)
    found = memory_recovery.recover(tier, spec["save_dir"], TorchRanks())
    files = {}
    if found is not None:
        folder = os.path.join(*found)
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read().hex()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"found": found, "files": files, "log": lines, "sent": memory_recovery.last_recovery.get("sent")},
                  f)
    dist.barrier()
    from pyckpt.deepspeed.tiers.links import forget_all

    forget_all()
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main())
