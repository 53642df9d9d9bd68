"""The save glue's parts without a training run: arrival, orphan cleaning, the preflight decision,
the guarded writes, the training-state file (tests/deepspeed/save/test_save_glue.py runs the whole with DeepSpeed)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist

from pyckpt.deepspeed.save import CollectiveCallError
from pyckpt.deepspeed.save.arrival import Arrival
from pyckpt.deepspeed.save.preflight import _preflight_problem
from pyckpt.execution.leftovers import clean_orphans
from pyckpt.execution.leftovers import orphans as _orphans
from pyckpt.deepspeed.save.companions import _plain, training_state
from pyckpt.deepspeed.save.guarded_io import WriteFailures, guarded


def test_arrival_passes_when_every_rank_came_and_can_be_used_again():
    store = dist.HashStore()
    other = Arrival("save/x", 1, 2, store)
    store.set(other._key(1), b"1")  # rank 1 arrived
    mine = Arrival("save/x", 0, 2, store)
    mine.wait(5, "the call")
    mine.done()
    other.done()
    assert mine.missing() == [0, 1]


def test_arrival_names_the_ranks_that_did_not_come():
    store = dist.HashStore()
    store.set("pyckpt/arrival/save/x/2", b"1")
    with pytest.raises(CollectiveCallError) as err:
        Arrival("save/x", 0, 4, store).wait(0.2, "pyckpt.deepspeed.save_checkpoint")
    assert "called on rank(s) 0, 2 and not on rank(s) 1, 3" in str(err.value)
    assert "pyckpt.deepspeed.save_checkpoint is collective" in str(err.value)
    # this rank's arrival was withdrawn, so a later round under the same name starts clean
    assert not store.check(["pyckpt/arrival/save/x/0"])


class _ThreadRanks:
    """Ranks as threads of this process: what save_checkpoint asks of its process group (rank, size,
    all_gather, broadcast), each rank's view kept per thread."""

    def __init__(self, size: int):
        self.size = size
        self._local = threading.local()
        self._slots = [None] * size
        self._barrier = threading.Barrier(size, timeout=30)

    @property
    def rank(self) -> int:
        return self._local.rank

    def all_gather(self, value):
        self._slots[self.rank] = value
        self._barrier.wait()
        gathered = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return gathered

    def broadcast(self, value):
        return self.all_gather(value)[0]


