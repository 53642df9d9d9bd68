"""The native writer's `torch_save` container: the file torch.save writes, byte for byte.

Every case compares against torch.save of the same object: records come from torch's own
serializer (as the asynchronous save takes them), storages are copied into memory sources, and
the executor writes the framing (data descriptors, ZIP64 records, the serialization id).
"""

from __future__ import annotations

import hashlib
import os
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyckpt import _core
from pyckpt.errors import PlanCheckError
from pyckpt.formats.torch_save_file import MemoryRange, TorchSaveFile, archive_name, plan_files
from pyckpt.native import op_table, write_archives


class _Recorder:
    def __init__(self, file, buffers, copy=True):
        self.file, self.buffers, self.copy = file, buffers, copy

    def write_record(self, name, data, nbytes):
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, bytes):
            self.file.add(name, data)
            return
        view = torch.empty(0, dtype=torch.uint8).set_(data)
        self.buffers.append((view.clone() if self.copy else view).numpy())
        self.file.add(name, MemoryRange(len(self.buffers) - 1, 0, nbytes))


def _ours(obj, path, copy=True):
    buffers = []
    file = TorchSaveFile(path)
    torch.serialization._save(obj, _Recorder(file, buffers, copy), pickle, 2, False)
    outputs, rows = plan_files([file])
    write_archives(buffers, outputs, op_table(rows), root=os.path.dirname(path))
    return path


def _same_as_torch(tmp_path, obj, name="x.pt"):
    theirs, ours = tmp_path / "torch" / name, tmp_path / "ours" / name
    theirs.parent.mkdir(exist_ok=True)
    ours.parent.mkdir(exist_ok=True)
    if ours.exists():  # a property test's earlier example
        ours.unlink()
    torch.save(obj, theirs)
    _ours(obj, str(ours))
    a, b = theirs.read_bytes(), ours.read_bytes()
    assert len(a) == len(b) and a == b
    return b


CASES = {
    "mixed": lambda: {"a": torch.arange(10.0), "b": {"c": torch.ones(3, dtype=torch.bfloat16)}, "s": 3},
    "nothing": lambda: {},
    "no tensors": lambda: {"lr": 0.1, "names": ["x", "y"], "step": 7},
    "empty tensors": lambda: {"e": torch.empty(0), "f": torch.empty(0, 3), "g": torch.ones(2)},
    "views and shared storage": lambda: {"v": torch.arange(100)[10:20], "shared": [torch.ones(4)] * 2},
    "one big": lambda: [torch.randn(1000, 1000)],
    "dtypes": lambda: {str(d): torch.ones(5, dtype=d) for d in (torch.float16, torch.int8, torch.int64, torch.bool,
                                                                 torch.float64, torch.uint8)},
    "many records": lambda: {f"p{i}": torch.randn(i % 7) for i in range(700)},
}


@pytest.mark.parametrize("case", CASES)
def test_files_equal_torch_save(tmp_path, case):
    _same_as_torch(tmp_path, CASES[case]())


@pytest.mark.parametrize("name", ["model.pt", "mp_rank_00_model_states.pt", "a.b.c", "noext", "düsseldorf.pt"])
def test_the_archive_folder_is_named_as_torch_names_it(tmp_path, name):
    data = _same_as_torch(tmp_path, {"t": torch.ones(2)}, name)
    assert data[30:30 + len(archive_name(name))].decode() == archive_name(name)


def test_archive_names():
    assert archive_name("/x/y/zero_pp_rank_0_mp_rank_00_optim_states.pt") == "zero_pp_rank_0_mp_rank_00_optim_states"
    assert archive_name("a.b.c") == "a.b" and archive_name("noext") == "noext"
    assert archive_name("/x/é.pt") == "archive"


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 300), max_size=60))
def test_any_record_count_and_sizes(tmp_path, sizes):
    # the serialization id hashes the record names in the standard library's set order, which
    # changes with every growth step of the set: many counts exercise many orders
    obj = {f"k{i}": torch.full((n,), i, dtype=torch.int16) for i, n in enumerate(sizes)}
    _same_as_torch(tmp_path, obj)


def test_a_memory_source_is_read_not_changed(tmp_path):
    # 64 MiB: several executor windows, which for a mapped file would be dropped from memory after use
    t = torch.arange(16 << 20, dtype=torch.int32)
    before = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    _ours({"t": t}, str(tmp_path / "m.pt"), copy=False)
    assert hashlib.sha256(t.numpy().tobytes()).hexdigest() == before
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["t"], t)


def test_ops_past_a_memory_source_are_refused(tmp_path):
    file = TorchSaveFile(str(tmp_path / "x.pt"), [("data.pkl", b"\x80\x02}q\x00."), ("data/0", MemoryRange(0, 8, 16))])
    outputs, rows = plan_files([file])
    with pytest.raises(Exception, match="memory source"):
        write_archives([bytearray(16)], outputs, op_table(rows), root=str(tmp_path))
    assert not (tmp_path / "x.pt").exists()


def test_a_torch_save_file_must_end_with_its_serialization_id(tmp_path):
    out = (str(tmp_path / "x.pt"), "x", [("data.pkl", 1, b"."), ("version", 2, b"3\n")], "torch_save")
    with pytest.raises(PlanCheckError, match="serialization_id"):
        write_archives([], [out], op_table([]), root=str(tmp_path))
    with pytest.raises(ValueError, match="torch_save"):
        _core.write_archives([], [(str(tmp_path / "y.pt"), "y", [], "zip")], op_table([]))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_zip64_members_and_offsets_past_4_gib(tmp_path):
    # a member of more than 4 GiB (ZIP64 sizes), then members whose headers lie past 4 GiB (ZIP64
    # offsets), one of them empty (no data descriptor): each changes the framing torch writes
    big = torch.zeros((4 << 30) + 1000, dtype=torch.uint8)
    big[:10] = 7
    obj = {"a": big, "e": torch.empty(0), "b": torch.ones(5), "c": torch.arange(3)}
    theirs, ours = tmp_path / "torch" / "big.pt", tmp_path / "ours" / "big.pt"
    theirs.parent.mkdir()
    ours.parent.mkdir()

    def digest(path):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(64 << 20):
                h.update(chunk)
        return h.hexdigest(), os.path.getsize(path)

    torch.save(obj, theirs)
    expected = digest(theirs)
    theirs.unlink()  # one 4 GiB file on disk at a time
    _ours(obj, str(ours), copy=False)
    assert digest(ours) == expected
