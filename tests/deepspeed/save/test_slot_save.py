"""A memory save's files written in place (pyckpt.deepspeed.save.slot_save) over the free slot's files
(pyckpt.deepspeed.tiers.free_slot): torch.save's bytes, whole-file CRCs without a read back, the same
inodes save after save, and nothing written through a link."""

import os
import zlib
from types import SimpleNamespace

import pytest
import torch

from pyckpt.deepspeed.save import slot_save
from pyckpt.deepspeed.save.snapshot import CLONE_NAME, CLONE_SITES
from pyckpt.deepspeed.tiers import free_slot
from pyckpt.deepspeed.tiers import node_manifest as nm


class _Inner:
    """DeepSpeed's checkpoint engine as the capture sees it: folders made, files never written by it."""

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path):  # pragma: no cover - the capture must never call it
        raise AssertionError("the inner engine wrote a file")


def _state(seed: int, n: int = 3000):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(4 * n, generator=g)
    return {
        "module": {"w": torch.randn(n, 7, generator=g), "b": torch.arange(n, dtype=torch.int64)},
        "flat_view": flat[n:3 * n],  # a view of a bigger storage: torch.save writes the whole storage
        "bf16": torch.randn(n, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0),
        "step": seed,
        "strided": torch.randn(n, 6, generator=g).t(),  # not contiguous
    }


def _write(tmp, state, name="zero_pp_rank_0_mp_rank_00_optim_states.pt", node=None, clone=None):
    """Captures ``torch.save(state)`` as DeepSpeed's save hands it over, writes it into tmp/staging;
    returns (path, described)."""
    staging = os.path.join(tmp, "staging")
    os.makedirs(staging, exist_ok=True)
    engine = SimpleNamespace(checkpoint_engine=_Inner(), destroy=lambda: None)
    path = os.path.join(staging, name)
    with slot_save.capturing(engine) as (files, sources):
        payload = state
        if clone is not None:  # DeepSpeed's clone before a save, deferred while capturing
            import sys

            payload = getattr(sys.modules[CLONE_SITES[0]], CLONE_NAME)(state)
        engine.checkpoint_engine.save(payload, path)
        described = slot_save.write_slot_files(files, sources, staging, node)
    return path, described


def _torch_save(tmp, state, name):
    ref = os.path.join(tmp, "ref")
    os.makedirs(ref, exist_ok=True)
    torch.save(state, os.path.join(ref, name))
    return open(os.path.join(ref, name), "rb").read()


def test_files_written_in_place_are_torch_saves_bytes_with_their_crc(tmp_path):
    state = _state(1)
    path, described = _write(str(tmp_path), state)
    data = open(path, "rb").read()
    assert data == _torch_save(str(tmp_path), state, os.path.basename(path))
    assert described == [(os.path.basename(path), len(data), zlib.crc32(data))]


def test_deferred_clones_are_written_from_their_originals(tmp_path, monkeypatch):
    import sys
    import types

    # a stand-in for the DeepSpeed module whose clone the capture defers (DeepSpeed's own: a detached clone)
    site = types.ModuleType(CLONE_SITES[0])
    setattr(site, CLONE_NAME, lambda item, device=None: {k: (v.detach().clone() if torch.is_tensor(v) else v)
                                                          for k, v in item.items()})
    monkeypatch.setitem(sys.modules, CLONE_SITES[0], site)
    state = {"dense": torch.randn(500), "view": torch.randn(40)[5:25], "t": torch.randn(30, 4).t(), "n": 3}
    path, described = _write(str(tmp_path), state, clone=True)
    cloned = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    data = open(path, "rb").read()
    assert data == _torch_save(str(tmp_path), cloned, os.path.basename(path))
    assert described[0][2] == zlib.crc32(data)


def test_a_save_writes_over_the_free_slots_file_in_place(tmp_path):
    node = str(tmp_path / "node0")
    share = os.path.join(node, "s1")
    os.makedirs(share)
    first = _state(1, 5000)
    torch.save(first, os.path.join(share, "f.pt"))
    open(os.path.join(share, nm.NAME), "w").write("{}")
    inode = os.stat(os.path.join(share, "f.pt")).st_ino
    free_slot.retire(node, share)
    assert not os.path.exists(share) and sorted(os.listdir(free_slot.path(node))) == ["f.pt"]
    # a smaller state, then a bigger one, over the same file
    for seed, n in ((2, 1000), (3, 9000)):
        staging = os.path.join(str(tmp_path), "staging")
        state = _state(seed, n)
        path, described = _write(str(tmp_path), state, name="f.pt", node=node)
        data = open(path, "rb").read()
        assert os.stat(path).st_ino == inode
        assert data == _torch_save(str(tmp_path), state, "f.pt") and described[0][2] == zlib.crc32(data)
        os.rename(path, os.path.join(free_slot.path(node), "f.pt"))  # back into the slot for the next round
        os.rmdir(staging)
    free_slot.discard(node)
    assert not os.path.lexists(free_slot.path(node))


