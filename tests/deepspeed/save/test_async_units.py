"""Units of the asynchronous save: the snapshot arena, what cannot be captured,
the handle's life cycle. The DeepSpeed runs are in tests/deepspeed/save/test_async_save.py."""

from __future__ import annotations

import logging
import os
import time
import types
from collections import OrderedDict

import pytest
import torch

from pyckpt.deepspeed.save import AsyncSave, SaveError
from pyckpt.deepspeed.save.snapshot import SnapshotArena, capture_problem, snapshot_file


def test_the_arena_reuses_its_memory_from_one_save_to_the_next():
    arena = SnapshotArena(chunk_bytes=1 << 20)
    arena.begin()
    first = [arena.take(n)[:2] for n in (1000, 300_000, 900_000, 2 << 20)]
    held = arena.held
    ptrs = [c.data_ptr() for c in arena.chunks]
    arena.begin()
    second = [arena.take(n)[:2] for n in (1000, 300_000, 900_000, 2 << 20)]
    assert second == first and arena.held == held and [c.data_ptr() for c in arena.chunks] == ptrs
    assert all(off % 64 == 0 for _, off in first)
    # what this save filled, chunk by chunk: every copy lies inside it
    assert arena.used <= sum(arena.extents) <= arena.held and len(arena.extents) == len(arena.chunks)
    for index, offset in second:
        assert offset < arena.extents[index]
    # a bigger state grows the arena where it must, and keeps working
    arena.begin()
    arena.take(3 << 20)
    assert arena.held >= held


def test_a_snapshot_is_the_state_at_the_call(tmp_path):
    from pyckpt.deepspeed.save.background import write_files

    arena = SnapshotArena(chunk_bytes=1 << 20)
    arena.begin()
    state = {"w": torch.arange(1000.0), "step": 3}
    file = snapshot_file(state, str(tmp_path / "s.pt"), arena)
    expected = state["w"].clone()
    state["w"].add_(1)  # training goes on
    write_files([file], arena.sources(), str(tmp_path), fsync=False)
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(loaded["w"], expected) and loaded["step"] == 3


def test_what_cannot_be_captured_is_named():
    class TorchCheckpointEngine:
        zipfile_serialization = True

    assert capture_problem(TorchCheckpointEngine()) is None
    legacy = TorchCheckpointEngine()
    legacy.zipfile_serialization = False
    assert "legacy" in capture_problem(legacy)
    assert "DecoupledCheckpointEngine" in capture_problem(type("DecoupledCheckpointEngine", (), {})())
    nvme = types.SimpleNamespace(zero_offload_optimizer=lambda: types.SimpleNamespace(device="nvme"),
                                 zero_offload_param=lambda: None)
    assert "offloaded to NVMe" in capture_problem(TorchCheckpointEngine(), nvme)
    cpu = types.SimpleNamespace(zero_offload_optimizer=lambda: types.SimpleNamespace(device="cpu"),
                                zero_offload_param=lambda: None)
    assert capture_problem(TorchCheckpointEngine(), cpu) is None  # host tensors are snapshotted like any other
    torch.serialization.set_crc32_options(False)
    try:
        assert "crc32" in capture_problem(TorchCheckpointEngine())
    finally:
        torch.serialization.set_crc32_options(True)


def test_a_failed_background_save_is_reported_once_as_asked(caplog):
    def failing(h):
        time.sleep(0.05)
        return False, "checkpoint t was not saved: rank 1: disk full"

    raising = AsyncSave("checkpoint t", "raise", 0).start(failing)
    assert not raising.done()
    with pytest.raises(SaveError, match="disk full"):
        raising.wait()
    assert raising.wait() is False  # reported once
    warning = AsyncSave("checkpoint t", "warn", 0).start(failing)
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        assert warning.wait() is False
    assert "disk full" in caplog.text
    crashed = AsyncSave("checkpoint t", "warn", 0).start(lambda h: 1 / 0)
    assert crashed.wait() is False and "ZeroDivisionError" in crashed.message
    assert AsyncSave("checkpoint t", "raise", 0).start(lambda h: (True, None)).wait() is True


def test_files_past_the_snapshot_limit_are_written_during_the_call(tmp_path):
    from pyckpt.deepspeed.save.snapshot import CaptureCheckpointEngine

    written = []
    inner = types.SimpleNamespace(save=lambda state, path: (torch.save(state, path), written.append(path)))
    arena = SnapshotArena(chunk_bytes=1 << 16)
    arena.begin()
    files = []
    capture = CaptureCheckpointEngine(inner, arena, files, limit=100_000)
    small, big = {"w": torch.ones(1000)}, {"w": torch.ones(100_000)}
    for name, state in (("a.pt", small), ("b.pt", big), ("c.pt", small)):
        capture.save(state, str(tmp_path / name))
    assert [os.path.basename(f.path) for f in files] == ["a.pt", "c.pt"]
    assert written == [str(tmp_path / "b.pt")] == capture.written_now
    assert arena.held <= 100_000


