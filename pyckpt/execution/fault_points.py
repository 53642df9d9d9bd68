"""Test hooks that stop a run at a chosen step, so fault-injection tests can reach every state a crash
leaves: between any two renames of a publication, or after one rank of a spread run wrote its share.
Each costs one environment lookup when unused.
"""

from __future__ import annotations

import errno
import os
import signal


def fault_point(name: str) -> None:
    """``PYCKPT_TEST_KILL_AT=<name>`` kills this process with SIGKILL at that step, so fault-injection
    tests can stop a run between any two renames."""
    if os.environ.get("PYCKPT_TEST_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def rank_fault_point(rank: int) -> None:
    """``PYCKPT_TEST_FAIL_RANK=<rank>`` makes that rank of a spread run fail once it has written its
    share, as a full disk would, so tests can see every rank raise and nothing remain."""
    if os.environ.get("PYCKPT_TEST_FAIL_RANK") == str(rank):
        raise OSError(errno.EIO, f"injected failure on rank {rank} (PYCKPT_TEST_FAIL_RANK)")