def test_a_linked_file_in_the_slot_is_left_where_it_is_and_a_new_file_written(tmp_path):
    node = str(tmp_path / "node0")
    slot = free_slot.path(node)
    os.makedirs(slot)
    torch.save(_state(1, 100), os.path.join(slot, "f.pt"))
    os.link(os.path.join(slot, "f.pt"), str(tmp_path / "restore-link.pt"))  # a recovery's assembly links it
    os.symlink(str(tmp_path / "elsewhere.pt"), os.path.join(slot, "g.pt"))
    before = open(tmp_path / "restore-link.pt", "rb").read()
    for name in ("f.pt", "g.pt"):
        path, _ = _write(str(tmp_path), _state(2, 100), name=name, node=node)
        assert os.stat(path).st_nlink == 1 and not os.path.islink(path)
    assert open(tmp_path / "restore-link.pt", "rb").read() == before
    assert not os.path.exists(tmp_path / "elsewhere.pt")


def test_the_native_writer_refuses_to_write_over_a_link(tmp_path):
    from pyckpt.formats.torch_save_file import plan_files
    from pyckpt.native import op_table, write_archives
    from pyckpt.deepspeed.save.snapshot import SnapshotArena, snapshot_file

    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    out = tmp_path / "out"
    out.mkdir()
    arena = SnapshotArena()
    arena.begin()
    for make in (lambda p: os.symlink(str(target), p), lambda p: os.link(str(target), p)):
        path = str(out / "x.pt")
        make(path)
        f = snapshot_file(_state(1, 10), path, arena)
        outputs, rows = plan_files([f])
        with pytest.raises(OSError):
            write_archives(arena.sources(), outputs, op_table(rows), root=str(out), reuse_outputs=True)
        assert target.read_bytes() == b"keep"
        os.unlink(path)


def test_shares_leave_oldest_first_never_the_newest_and_at_most_max_keep_2_remain():
    def found(*steps):
        return [(f"/n/s{s}", SimpleNamespace(step=s)) for s in steps]

    assert free_slot.oldest_to_retire(found(), 1) == []
    assert free_slot.oldest_to_retire(found(1), 1) == []  # keep=1: the slot is the pruned one, after the save
    assert free_slot.oldest_to_retire(found(2, 1), 2) == ["/n/s1"]
    assert free_slot.oldest_to_retire(found(1), 2) == []
    assert free_slot.oldest_to_retire(found(3, 1, 2), 2) == ["/n/s1", "/n/s2"]
    assert free_slot.oldest_to_retire(found(1, 2, 3), 3) == ["/n/s1"]
    assert free_slot.oldest_to_retire(found(1, 2), 2, protect="s1") == []


def test_a_retired_share_is_no_share_and_a_second_one_is_removed(tmp_path):
    node = str(tmp_path / "node0")
    for tag in ("s1", "s2"):
        os.makedirs(os.path.join(node, tag))
        open(os.path.join(node, tag, "f.pt"), "wb").write(tag.encode())
        open(os.path.join(node, tag, nm.NAME), "w").write("{}")
    free_slot.retire(node, os.path.join(node, "s1"))
    free_slot.retire(node, os.path.join(node, "s2"))
    assert sorted(os.listdir(node)) == [free_slot.NAME]
    assert sorted(os.listdir(free_slot.path(node))) == ["f.pt"]
    assert open(os.path.join(free_slot.path(node), "f.pt"), "rb").read() == b"s1"
    assert nm.shares(node) == [] and free_slot.size(node) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_storages_are_copied_through_pinned_memory_into_torch_saves_bytes(tmp_path):
    state = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in _state(5).items()}
    path, described = _write(str(tmp_path), state)
    data = open(path, "rb").read()
    assert data == _torch_save(str(tmp_path), state, os.path.basename(path))
    assert described[0][2] == zlib.crc32(data)


