"""pyckpt.deepspeed.init_distributed (pyckpt/deepspeed/elastic_group.py): DeepSpeed's init_distributed with the
process group keyed by torchrun's attempt where the workers meet in the agent's store, so a restarted
worker never reads what the previous attempt's ranks left there; DeepSpeed's own call unchanged
elsewhere. The real elastic restarts run it in tests/workers/memory_crash_worker.py
(tiers/test_memory_tier.py); here one worker process, no DeepSpeed launch."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyckpt.deepspeed import elastic_group

TESTS = Path(__file__).resolve().parents[2]

TORCHRUN = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "RANK": "1",
            "WORLD_SIZE": "2"}


def test_the_attempt_prefix_only_under_torchrun_s_agent_store(monkeypatch):
    for name in list(TORCHRUN) + ["TORCHELASTIC_RESTART_COUNT"]:
        monkeypatch.delenv(name, raising=False)
    assert elastic_group.attempt_prefix() is None  # plain python, another launcher
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert elastic_group.attempt_prefix() == "pyckpt-attempt-0"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert elastic_group.attempt_prefix() == "pyckpt-attempt-2"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # each attempt's rank 0 hosts a store of its own
    assert elastic_group.attempt_prefix() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "-1")
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='-1' is not a whole number"):
        elastic_group.attempt_prefix()


@pytest.mark.parametrize("own", [{}, {"init_method": "tcp://127.0.0.1:29400", "rank": 1, "world_size": 2},
                                 {"dist_init_required": False}], ids=["elsewhere", "own-init", "no-init"])
def test_anywhere_else_it_is_deepspeed_s_own_call_unchanged(monkeypatch, own):
    """Outside torchrun's agent store, or where the caller sets the group up its own way, nothing is
    initialised here and DeepSpeed gets every argument as given."""
    import deepspeed
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(deepspeed, "init_distributed", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("initialised a group itself"))
    for name, value in TORCHRUN.items():
        if own:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    elastic_group.init_distributed("gloo", timeout=datetime.timedelta(seconds=5), **own)
    assert calls == [((), {"dist_backend": "gloo", "timeout": datetime.timedelta(seconds=5), **own})]


def test_a_restarted_worker_s_group_lives_under_its_attempt_in_the_agent_s_store(tmp_path):
    """A worker of attempt 3 (torchrun's agent store played by this process): every key its group writes,
    gloo's address among them, lies under ``pyckpt-attempt-3/``, apart from an earlier attempt's keys
    (where a restarted rank read a killed rank's old address); DeepSpeed's comm adopts the group."""
    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    # where the group of an attempt without a prefix of its own reads rank 0's address (env://)
    agent.set("default_pg/0//cpu//0/0", "the address a killed rank of attempt 0 left")
    env = {**os.environ, **TORCHRUN, "MASTER_PORT": str(agent.port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "TORCHELASTIC_RESTART_COUNT": "3", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    code = f"""
import sys
sys.path.insert(0, {str(TESTS / "dsharness")!r})
import worker
worker.skip_shm_comm_op()  # DeepSpeed would compile its shared-memory op at init on CPU; nothing here uses it
import deepspeed.comm
import torch.distributed as dist
import pyckpt.deepspeed as pd
pd.init_distributed(dist_backend="gloo")
assert deepspeed.comm.is_initialized() and deepspeed.comm.get_world_size() == 1
assert dist.get_backend() == "gloo"
dist.barrier()
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    keys = agent.list_keys()
    ours = [k for k in keys if k.startswith("pyckpt-attempt-3/")]
    assert any(k.endswith("cpu//0/0") for k in ours), keys  # gloo's address of rank 0, under the attempt
    assert sorted(set(keys) - set(ours)) == ["default_pg/0//cpu//0/0"], keys  # nothing outside it but the earlier attempt's