OBJECTS = {
    "optimizer-like": lambda: {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5)}},
                               "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.999)}]},
    "shared and views": lambda: (lambda t: {"a": t, "b": t[2:], "c": [t.view(2, 5)] * 2})(torch.arange(10.0)),
    "storages": lambda: {"typed": torch.arange(4).storage(), "untyped": torch.ones(3).untyped_storage()},
    "dtypes": lambda: [torch.ones(3, dtype=d) for d in (torch.bfloat16, torch.int8, torch.bool, torch.float64)],
    "empty and scalars": lambda: {"e": torch.empty(0), "s": torch.tensor(1), "n": None, "x": 1.5, "k": "0"},
    "many": lambda: {f"p{i}": torch.randn(i % 5) for i in range(150)},
}


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.parametrize("name", OBJECTS)
def test_a_snapshot_writes_the_file_torch_save_writes(tmp_path, name):
    from pyckpt.deepspeed.save.background import write_files

    obj = OBJECTS[name]()
    torch.save(obj, tmp_path / "torch.pt")
    (tmp_path / "ours").mkdir()
    arena = SnapshotArena(chunk_bytes=1 << 20)
    arena.begin()
    file = snapshot_file(obj, str(tmp_path / "ours" / "torch.pt"), arena)
    write_files([file], arena.sources(), str(tmp_path / "ours"), fsync=False)
    assert (tmp_path / "ours" / "torch.pt").read_bytes() == (tmp_path / "torch.pt").read_bytes()


def test_a_storage_seen_as_two_dtypes_is_refused_as_torch_refuses_it(tmp_path):
    t = torch.arange(4, dtype=torch.int32)
    obj = [t, t.view(torch.float32)]
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save(obj, tmp_path / "x.pt")
    arena = SnapshotArena(chunk_bytes=1 << 20)
    arena.begin()
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        snapshot_file(obj, str(tmp_path / "y.pt"), arena)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_snapshot_copies_on_a_side_stream_and_holds_the_next_kernel(tmp_path):
    from pyckpt.deepspeed.save.background import write_files
    from pyckpt.deepspeed.save.snapshot import DeviceCopies

    state = {"w": torch.arange(1 << 22, dtype=torch.float32, device="cuda"), "step": 3}
    expected = state["w"].cpu()
    torch.save(state, tmp_path / "torch.pt")
    (tmp_path / "ours").mkdir()
    arena = SnapshotArena()
    arena.begin()
    copies = DeviceCopies()
    file = snapshot_file(state, str(tmp_path / "ours" / "torch.pt"), arena, copies)
    assert arena.chunks[0].is_pinned() and copies.events
    state["w"].add_(1)  # the "optimizer step": ordered after the copy by the stream wait
    copies.wait()
    write_files([file], arena.sources(), str(tmp_path / "ours"), fsync=False)
    assert (tmp_path / "ours" / "torch.pt").read_bytes() == (tmp_path / "torch.pt").read_bytes()
    assert torch.equal(torch.load(tmp_path / "ours" / "torch.pt", weights_only=True)["w"].cpu(), expected)


def _clone_cases():
    flat = torch.randn(64)
    param = torch.nn.Parameter(torch.randn(4, 6))
    return {
        "views of a flat buffer": {"a": flat[:16].view(4, 4), "b": flat[16:40], "c": flat[40:]},
        "transposed and strided": {"t": torch.randn(5, 3).t(), "s": torch.arange(20.0)[::2]},
        "parameters and nesting": {"module": OrderedDict(w=param, b=torch.zeros(6, dtype=torch.bfloat16)),
                                   "groups": [(flat[:3], 1.5), [torch.tensor(2)]], "step": 7},
        "shared tensor twice": (lambda t: {"x": t, "y": [t, t[1:]]})(torch.arange(6)),
        "empty": {"e": torch.empty(0, 4), "f": torch.ones(1)},
    }


@pytest.mark.parametrize("name", list(_clone_cases()))
def test_a_deferred_clone_snapshot_equals_deepspeeds_clone_then_torch_save(tmp_path, name):
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    from pyckpt.deepspeed.save.background import write_files
    from pyckpt.deepspeed.save.snapshot import DeferredClones

    state = _clone_cases()[name]
    torch.save(clone_tensors_for_torch_save(state), tmp_path / "deepspeed.pt")
    clones = DeferredClones()
    arena = SnapshotArena(chunk_bytes=1 << 20)
    arena.begin()
    (tmp_path / "ours").mkdir()
    file = snapshot_file(clones.clone(state), str(tmp_path / "ours" / "deepspeed.pt"), arena, clones=clones)
    write_files([file], arena.sources(), str(tmp_path / "ours"), fsync=False)
    assert (tmp_path / "ours" / "deepspeed.pt").read_bytes() == (tmp_path / "deepspeed.pt").read_bytes()