def test_a_file_rewritten_save_after_save_is_copied_through_one_kept_mapping(tmp_path):
    """Files of 1 MiB or more written over in place go through a writable mapping the writer keeps from
    one save to the next (one mapping per file, however many saves); the bytes and CRCs stay torch.save's,
    at a new size too, and the mapping of a file that was removed goes at the next save."""
    from pyckpt import _core

    _core.release_output_maps()
    node = str(tmp_path / "node0")
    os.makedirs(free_slot.path(node))
    inode = None
    for seed, n in ((1, 60000), (2, 60000), (3, 60000), (4, 90000)):
        state = _state(seed, n)
        path, described = _write(str(tmp_path), state, name="f.pt", node=node)
        data = open(path, "rb").read()
        assert len(data) >= 1 << 20
        assert data == _torch_save(str(tmp_path), state, "f.pt") and described[0][2] == zlib.crc32(data)
        inode = inode or os.stat(path).st_ino
        assert os.stat(path).st_ino == inode
        # the first save creates the file (written, not mapped); every later one writes over it
        assert _core.output_maps_info() == ({"count": 0, "bytes": 0} if seed == 1 else {"count": 1, "bytes": len(data)})
        os.rename(path, os.path.join(free_slot.path(node), "f.pt"))
        os.rmdir(os.path.join(str(tmp_path), "staging"))
    free_slot.discard(node)  # the file is gone: its pages are held only by the mapping, until the next save
    _write(str(tmp_path), _state(5, 100), name="g.pt", node=node)
    assert _core.output_maps_info()["count"] == 0
    _core.release_output_maps()


def test_a_file_truncated_under_the_saves_mapping_is_reported_not_a_sigbus(tmp_path):
    """Another process truncating a memory-tier file while a save copies into its kept mapping: the copy
    completes into throwaway pages and the writer reports the file as shrunk (write_archives then fails
    naming it) instead of the training process dying of SIGBUS."""
    from native_hooks import hooks

    from pyckpt import _core

    path = tmp_path / "f.pt"
    path.write_bytes(bytes(4 << 20))
    assert hooks().write_past_a_shrunk_output_map(str(path)) is True
    assert path.stat().st_size == 2 << 20 and path.read_bytes() == bytes(2 << 20)
    assert _core.output_maps_info()["count"] == 0  # the broken mapping is not kept


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_slot_made_ahead_is_allocated_and_mapped_and_the_next_save_writes_over_it(tmp_path):
    """Before the tier holds two checkpoints no share leaves it, so the next save would allocate new pages in
    the call: the slot is made ahead from the layout just published (allocated, and mapped for the files this
    process writes), and the save then copies into that file through the kept mapping, torch.save's bytes."""
    from pyckpt import _core

    _core.release_output_maps()
    node = str(tmp_path / "node0")
    os.makedirs(node)
    state = _state(1, 60000)
    first, described = _write(str(tmp_path), state, name="f.pt", node=node)
    size = described[0][1]
    assert size >= 1 << 20
    seen = []
    assert free_slot.prepare_ahead(node, [("f.pt", size), ("other.pt", 3 << 20), ("sub/x.pt", 5)],
                                   lambda n: seen.append(n), mine={"f.pt"})
    free_slot.settle(node)
    slot = free_slot.path(node)
    assert seen == [size + (3 << 20)]  # the budget asked for what the slot holds; a nested name is not made
    assert sorted(os.listdir(slot)) == ["f.pt", "other.pt"] and oct(os.stat(slot).st_mode & 0o777) == "0o700"
    assert os.path.getsize(os.path.join(slot, "f.pt")) == size and _allocated(os.path.join(slot, "f.pt")) >= size
    assert _allocated(os.path.join(slot, "other.pt")) >= 3 << 20
    assert _core.output_maps_info() == {"count": 1, "bytes": size}  # only the file this process writes
    inode = os.stat(os.path.join(slot, "f.pt")).st_ino
    os.rename(os.path.dirname(first), str(tmp_path / "published"))
    state = _state(2, 60000)
    path, described = _write(str(tmp_path), state, name="f.pt", node=node)
    data = open(path, "rb").read()
    assert os.stat(path).st_ino == inode and data == _torch_save(str(tmp_path), state, "f.pt")
    assert described[0][2] == zlib.crc32(data)
    assert _core.output_maps_info() == {"count": 1, "bytes": size}  # the mapping made ahead, not a new one
    _core.release_output_maps()


