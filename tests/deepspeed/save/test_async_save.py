"""`save_checkpoint(..., async_save=True)` with real DeepSpeed 0.19.8 on CPU (tests/workers/save_glue_worker.py).

The call returns once the state is snapshotted; training steps then change every tensor while the
files are written in the background; the published checkpoint is byte for byte the files
DeepSpeed's own synchronous save wrote for the state at the call, and DeepSpeed resumes from it to
that state, not to the later one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

import dsharness as h
from dsharness import _launch

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).resolve().parents[2] / "workers" / "save_glue_worker.py")
TIMEOUT_S = 300

CONFIGS = {
    "z1-fp32": h.Config(1, "fp32", 2),
    "z2-fp32-wide": h.Config(2, "fp32", 2, model="wide"),
    "z3-bf16": h.Config(3, "bf16", 2),
    "bf16-optimizer": h.Config(1, "bf16", 2, grad_accum_dtype="fp32"),
    "autotp": h.Config(2, "fp32", 2, model="llama", tp_size=2),
    "autoep": h.Config(2, "fp32", 2, model="moe", ep_size=2),
    # ZeRO-Offload: the fp32 partitions and Adam state live in host memory and are stepped there
    "z2-offload": h.Config(2, "fp32", 2, offload=True),
    "z3-offload": h.Config(3, "bf16", 2, offload=True),
}


def _call(function: str, cfg: h.Config, root: Path, **extra) -> dict:
    return {"kind": "call", "module": WORKER, "function": function, "cfg": dataclasses.asdict(cfg),
            "root": str(root), **extra}


@pytest.fixture(scope="session")
def async_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("async_save")
    tasks = [_call("async_equal", cfg, base / name) for name, cfg in CONFIGS.items()]
    for task in tasks:
        os.makedirs(task["root"])
    # a snapshot limit of 0 bytes: every file is written during the call, the rest is as above
    tasks.append(_call("async_equal", h.Config(2, "fp32", 2, model="wide"), base / "limited", snapshot_limit=0))
    tasks.append(_call("async_destroy_joins", h.Config(2, "fp32", 2), base / "destroy"))
    tasks.append(_call("async_fallback", h.Config(2, "fp32", 2), base / "fallback"))
    *results, limited, destroyed, fallback = _launch(2, tasks, None, "async save vs DeepSpeed's save", TIMEOUT_S)
    runs = {name: (base / name, res) for name, res in zip(CONFIGS, results)}
    runs["limited"] = (base / "limited", limited)
    runs["destroy"] = (base / "destroy", destroyed)
    runs["fallback"] = (base / "fallback", fallback)
    return runs


ALL = [*CONFIGS, "limited"]


def test_a_snapshot_limit_bounds_the_memory_held(async_runs):
    assert async_runs["limited"][1]["snapshot_held"] == 0
    assert async_runs["z2-fp32-wide"][1]["snapshot_held"] > 0


def test_offloaded_optimizer_state_is_snapshotted_like_any_host_tensor(async_runs):
    # DeepSpeed took its offload path in those runs only; the parametrized tests below prove their
    # saves published DeepSpeed's own bytes and resumed to the state at the call
    assert {name for name in CONFIGS if async_runs[name][1]["offloaded"]} == {"z2-offload", "z3-offload"}


def test_what_cannot_be_captured_is_saved_synchronously_with_a_warning(async_runs):
    _, res = async_runs["fallback"]
    (message, ), none = res["warned"]
    assert none == [] and "saving t synchronously" in message and "legacy" in message
    assert res["done"] == [True, True] and res["ok"] == [True, True]
    assert res["legacy"] and res["problems"] == []  # DeepSpeed's own legacy-format files, and they resume
    assert sorted(res["listing"]) == ["latest", "t", "zero_to_fp32.py", "zero_to_torch.py"]


def test_the_engines_end_joins_the_save_in_flight(async_runs):
    _, res = async_runs["destroy"]
    assert res["in_flight"] == [True, True]
    assert res["done"] == [True, True] and res["ok"] == [True, True] and res["arena"]
    assert sorted(res["listing"]) == ["latest", "t", "zero_to_fp32.py", "zero_to_torch.py"]


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ALL)
def test_the_call_returns_before_the_write_and_training_goes_on(async_runs, name):
    _, res = async_runs[name]
    assert res["ok"] == [True, True]
    assert res["done_at_return"] == [False, False]
    assert res["done_after_steps"] is False and res["published_early"] is False
    assert res["changed"]  # the steps after the call changed the state


@pytest.mark.parametrize("name", ALL)
def test_the_files_are_deepspeeds_own_byte_for_byte(async_runs, name):
    root, _ = async_runs[name]
    bare, written = _tree(root / "bare" / "t"), _tree(root / "async" / "t")
    extras = set(written) - set(bare)
    assert extras == {"training_state.json"}
    for rel, path in bare.items():
        assert path.read_bytes() == written[rel].read_bytes(), rel
    assert (root / "async" / "latest").read_text() == "t"
    assert sorted(os.listdir(root / "async")) == sorted({"latest", "t", "zero_to_fp32.py", "zero_to_torch.py"})


@pytest.mark.parametrize("name", ALL)
def test_deepspeed_resumes_the_state_at_the_call(async_runs, name):
    root, res = async_runs[name]
    assert res["load_path"].startswith(str(root / "async" / "t") + os.sep)
    assert res["problems"] == []
    assert res["global_steps"] == res["steps_before"] and res["client_note"] == "from the test"


DEEPSPEED_EXTRAS = {"latest", "zero_to_fp32.py", "zero_to_torch.py"}
# (config, the fault on rank 1 during the background write, on_error)
FAULTS = {
    "exception-z3-raise": (h.Config(3, "fp32", 2), "exception", "raise"),
    "fsize-z2-warn": (h.Config(2, "fp32", 2, model="wide"), "fsize", "warn"),
    "fsize-z1-raise": (h.Config(1, "bf16", 2, model="wide"), "fsize", "raise"),
}


@pytest.mark.parametrize("name", FAULTS)
def test_a_background_write_failing_on_one_rank_publishes_nothing(tmp_path, name):
    cfg, fault, on_error = FAULTS[name]
    root = tmp_path / "ckpt"
    (res, ) = _launch(2, [_call("async_fault", cfg, root, fault=fault, on_error=on_error)], None,
                      f"async save fault {name}", TIMEOUT_S)
    assert res["first"] is True and res["returned"] == [True, True]
    # the outcome is known on every rank without a join, and it is a failure on both
    assert res["handle_ok"] == [False, False]
    # nothing of the failed save is visible, latest unchanged, no staging or lock left; keep_last kept `good`
    assert sorted(res["after"]) == sorted(res["before"]) == sorted(DEEPSPEED_EXTRAS | {"good"})
    assert res["latest_after"] == "good"
    if on_error == "raise":
        first, second = res["errors"]
        assert first == second and "rank 1: " in first and "rank 0:" not in first
        assert "Nothing was published (latest still names good)" in first
        if fault == "exception":
            assert "injected failure in the background write" in first
        else:
            assert "File too large" in first
        assert res["warned"] == [[], []]
    else:
        assert res["errors"] == [None, None]
        (message, ), none = res["warned"]
        assert none == [] and "rank 1: " in message and "latest still names good" in message
    # the next save succeeded, and keep_last=1 then removed the older one
    assert res["last"] == [True, True] and res["latest_last"] == "next"
    assert sorted(res["final"]) == sorted(DEEPSPEED_EXTRAS | {"next"})


def test_a_rank_killed_mid_write_leaves_latest_whole_and_the_next_save_cleans(tmp_path):
    cfg = h.Config(2, "fp32", 2, model="wide")
    root, state_dir = tmp_path / "ckpt", tmp_path / "state"
    state_dir.mkdir()
    with pytest.raises(RuntimeError, match="rank 1 exited with -9"):
        _launch(2, [_call("async_killed", cfg, root, state_dir=str(state_dir))], None, "async save killed",
                TIMEOUT_S)
    left = sorted(os.listdir(root))
    assert any(name.startswith(".bad.pyckpt-tmp-") for name in left)  # the killed save's staging folder
    (res, ) = _launch(2, [_call("async_after_kill", cfg, root, state_dir=str(state_dir))], None,
                      "after the killed save", TIMEOUT_S)
    assert res["latest"] == "good"
    assert res["load_path"].startswith(str(root / "good") + os.sep) and res["problems"] == []
    assert res["ok"] == [True, True]
    # the orphan is gone, and keep_last=1 left the new checkpoint alone
    assert sorted(res["final"]) == sorted(DEEPSPEED_EXTRAS | {"next"})