@pytest.mark.parametrize("name", list(_clone_cases()))
def test_the_trainers_clones_are_filled_from_the_snapshot_of_the_same_weights(tmp_path, name):
    """The Trainer's model clone (accelerate calls DeepSpeed's clone_tensors_for_torch_save) made while a save
    records is unfilled until DeepSpeed's save has snapshotted the weights, then filled from that snapshot: the
    same tensors as DeepSpeed's clones, each in a storage of its own; the arena waits for that fill before
    the next save reuses it."""
    import threading

    import deepspeed.checkpoint.utils as ds_utils

    from pyckpt.deepspeed.save.shared_copies import SharedCopies, recording

    state = _clone_cases()[name]
    expected = ds_utils.clone_tensors_for_torch_save(state)
    torch.save(expected, tmp_path / "deepspeed.pt")
    original = ds_utils.clone_tensors_for_torch_save
    copies = SharedCopies()
    arena = SnapshotArena(chunk_bytes=1 << 20)
    arena.begin()
    with recording(copies):
        trainers = ds_utils.clone_tensors_for_torch_save(state)  # as accelerate's get_state_dict calls it
        snapshot_file(state, str(tmp_path / "model_states.pt"), arena)  # DeepSpeed's model states: the storages
    assert ds_utils.clone_tensors_for_torch_save is original
    tensors = [t for t in _tensors(trainers) if t.numel()]
    assert all(copies.is_stand_in(t) for t in tensors) and not copies.is_stand_in(torch.ones(2))
    fill = copies.resolve()
    assert (fill is not None) == bool(tensors)
    if fill is not None:
        # training may change the weights now: the fill reads the snapshot, not them
        for t in _tensors(state):
            t.data.add_(1)
        begun = threading.Event()
        waiter = threading.Thread(target=lambda: (arena.begin(), begun.set()))
        waiter.start()
        assert not begun.wait(0.2)  # the next save waits for the fill
        fill()
        waiter.join(5)
        assert begun.is_set()
    (tmp_path / "ours").mkdir()
    torch.save(trainers, tmp_path / "ours" / "deepspeed.pt")
    assert (tmp_path / "ours" / "deepspeed.pt").read_bytes() == (tmp_path / "deepspeed.pt").read_bytes()
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    assert len(set(storages)) == len(storages)  # private storages, as DeepSpeed's clones


def _tensors(value) -> list:
    stack, out = [value], []
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return out


def test_clones_are_deferred_only_inside_the_block():
    import deepspeed.runtime.engine as ds_engine

    from pyckpt.deepspeed.save.snapshot import DeferredClones, deferring_clones

    original = ds_engine.clone_tensors_for_torch_save
    clones = DeferredClones()
    with deferring_clones(clones):
        assert ds_engine.clone_tensors_for_torch_save == clones.clone
        stand_in = ds_engine.clone_tensors_for_torch_save({"w": torch.ones(3)})["w"]
        assert stand_in.shape == (3,) and clones.sources
        clones.materialize()
        assert torch.equal(stand_in, torch.ones(3))
    assert ds_engine.clone_tensors_for_torch_save is original and not clones.sources


def test_a_background_agreement_waits_without_holding_the_process_store_client():
    """A save's background thread waiting for other ranks' keys must leave the process's one store
    client free: the main thread's next save arrives through it (and the other ranks' rounds may wait
    for that arrival). A blocking store.wait there held the client for the whole wait, and the main
    thread's set stalled behind it (a deadlock between two nodes' leaders, seen in
    tests/deepspeed/tiers/test_memory_nodes.py)."""
    import datetime
    import threading

    import torch.distributed as dist

    from pyckpt.deepspeed.save.background import StoreAgreement

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    waiting = StoreAgreement(client, "t", 0, 1, 10.0)
    done = []
    thread = threading.Thread(target=lambda: done.append(waiting.result()))
    thread.start()
    time.sleep(0.2)  # the background thread is waiting for a result nobody has announced yet
    t0 = time.monotonic()
    client.set("arrival/0", "1")  # the main thread's arrival, on the same client
    assert client.get("arrival/0") == b"1"
    took = time.monotonic() - t0
    server.set("pyckpt/async/t/result", '[true, null]')
    thread.join(10)
    assert done == [(True, None)] and took < 2.0, took