def test_no_slot_is_made_ahead_where_one_is_there_or_it_does_not_fit(tmp_path):
    node = str(tmp_path / "node0")
    os.makedirs(free_slot.path(node))
    assert not free_slot.prepare_ahead(node, [("f.pt", 10)], lambda n: None)  # the one there is the next save's
    assert os.listdir(free_slot.path(node)) == []
    os.rmdir(free_slot.path(node))
    assert free_slot.prepare_ahead(node, [("f.pt", 10)], lambda n: "it does not fit")
    free_slot.settle()
    assert os.listdir(node) == []
    assert not free_slot.prepare_ahead(node, [("a/f.pt", 10)], lambda n: None)


def test_a_slot_made_ahead_never_writes_through_a_link_nor_over_an_entry(tmp_path):
    from pyckpt import _core

    target = tmp_path / "target"
    target.write_bytes(b"keep")
    folder = tmp_path / "slot"
    folder.mkdir()
    os.symlink(target, folder / "link.pt")
    (folder / "there.pt").write_bytes(b"x")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ("link.pt", "there.pt"):
            with pytest.raises(FileExistsError):
                _core.prepare_output_map(fd, name, 1 << 20, str(folder / name))
        for name in ("../escape.pt", "..", ".", "", "a\0b"):
            with pytest.raises(ValueError):
                _core.prepare_output_map(fd, name, 10, str(folder / "x"))
    finally:
        os.close(fd)
    assert target.read_bytes() == b"keep" and (folder / "there.pt").read_bytes() == b"x"
    assert sorted(os.listdir(tmp_path)) == ["slot", "target"]


def test_a_slot_that_cannot_be_allocated_is_removed_and_the_save_goes_on(tmp_path):
    """A full memory root (here: the file size limit) while the slot is made: what was made is removed."""
    import subprocess
    import sys
    import textwrap

    node = tmp_path / "node0"
    node.mkdir()
    code = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from pyckpt.deepspeed.tiers import free_slot
        assert free_slot.prepare_ahead({str(node)!r}, [("a.pt", 1 << 10), ("b.pt", 4 << 20)], lambda n: None)
        free_slot.settle()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "could not make a free slot" in proc.stderr and "removed" in proc.stderr
    assert os.listdir(node) == []


def test_the_kept_mappings_hold_at_most_a_quarter_of_the_descriptor_limit(tmp_path):
    """Each kept mapping holds a descriptor: under `ulimit -n 64` a process that prepares and maps 40 files
    keeps at most 16, the rest made and touched all the same, and no descriptor runs out."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from pyckpt import native, _core
        fd = os.open({str(tmp_path)!r}, os.O_RDONLY | os.O_DIRECTORY)
        for i in range(40):
            native.prepare_output_map(fd, f"f{{i}}.pt", 1 << 20, f"f{{i}}.pt", True)
        info = _core.output_maps_info()
        assert info["count"] == 16, info
        for i in range(8):  # and the process still opens files
            os.close(os.open(os.path.join({str(tmp_path)!r}, f"f{{i}}.pt"), os.O_RDONLY))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(f"f{i}.pt" for i in range(40))
    assert all(os.path.getsize(tmp_path / f"f{i}.pt") == 1 << 20 for i in range(40))


def test_the_files_the_next_save_writes_over_are_mapped_ahead_and_the_save_copies_through_that_mapping(tmp_path):
    """A file the writer created (a job's first saves) has no kept mapping; once the share it is in is the one
    the next save retires, its writer maps it in the background, and that save copies into it through the mapping
    made then: the same inode, torch.save's bytes, no mapping set up in the call."""
    from pyckpt import _core

    _core.release_output_maps()
    node = str(tmp_path / "node0")
    os.makedirs(node)
    first, described = _write(str(tmp_path), _state(1, 60000), name="f.pt", node=node)
    size = described[0][1]
    assert _core.output_maps_info()["count"] == 0  # created, not written over: not mapped
    share = str(tmp_path / "s1")
    os.rename(os.path.dirname(first), share)
    # the files this process writes; one the share lacks is skipped, a nested name is not this thread's
    assert free_slot.map_ahead(share, [("f.pt", size), ("absent.pt", 2 << 20), ("sub/f.pt", 2 << 20)])
    free_slot.settle()
    assert _core.output_maps_info() == {"count": 1, "bytes": size}
    inode = os.stat(os.path.join(share, "f.pt")).st_ino
    free_slot.retire(node, share)  # the next save's retirement: same inodes under the slot's name
    state = _state(2, 60000)
    path, described = _write(str(tmp_path), state, name="f.pt", node=node)
    data = open(path, "rb").read()
    assert os.stat(path).st_ino == inode and data == _torch_save(str(tmp_path), state, "f.pt")
    assert described[0][2] == zlib.crc32(data)
    assert _core.output_maps_info() == {"count": 1, "bytes": size}  # the mapping made ahead
    assert not free_slot.map_ahead(share, [("a/b.pt", 10)])
    _core.release_output_maps()


def test_mapping_ahead_maps_only_a_regular_file_of_its_size_never_through_a_link(tmp_path):
    from pyckpt import _core

    _core.release_output_maps()
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"o" * (2 << 20))
    folder = tmp_path / "share"
    folder.mkdir()
    (folder / "f.pt").write_bytes(b"f" * (2 << 20))
    (folder / "small.pt").write_bytes(b"s" * 10)
    os.symlink(outside, folder / "link.pt")
    os.mkfifo(folder / "fifo.pt")
    (folder / "dir.pt").mkdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        refused = {name: _core.map_output(fd, name, 2 << 20, str(folder / name))
                   for name in ("link.pt", "fifo.pt", "dir.pt", "absent.pt")}
        assert refused == dict.fromkeys(refused, False)  # a FIFO neither blocks nor is mapped
        assert not _core.map_output(fd, "f.pt", 1 << 20, str(folder / "f.pt"))  # another size than the save's
        assert not _core.map_output(fd, "small.pt", 10, str(folder / "small.pt"))  # below the mapping threshold
        assert _core.output_maps_info()["count"] == 0
        for name in ("../outside.pt", "..", ".", "", "a\0b"):
            with pytest.raises(ValueError):
                _core.map_output(fd, name, 2 << 20, str(folder / "x"))
        assert _core.map_output(fd, "f.pt", 2 << 20, str(folder / "f.pt"))
        assert _core.output_maps_info() == {"count": 1, "bytes": 2 << 20}
    finally:
        os.close(fd)
        _core.release_output_maps()
    assert outside.read_bytes() == b"o" * (2 << 20) and (folder / "f.pt").read_bytes() == b"f" * (2 << 20)