def _save_on_threads(monkeypatch, save_dir, tags: dict, size: int = 2, arrival_timeout: float = 2.0) -> dict:
    """save_checkpoint called by the ranks in ``tags`` (rank -> tag) of ``size``, each on a thread, with
    an engine DeepSpeed never sees (the call must stop before saving); rank -> what it raised."""
    from pyckpt.deepspeed.save import collective_save, save_checkpoint

    ranks = _ThreadRanks(size)
    store = dist.HashStore()
    monkeypatch.setattr(collective_save, "_process_group", lambda: ranks)
    monkeypatch.setattr("pyckpt.deepspeed.save.arrival._default_store", lambda: store)
    raised = {}

    def call(rank: int, tag: str) -> None:
        ranks._local.rank = rank
        engine = types.SimpleNamespace(checkpoint_engine=_FailingCheckpointEngine(),
                                       use_node_local_storage=lambda: False)
        try:
            save_checkpoint(engine, save_dir, tag=tag, arrival_timeout=arrival_timeout)
        except Exception as exc:
            raised[rank] = exc

    threads = [threading.Thread(target=call, args=item) for item in tags.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return raised


def test_ranks_naming_different_tags_are_told_so_not_reported_absent(tmp_path, monkeypatch):
    from pyckpt.deepspeed.save import SaveError

    raised = _save_on_threads(monkeypatch, tmp_path / "ck", {0: "a", 1: "b"})
    assert sorted(raised) == [0, 1]
    for exc in raised.values():
        assert isinstance(exc, SaveError), exc
        assert str(exc).startswith(f"the ranks name different checkpoints (a, b in {tmp_path / 'ck'}); ")
        assert "nothing was written" in str(exc)
    assert os.listdir(tmp_path / "ck") == []


def test_a_save_called_on_some_ranks_only_is_still_named_so(tmp_path, monkeypatch):
    raised = _save_on_threads(monkeypatch, tmp_path / "ck", {1: "a"}, size=3, arrival_timeout=0.5)
    assert isinstance(raised[1], CollectiveCallError), raised
    assert "called on rank(s) 1 and not on rank(s) 0, 2" in str(raised[1])
    assert not (tmp_path / "ck").exists()


def _make(path: str, folder: bool = True) -> None:
    if folder:
        os.makedirs(os.path.join(path, "sub"))
    else:
        open(path, "w").close()


def test_orphans_of_every_tag_are_removed_unless_a_live_run_holds_their_lock(tmp_path):
    _make(tmp_path / ".global_step2.pyckpt-tmp-host-1-ab")
    _make(tmp_path / ".global_step3.pyckpt-tmp-my.host-2-cd")
    _make(str(tmp_path / ".latest.pyckpt-ptr-host-3-ef"), folder=False)
    _make(tmp_path / ".busy.pyckpt-tmp-host-4-aa")
    _make(str(tmp_path / ".global_step4.pyckpt-lock"), folder=False)  # a save killed before its staging
    _make(tmp_path / "global_step1")
    _make(tmp_path / ".hidden_of_someone_else")
    assert _orphans(str(tmp_path)) == ["busy", "global_step2", "global_step3", "global_step4", "latest"]
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(tmp_path / '.busy.pyckpt-lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        removed = clean_orphans(str(tmp_path))
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert sorted(removed) == [".global_step2.pyckpt-tmp-host-1-ab", ".global_step3.pyckpt-tmp-my.host-2-cd",
                               ".latest.pyckpt-ptr-host-3-ef"]
    # the lock files of the cleaned tags went with them (global_step4's too); the live run keeps its own
    assert sorted(os.listdir(tmp_path)) == [".busy.pyckpt-lock", ".busy.pyckpt-tmp-host-4-aa",
                                            ".hidden_of_someone_else", "global_step1"]


SHAPE = {"async_save": False, "keep_last": None, "universal": False, "export": None, "snapshot_limit": None,
         "on_error": "raise", "exclude_frozen_parameters": False}


def _pre(**changes):
    base = [{"tag": "t", "dir": "/ck", "need": 100, "free": 10_000, "error": None, "staging": ".t.pyckpt-tmp-x",
             "shape": dict(SHAPE)},
            {"tag": "t", "dir": "/ck", "need": 300, "free": 10_000, "error": None, "staging": None,
             "shape": dict(SHAPE)}]
    for rank, fields in changes.items():
        base[int(rank[1:])].update(fields)
    return base


def test_preflight_agrees_or_says_why_not():
    assert _preflight_problem(_pre(), "/ck", "t") is None
    assert "the ranks name different checkpoints (s, t in /ck)" in _preflight_problem(_pre(r1={"tag": "s"}), "/ck", "t")
    problem = _preflight_problem(_pre(r0={"error": "preparing /ck: PermissionError: no"}), "/ck", "t")
    assert problem == "could not start saving t in /ck: rank 0: preparing /ck: PermissionError: no; nothing was written"
    problem = _preflight_problem(_pre(r1={"need": 20_000, "free": 5_000}), "/ck", "t")
    assert problem == ("not enough free space for checkpoint t in /ck: it needs about 19.6 KiB (2 ranks, the most "
                       "19.5 KiB on rank 1) and 4.9 KiB is free; nothing was written")


@pytest.mark.parametrize("key,mine,theirs", [("async_save", False, True), ("keep_last", None, 2),
                                             ("universal", False, True), ("export", None, "hf"),
                                             ("snapshot_limit", None, 0), ("on_error", "raise", "warn"),
                                             ("exclude_frozen_parameters", False, True)])
def test_preflight_refuses_ranks_that_pass_different_save_arguments(key, mine, theirs):
    """Ranks that differ in an argument that decides the save's collectives would part ways (one in an
    all_gather the other never makes): refused by the preflight, naming the argument and who passed what."""
    pre = _pre(r0={"shape": {**SHAPE, key: mine}}, r1={"shape": {**SHAPE, key: theirs}})
    problem = _preflight_problem(pre, "/ck", "t")
    assert problem == (f"the ranks pass different {key} to save_checkpoint ({mine!r} on rank(s) 0; {theirs!r} on "
                       "rank(s) 1); every argument that shapes the save must be the same on every rank; checkpoint t "
                       "was not saved, nothing was written")


class _Engine(types.SimpleNamespace):
    def _copy_recovery_script(self, save_path):
        raise OSError(28, "No space left on device")


class _FailingCheckpointEngine:
    def __init__(self):
        self.saved = []

    def save(self, state_dict, path):
        self.saved.append(path)
        raise OSError(27, "File too large")

    def makedirs(self, path, exist_ok=False):
        pass

    def is_decoupled(self):
        return False


def test_a_failed_write_is_recorded_and_the_rest_skipped_then_the_engine_is_restored():
    inner = _FailingCheckpointEngine()
    engine = _Engine(checkpoint_engine=inner)
    failures = WriteFailures()
    with guarded(engine, failures):
        assert engine.checkpoint_engine.is_decoupled() is False  # everything else passes through
        engine.checkpoint_engine.makedirs("/ck/t", exist_ok=True)
        engine.checkpoint_engine.save({}, "/ck/t/a.pt")
        engine.checkpoint_engine.save({}, "/ck/t/b.pt")
        engine._copy_recovery_script("/ck")
    assert failures.messages == ["writing /ck/t/a.pt: OSError: [Errno 27] File too large"]
    assert inner.saved == ["/ck/t/a.pt"]
    assert engine.checkpoint_engine is inner
    with pytest.raises(OSError):  # the engine's own method again
        engine._copy_recovery_script("/ck")


def test_the_training_state_is_plain_json():
    scheduler = types.SimpleNamespace(state_dict=lambda: {"last_batch_iteration": 4, "warmup": torch.tensor(0.5),
                                                          "big": torch.zeros(100), "fn": len, "inf": float("inf")})
    engine = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(param_groups=[{"lr": 1e-3}, {"lr": torch.tensor(2e-3)}]),
        lr_scheduler=scheduler, global_steps=5, global_samples=40, skipped_steps=1, num_stages=1,
        zero_optimization_stage=lambda: 2, dp_world_size=4, mp_world_size=1)
    state = json.loads(json.dumps(training_state(engine, "global_step5", 4)))
    assert state["global_steps"] == 5 and state["global_samples"] == 40 and state["skipped_steps"] == 1
    assert state["learning_rates"] == [1e-3, pytest.approx(2e-3)]
    assert state["lr_scheduler"]["last_batch_iteration"] == 4 and state["lr_scheduler"]["big"] == "tensor(100,)"
    assert state["lr_scheduler"]["inf"] == "inf" and state["lr_scheduler"]["fn"].startswith("<built-in")
    assert state["world"] == {"world_size": 4, "data_parallel": 4, "model_parallel": 1, "pipeline_parallel": 1}
    assert state["versions"]["torch"] == torch.__version__
    assert state["versions"]["pyckpt"] == importlib.metadata.version("pyckpt")
    assert _plain({1: (2, 3)}) == {"1": [2, 3]}


def test_setups_the_glue_cannot_publish_whole_are_refused_before_anything_runs(tmp_path):
    from pyckpt.deepspeed.save import save_checkpoint

    decoupled = types.SimpleNamespace(is_decoupled=lambda: True)
    engine = types.SimpleNamespace(checkpoint_engine=decoupled, use_node_local_storage=lambda: False)
    with pytest.raises(ValueError, match="writes after the call returns"):
        save_checkpoint(engine, tmp_path)
    engine = types.SimpleNamespace(checkpoint_engine=_FailingCheckpointEngine(), use_node_local_storage=lambda: True)
    with pytest.raises(ValueError, match="use_node_local_storage is not supported"):
        save_checkpoint(engine, tmp_path)
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'warn'"):
        save_checkpoint(engine, tmp_path, on_error="ignore")
    with pytest.raises(ValueError, match="export must be None or 'hf'"):
        save_checkpoint(engine, tmp_path, export="gguf")
    engine = types.SimpleNamespace(checkpoint_engine=_FailingCheckpointEngine(), use_node_local_storage=lambda: False)
    for tag in (".hidden", "a/b", ".."):
        with pytest.raises(ValueError, match="must be one folder name not starting with '.'"):
            save_checkpoint(engine, tmp_path, tag=tag)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tag", [" t", "t ", "t\n", "\tt", "t\u00a0", "global_step1\x1b[2J", "a\nb"])
def test_a_tag_latest_could_not_name_back_is_refused_before_anything_runs(tag, tmp_path):
    # DeepSpeed strips what it reads from `latest`: saved under such a tag, the checkpoint would not load
    from pyckpt.deepspeed.save import save_checkpoint

    engine = types.SimpleNamespace(checkpoint_engine=_FailingCheckpointEngine(), use_node_local_storage=lambda: False)
    with pytest.raises(ValueError) as err:
        save_checkpoint(engine, tmp_path, tag=tag)
    assert str(err.value).startswith(f"checkpoint tag {tag!r} ")
    assert "no whitespace at either end and no control characters" in str(err.value)
    assert os.listdir(tmp_path) == []