def test_a_slot_is_made_and_files_mapped_ahead_only_when_no_core_is_otherwise_wanted():
    """The background work runs under Linux's SCHED_IDLE, set for its own thread: the training thread keeps its
    policy."""
    import threading

    before = os.sched_getscheduler(0)
    seen = []
    thread = threading.Thread(target=lambda: (free_slot._yield_to_training(), seen.append(os.sched_getscheduler(0))))
    thread.start()
    thread.join()
    assert seen == [os.SCHED_IDLE] and os.sched_getscheduler(0) == before


def test_the_next_save_writes_over_the_slot_else_the_oldest_share_it_retires():
    node = "/n"
    shares = [(f"/n/s{i}", SimpleNamespace(step=i)) for i in (3, 1, 2)]
    assert free_slot.next_retired(node, shares[:2], keep=2) == "/n/s1"  # two held, keep 2: the oldest goes
    assert free_slot.next_retired(node, shares[:1], keep=2) is None  # one held: none goes, a slot is made ahead
    assert free_slot.next_retired(node, shares, keep=3) == "/n/s1"
    assert free_slot.next_retired(node, shares[:2], keep=3) is None


def test_the_slot_is_what_the_next_save_writes_over_where_there_is_one(tmp_path):
    node = str(tmp_path)
    os.makedirs(free_slot.path(node))
    assert free_slot.next_retired(node, [(str(tmp_path / "s1"), SimpleNamespace(step=1))], keep=1) == free_slot.path(node)


@pytest.mark.parametrize("name", ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt",
                                  "no_extension", "ünïcode.pt"])
def test_the_layout_of_a_save_gives_the_size_of_the_file_torch_save_writes(tmp_path, name):
    """save_layout's stand-in pickles each file as torch.save does and sizes it (storages referenced, no data
    copied): the size is the file torch.save writes, whatever the records, the archive name and the storages."""
    from pyckpt.deepspeed.save.save_layout import LayoutCheckpointEngine
    from pyckpt.deepspeed.save.snapshot import DeferredClones

    files = []
    stand_in = LayoutCheckpointEngine(_Inner(), files, DeferredClones())
    for seed, n in ((1, 10), (2, 3000), (3, 70000)):
        state = _state(seed, n)
        stand_in.save(state, str(tmp_path / "never" / name))
        ref = _torch_save(str(tmp_path), state, name)
        assert files[-1] == (str(tmp_path / "never" / name), len(ref))
    assert stand_in.makedirs(str(tmp_path / "never")) is None and not (tmp_path / "never").exists()
    assert stand_in.failure is None


def test_a_layout_failure_is_kept_not_raised_and_later_files_are_skipped(tmp_path):
    """Every rank must still reach DeepSpeed's next collective: a file that cannot be pickled is recorded."""
    from pyckpt.deepspeed.save.save_layout import LayoutCheckpointEngine
    from pyckpt.deepspeed.save.snapshot import DeferredClones

    files = []
    stand_in = LayoutCheckpointEngine(_Inner(), files, DeferredClones())
    stand_in.save({"f": lambda: None}, str(tmp_path / "a.pt"))
    stand_in.save(_state(1, 10), str(tmp_path / "b.pt"))
    assert files == [] and stand_in.failure.startswith(f"laying out {tmp_path / 'a.pt'}: ")


def test_a_rank_makes_its_own_files_in_the_slot_and_removes_only_those_when_it_cannot(tmp_path):
    """Before a first save each rank makes its own files in the slot its node's leader made (allocated and
    mapped by it); a file that cannot be allocated takes back only what this rank made."""
    import subprocess
    import sys
    import textwrap

    from pyckpt import _core

    _core.release_output_maps()
    node = tmp_path / "node0"
    slot = node / free_slot.NAME
    slot.mkdir(parents=True)
    (slot / "other_rank.pt").write_bytes(b"theirs")
    assert free_slot.make_own(str(slot), [("mine.pt", 2 << 20), ("nested/x.pt", 5)])
    free_slot.settle()
    assert sorted(os.listdir(slot)) == ["mine.pt", "other_rank.pt"]
    assert os.path.getsize(slot / "mine.pt") == 2 << 20 and _allocated(str(slot / "mine.pt")) >= 2 << 20
    assert _core.output_maps_info() == {"count": 1, "bytes": 2 << 20}
    _core.release_output_maps()
    os.unlink(slot / "mine.pt")
    code = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from pyckpt.deepspeed.tiers import free_slot
        assert free_slot.make_own({str(slot)!r}, [("a.pt", 1 << 10), ("b.pt", 4 << 20)])
        free_slot.settle()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "could not make this rank's files" in proc.stderr and "removed" in proc.stderr
    assert os.listdir(slot) == ["other_rank.pt"] and (slot / "other_rank.pt").read_bytes() == b"theirs"


def test_the_next_slot_becomes_the_free_slot_only_where_there_is_none(tmp_path):
    node = tmp_path / "node0"
    node.mkdir()
    assert not free_slot.promote_next(str(node))  # none to promote
    spare = node / ".pyckpt-slot-next"
    spare.mkdir()
    (spare / "f.pt").write_bytes(b"x")
    (node / free_slot.NAME).mkdir()
    assert not free_slot.promote_next(str(node))  # the free slot is still there: the next one waits
    os.rmdir(node / free_slot.NAME)
    assert free_slot.promote_next(str(node)) and os.listdir(node) == [free_slot.NAME]
    assert (node / free_slot.NAME / "f.pt").read_bytes() == b"x"
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, spare)
    os.rename(node / free_slot.NAME, tmp_path / "gone")
    assert not free_slot.promote_next(str(node))  # a link in its place is never taken for a slot
    free_slot.discard_next(str(node))
    assert os.listdir(node) == [] and target.is_dir()


def test_a_slot_that_is_a_link_is_never_mapped_nor_filled_through(tmp_path):
    """Before a first save the leader readies what is there: a link named like the slot (or the next one) is no
    slot, so nothing is mapped through it and nothing is made where it points."""
    from types import SimpleNamespace

    from pyckpt.deepspeed.save import tier_preparation

    node = tmp_path / "node0"
    node.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.pt").write_bytes(b"keep")
    os.symlink(outside, node / free_slot.NAME)
    os.symlink(outside, node / ".pyckpt-slot-next")
    tier = SimpleNamespace(keep=2, root_path=str(tmp_path), job_name="j", limit_bytes=None)
    kind, folders = tier_preparation._ready_node(str(node), [("f.pt", 4)], None, None, "m", tier)
    assert (kind, folders) == ("mapped", [])
    assert sorted(os.listdir(outside)) == ["f.pt"] and (outside / "f.pt").read_bytes() == b"keep"
