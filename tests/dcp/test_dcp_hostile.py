"""Hostile DCP folders: each defect is one PyckptError naming the file at fault, and
``pyckpt.export_hf`` writes nothing (the output absent, no staging leftovers beside it, the input's
bytes unchanged). The folders are real ones saved by torch's dcp.save (test_dcp_read.py's helpers),
damaged by re-pickling their metadata with torch's own classes or by patching bytes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata, MetadataIndex, TensorProperties)

import pyckpt  # noqa: E402
from pyckpt.dcp.read import read_dcp  # noqa: E402
from pyckpt.errors import (  # noqa: E402
    CheckpointFormatError, PyckptError, UnsafePickleError, UnsupportedCheckpointError)
from pyckpt.formats.pickle_read import loads  # noqa: E402
from test_dcp_read import (  # noqa: E402
    chunk_grid, read_metadata, sample, save_chunked, write_metadata, write_sharded_safetensors)

SHAPE = (7, 5)
ROWS = chunk_grid(SHAPE, {0: [3, 6]})  # FSDP2's row shards over three ranks: 3, 3 and 1 rows


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A DCP folder of one data file: model.w in the three row chunks, model.b whole, a step value."""
    folder = tmp_path_factory.mktemp("hostile_base") / "ck"
    return save_chunked(folder, {"model.w": (sample(torch.float32, SHAPE, seed=1), ROWS)},
                        extra={"model": {"b": torch.ones(3)}, "step": 9})


@pytest.fixture
def ck(base, tmp_path) -> Path:
    """A copy of ``base`` to damage."""
    return Path(shutil.copytree(base, tmp_path / "in" / "ck"))


@pytest.fixture
def st(tmp_path) -> Path:
    """The safetensors-backed layout: model rows over two files."""
    full = sample(torch.float32, (6, 4), seed=2)
    return write_sharded_safetensors(tmp_path / "in" / "st", {
        "shard-00001-model-00001-of-00002.safetensors": {"w": (full[:4], (0, 0)), "b": (torch.ones(2), (0,))},
        "shard-00002-model-00002-of-00002.safetensors": {"w": (full[4:], (4, 0))},
    })


def _snapshot(folder: Path) -> dict:
    """Every entry of ``folder``: a regular file's bytes, a link's target, else its kind (a FIFO is not opened)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = folder / name
        if path.is_symlink():
            out[name] = ("link", os.readlink(path))
        elif path.is_file():
            out[name] = path.read_bytes()
        else:
            out[name] = ("other", os.lstat(path).st_mode)
    return out


def refused(folder: Path, tmp_path: Path, names, error=PyckptError) -> PyckptError:
    """Exporting ``folder`` fails with ``error``, one line naming ``names`` (a path), and writes nothing."""
    before = _snapshot(folder)
    parent = tmp_path / "outs"
    parent.mkdir(exist_ok=True)
    out = parent / "hf"
    with pytest.raises(error) as caught:
        pyckpt.export_hf(folder, out)
    message = str(caught.value)
    assert isinstance(caught.value, PyckptError)
    assert "\n" not in message
    assert str(names) in message, message
    assert not out.exists() and os.listdir(parent) == [], os.listdir(parent)
    assert _snapshot(folder) == before
    return caught.value


def _meta(folder: Path) -> str:
    return str(folder / ".metadata")


def _chunk_index(md, key: str, i: int):
    """The storage key of chunk ``i`` of ``key`` (as the metadata lists the chunks)."""
    chunk = md.state_dict_metadata[key].chunks[i]
    return next(k for k in md.storage_data if k.fqn == key and tuple(k.offset) == tuple(chunk.offsets))


def _set_chunks(md, key: str, layout) -> None:
    """Chunk ``i`` of ``key`` becomes ``layout[i]`` = (offsets, sizes), keeping its storage record."""
    infos = [md.storage_data.pop(_chunk_index(md, key, i)) for i in range(len(md.state_dict_metadata[key].chunks))]
    md.state_dict_metadata[key].chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                                          for o, s in layout]
    for i, ((offsets, _), info) in enumerate(zip(layout, infos)):
        md.storage_data[MetadataIndex(key, torch.Size(offsets), i)] = info


def _data_file(folder: Path) -> Path:
    (name,) = [n for n in os.listdir(folder) if n.endswith(".distcp")]
    return folder / name


def _append_record(folder: Path, md, index, archive: bytes) -> None:
    """``archive`` appended to the data file, the record of ``index`` pointed at it."""
    info = md.storage_data[index]
    path = folder / info.relative_path
    info.offset = path.stat().st_size
    info.length = len(archive)
    with open(path, "ab") as f:
        f.write(archive)


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rezip(archive: bytes, members: dict) -> bytes:
    """``archive`` written again (stored, members in order) with ``members`` = {name suffix: new bytes}."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            for suffix, new in members.items():
                if info.filename.endswith(suffix):
                    data = new
            dst.writestr(info.filename, data)
    return out.getvalue()


# ------------------------------------------------------------------------------------ the metadata pickle

class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_metadata_naming_os_system_runs_nothing(ck, tmp_path):
    marker = tmp_path / "ran"
    md = read_metadata(ck)
    md.planner_data["model.b"] = _RunsCommand(f"touch {marker}")
    write_metadata(ck, md)
    refused(ck, tmp_path, _meta(ck), UnsafePickleError)
    with pytest.raises(UnsafePickleError, match="os.system|posix.system"):
        read_dcp(ck)
    assert not marker.exists()


def test_metadata_class_off_the_allowlist(ck, tmp_path):
    from collections import Counter

    md = read_metadata(ck)
    md.storage_meta = Counter(modules=1)
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), UnsafePickleError)
    assert "collections.Counter" in str(error)


def test_metadata_of_another_kind(ck, tmp_path):
    (ck / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    refused(ck, tmp_path, _meta(ck), CheckpointFormatError)


def test_storage_data_keys_hash_apart(ck):
    """storage_data is a dict keyed by MetadataIndex records: had they hashed alike (as every other allowlisted
    record does, by class), building it would compare every key with every other, minutes at 100,000 chunks
    (or a crafted file's worth). Counted, not timed: the parsed keys' hashes are (nearly) all distinct, and a
    key compares equal only to itself."""
    md = read_metadata(ck)
    info = md.storage_data[_chunk_index(md, "model.w", 0)]
    n = 100_000
    for i in range(n):
        md.storage_data[MetadataIndex("many", torch.Size([i]), i)] = info
    parsed = loads(pickle.dumps(md), where="big")
    keys = list(parsed._state["storage_data"])
    assert len(keys) == len(md.storage_data)
    assert len({hash(k) for k in keys}) > 0.999 * len(keys)
    assert keys[0] == keys[0] and keys[0] != keys[1]


# ------------------------------------------------------------------------------------ records and data files

def test_truncated_data_file(ck, tmp_path):
    path = _data_file(ck)
    os.truncate(path, path.stat().st_size - 700)
    error = refused(ck, tmp_path, path, CheckpointFormatError)
    assert "past the end" in str(error)


def test_record_past_the_end_of_its_file(ck, tmp_path):
    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 1)].length += _data_file(ck).stat().st_size
    write_metadata(ck, md)
    refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)


def test_record_cut_short_holds_no_archive(ck, tmp_path):
    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 0)].length -= 100
    write_metadata(ck, md)
    refused(ck, tmp_path, _data_file(ck))


def _tie(md, alias: str, holder: str, dtype=None) -> None:
    """``alias`` a second entry whose chunks are ``holder``'s records (a tied tensor saved once, as pyckpt's DCP
    export writes one); ``dtype`` claims another dtype for it."""
    import copy

    entry = copy.deepcopy(md.state_dict_metadata[holder])
    if dtype is not None:
        entry.properties = TensorProperties(dtype=dtype)
    md.state_dict_metadata[alias] = entry
    md.planner_data[alias] = ("model", alias.split(".", 1)[1])
    for i, chunk in enumerate(entry.chunks):
        md.storage_data[MetadataIndex(alias, chunk.offsets, i)] = md.storage_data[_chunk_index(md, holder, i)]


def test_one_record_under_two_entries_is_a_tied_tensor(ck):
    from test_dcp_read import gathered

    md = read_metadata(ck)
    _tie(md, "model.w_tied", "model.w")
    write_metadata(ck, md)
    got = read_dcp(ck)
    assert gathered(got, "model.w_tied") == gathered(got, "model.w")


def test_one_record_under_two_entries_of_other_dtypes(ck, tmp_path):
    md = read_metadata(ck)
    _tie(md, "model.w_tied", "model.w", dtype=torch.float16)
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)
    assert "model.w_tied" in str(error)


def test_records_overlapping(ck, tmp_path):
    md = read_metadata(ck)
    first, second = (md.storage_data[_chunk_index(md, "model.w", i)] for i in (0, 1))
    second.offset = first.offset + 64
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)
    assert "overlap" in str(error)


def test_two_chunks_on_the_same_record(ck, tmp_path):
    md = read_metadata(ck)
    first = md.storage_data[_chunk_index(md, "model.w", 0)]
    md.storage_data[_chunk_index(md, "model.w", 1)] = first
    write_metadata(ck, md)
    refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "", ".metadata", "sub/__0_0.distcp", "a\0b"])
def test_relative_path_outside_the_folder(ck, tmp_path, name):
    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 2)].relative_path = name
    write_metadata(ck, md)
    refused(ck, tmp_path, _meta(ck), CheckpointFormatError)


def test_relative_path_to_a_link_leading_outside(ck, tmp_path):
    outside = tmp_path / "outside.distcp"
    shutil.copyfile(_data_file(ck), outside)  # the very bytes the record expects
    os.symlink(outside, ck / "__9_0.distcp")
    md = read_metadata(ck)
    for i in range(3):
        md.storage_data[_chunk_index(md, "model.w", i)].relative_path = "__9_0.distcp"
    write_metadata(ck, md)
    refused(ck, tmp_path, ck / "__9_0.distcp", CheckpointFormatError)


def test_relative_path_to_a_link_inside_is_read(ck, tmp_path):
    os.symlink(_data_file(ck).name, ck / "__9_0.distcp")
    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 0)].relative_path = "__9_0.distcp"
    write_metadata(ck, md)
    pyckpt.export_hf(ck, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_relative_path_to_a_fifo(ck, tmp_path):
    os.mkfifo(ck / "__9_0.distcp")
    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 1)].relative_path = "__9_0.distcp"
    write_metadata(ck, md)
    error = refused(ck, tmp_path, ck / "__9_0.distcp", CheckpointFormatError)
    assert "regular file" in str(error)


def test_missing_data_file(ck, tmp_path):
    path = _data_file(ck)
    path.unlink()
    error = refused(ck, tmp_path, path, CheckpointFormatError)
    assert "missing" in str(error)


def test_transform_descriptors(ck, tmp_path):
    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 0)].transform_descriptors = ["zstd"]
    write_metadata(ck, md)
    refused(ck, tmp_path, _meta(ck), UnsupportedCheckpointError)


def test_index_naming_no_entry(ck, tmp_path):
    md = read_metadata(ck)
    md.storage_data[MetadataIndex("ghost", torch.Size([0]))] = md.storage_data.pop(_chunk_index(md, "model.w", 2))
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), CheckpointFormatError)
    assert "'ghost'" in str(error)


def test_index_at_offsets_no_chunk_has(ck, tmp_path):
    md = read_metadata(ck)
    md.storage_data[MetadataIndex("model.w", torch.Size([1, 0]))] = md.storage_data.pop(_chunk_index(md, "model.w", 1))
    write_metadata(ck, md)
    refused(ck, tmp_path, _meta(ck), CheckpointFormatError)


def test_chunk_without_a_record(ck, tmp_path):
    md = read_metadata(ck)
    del md.storage_data[_chunk_index(md, "model.w", 1)]
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), CheckpointFormatError)
    assert "no storage record" in str(error)


def test_value_without_a_record(ck, tmp_path):
    md = read_metadata(ck)
    del md.storage_data[next(k for k in md.storage_data if k.fqn == "step")]
    write_metadata(ck, md)
    refused(ck, tmp_path, _meta(ck), CheckpointFormatError)


# ------------------------------------------------------------------------------------ chunks

def test_chunk_outside_its_tensor(ck, tmp_path):
    md = read_metadata(ck)
    _set_chunks(md, "model.w", [((0, 0), (3, 5)), ((3, 0), (3, 5)), ((6, 1), (1, 5))])
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), CheckpointFormatError)
    assert "outside" in str(error)


def test_chunks_overlapping(ck, tmp_path):
    # the volumes add up (15 + 15 + 5 = 35) but rows 2 and 6 are covered twice and once not at all
    md = read_metadata(ck)
    _set_chunks(md, "model.w", [((0, 0), (3, 5)), ((2, 0), (3, 5)), ((6, 0), (1, 5))])
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), CheckpointFormatError)
    assert "overlap" in str(error)


def test_chunks_leaving_a_gap(ck, tmp_path):
    md = read_metadata(ck)
    _set_chunks(md, "model.w", [((0, 0), (3, 5)), ((4, 0), (3, 5))] + [((6, 0), (0, 5))])
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), CheckpointFormatError)
    assert "do not tile" in str(error)


def test_chunk_dimensions_differ_from_the_tensor(ck, tmp_path):
    md = read_metadata(ck)
    _set_chunks(md, "model.w", [((0,), (15,)), ((3, 0), (3, 5)), ((6, 0), (1, 5))])
    write_metadata(ck, md)
    refused(ck, tmp_path, _meta(ck), CheckpointFormatError)


def test_chunk_archive_of_the_wrong_shape(ck, tmp_path):
    # chunks that tile the tensor, but not the ones the records hold (1 + 5 + 1 rows against 3 + 3 + 1)
    md = read_metadata(ck)
    _set_chunks(md, "model.w", [((0, 0), (1, 5)), ((1, 0), (5, 5)), ((6, 0), (1, 5))])
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)
    assert "float32[1, 5]" in str(error) and "float32[3, 5]" in str(error)


def test_chunk_archive_of_the_wrong_dtype(ck, tmp_path):
    md = read_metadata(ck)
    _append_record(ck, md, _chunk_index(md, "model.w", 1), _saved(torch.zeros(3, 5, dtype=torch.float64)))
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)
    assert "float64" in str(error)


def test_entry_of_another_dtype_than_its_chunks(ck, tmp_path):
    md = read_metadata(ck)
    md.state_dict_metadata["model.w"].properties = TensorProperties(dtype=torch.bfloat16)
    write_metadata(ck, md)
    refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)


def test_chunk_archive_holding_no_tensor(ck, tmp_path):
    md = read_metadata(ck)
    _append_record(ck, md, _chunk_index(md, "model.w", 0), _saved({"not": "a tensor"}))
    write_metadata(ck, md)
    refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)


def test_storage_member_smaller_than_its_tensor(ck, tmp_path):
    md = read_metadata(ck)
    archive = _rezip(_saved(torch.zeros(3, 5)), {"/data/0": bytes(40)})  # 40 of its 60 bytes
    _append_record(ck, md, _chunk_index(md, "model.w", 0), archive)
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)
    assert "fewer than" in str(error) or "data/0" in str(error)


def test_storage_member_missing(ck, tmp_path):
    md = read_metadata(ck)
    good = _saved(torch.zeros(3, 5))
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("/data/0"):
                dst.writestr(info.filename, src.read(info.filename))
    _append_record(ck, md, _chunk_index(md, "model.w", 2), out.getvalue())
    write_metadata(ck, md)
    refused(ck, tmp_path, _data_file(ck), CheckpointFormatError)


def test_record_of_garbage(ck, tmp_path):
    md = read_metadata(ck)
    _append_record(ck, md, _chunk_index(md, "model.w", 1), os.urandom(1577))
    write_metadata(ck, md)
    refused(ck, tmp_path, _data_file(ck))


def test_value_holding_code_is_refused(ck):
    md = read_metadata(ck)
    index = next(k for k in md.storage_data if k.fqn == "step")
    _append_record(ck, md, index, _saved(_RunsCommand("true")))
    write_metadata(ck, md)
    checkpoint = read_dcp(ck)
    with pytest.raises(UnsafePickleError, match=str(_data_file(ck))):
        checkpoint.value("step")


# ------------------------------------------------------------------------------------ safetensors-backed layout

def _edit_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _first(st: Path) -> Path:
    return st / "shard-00001-model-00001-of-00002.safetensors"


def test_safetensors_layout_reads(st, tmp_path):
    pyckpt.export_hf(st, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_safetensors_data_offsets_past_the_end(st, tmp_path):
    _edit_header(_first(st), lambda h: h["b"].update(data_offsets=[72, 80]))  # the file's data is 72 bytes
    refused(st, tmp_path, _first(st), CheckpointFormatError)


def test_safetensors_shape_and_bytes_disagree(st, tmp_path):
    _edit_header(_first(st), lambda h: h["w"].update(shape=[5, 4]))
    refused(st, tmp_path, _first(st), CheckpointFormatError)


def test_safetensors_tensors_overlapping(st, tmp_path):
    def edit(h):
        h["b"]["data_offsets"] = [0, 8]  # the first 8 bytes of w
    _edit_header(_first(st), edit)
    error = refused(st, tmp_path, _first(st), CheckpointFormatError)
    assert "overlap" in str(error)


def test_safetensors_without_sharding_info(st, tmp_path):
    second = st / "shard-00002-model-00002-of-00002.safetensors"
    _edit_header(second, lambda h: h["__metadata__"].pop("DCP_SHARDING_INFO"))
    error = refused(st, tmp_path, second, CheckpointFormatError)
    assert "DCP_SHARDING_INFO" in str(error)


def test_safetensors_saved_offsets_missing_for_a_tensor(st, tmp_path):
    def edit(h):
        info = json.loads(h["__metadata__"]["DCP_SHARDING_INFO"])
        del info["b"]
        h["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    _edit_header(_first(st), edit)
    refused(st, tmp_path, _first(st), CheckpointFormatError)


def test_safetensors_chunks_overlapping_across_files(st, tmp_path):
    second = st / "shard-00002-model-00002-of-00002.safetensors"

    def edit(h):
        h["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps({"w": {"saved_offsets": [3, 0]}})
    _edit_header(second, edit)
    refused(st, tmp_path, st, CheckpointFormatError)


def test_safetensors_dtype_differs_across_files(st, tmp_path):
    second = st / "shard-00002-model-00002-of-00002.safetensors"

    def edit(h):
        h["w"].update(dtype="I32")  # same bytes per element, another dtype
    _edit_header(second, edit)
    refused(st, tmp_path, second, CheckpointFormatError)


def test_safetensors_header_longer_than_the_file(st, tmp_path):
    raw = _first(st).read_bytes()
    _first(st).write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    refused(st, tmp_path, _first(st), CheckpointFormatError)


# ------------------------------------------------------------------------------------ pyckpt verify DCP_DIR

def _verify(capsys, folder) -> tuple:
    from pyckpt import cli

    before = _snapshot(folder)
    code = cli.main(["verify", str(folder)])
    out, err = capsys.readouterr()
    assert _snapshot(folder) == before
    return code, out.splitlines()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_verify_finds_each_corrupt_chunk(ck, capsys):
    checkpoint = read_dcp(ck)
    for key in ("model.w", "model.b"):
        _flip(_data_file(ck), checkpoint.tensor(key).pieces[-1].src_off + 1)
    code, lines = _verify(capsys, ck)
    assert code == 1
    assert lines[-1] == "FAILED: 2 problems"
    for line in lines[:-1]:
        assert line.startswith(f"{_data_file(ck)}: the archive at bytes [") and "fails its CRC-32 check" in line


def test_verify_finds_a_corrupt_value_pickle(ck, capsys):
    checkpoint = read_dcp(ck)
    record = checkpoint.objects["step"].record
    from pyckpt import _core

    with _core.Archive(str(_data_file(ck)), offset=record.offset, length=record.length) as archive:
        (offset,) = [off for name, off, _, _ in archive.members() if name.endswith("/data.pkl")]
    _flip(_data_file(ck), offset + 2)  # inside the pickle's bytes
    code, lines = _verify(capsys, ck)
    assert code == 1 and any("data.pkl fails its CRC-32 check" in line for line in lines), lines


def test_verify_reports_an_archive_cut_short(ck, capsys):
    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 0)].length -= 100
    write_metadata(ck, md)
    code, lines = _verify(capsys, ck)
    assert code == 1 and lines[0].startswith(f"{_data_file(ck)}: the archive at bytes [")
    assert "cannot be read" in lines[0]


def test_verify_reports_a_chunk_of_the_wrong_dtype(ck, capsys):
    md = read_metadata(ck)
    _append_record(ck, md, _chunk_index(md, "model.w", 1), _saved(torch.zeros(3, 5, dtype=torch.float64)))
    write_metadata(ck, md)
    code, lines = _verify(capsys, ck)
    assert code == 1 and lines[0].startswith(str(_data_file(ck))) and "float64" in lines[0]


def test_verify_reports_a_value_naming_code(ck, tmp_path, capsys):
    marker = tmp_path / "ran"
    md = read_metadata(ck)
    _append_record(ck, md, next(k for k in md.storage_data if k.fqn == "step"), _saved(_RunsCommand(f"touch {marker}")))
    write_metadata(ck, md)
    code, lines = _verify(capsys, ck)
    assert code == 1 and lines[0].startswith(str(_data_file(ck))) and "refusing to load global" in lines[0]
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["past_the_end", "overlap", "metadata_code"])
def test_verify_reports_a_broken_metadata_as_one_problem(ck, tmp_path, capsys, damage):
    md = read_metadata(ck)
    if damage == "past_the_end":
        md.storage_data[_chunk_index(md, "model.w", 1)].length += 10 ** 6
    elif damage == "overlap":
        _set_chunks(md, "model.w", [((0, 0), (3, 5)), ((2, 0), (3, 5)), ((6, 0), (1, 5))])
    else:
        md.planner_data["step"] = _RunsCommand(f"touch {tmp_path / 'ran'}")
    write_metadata(ck, md)
    code, lines = _verify(capsys, ck)
    assert code == 1 and lines[-1] == "FAILED: 1 problem"
    named = _data_file(ck) if damage == "past_the_end" else ck / ".metadata"
    assert lines[0].startswith(f"{named}: "), lines
    assert not (tmp_path / "ran").exists()


def test_verify_reports_a_lying_safetensors_header(st, capsys):
    _edit_header(_first(st), lambda h: h["b"].update(data_offsets=[72, 80]))
    code, lines = _verify(capsys, st)
    assert code == 1 and lines[0].startswith(f"{_first(st)}: ") and "past the end" in lines[0]


# ------------------------------------------------------------------------------------ pyckpt convert DCP OUT

def _adam_folder(folder: Path, **group) -> Path:
    """get_state_dict's layout of a torch Adam job, saved by dcp.save: two parameters with their state and one
    param group holding ``group`` beside the usual values (each a DCP value entry of its own)."""
    from test_dcp_read import save

    w, b = sample(torch.float32, (4, 3), seed=3), torch.ones(3)
    state = {n: {"step": torch.tensor(2.0), "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
             for n, t in (("w", w), ("b", b))}
    values = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, **group, "params": ["w", "b"]}
    return save({"model": {"w": w, "b": b}, "optim": {"state": state, "param_groups": [values]}}, folder)


def _convert(capsys, folder: Path, out: Path) -> tuple:
    from pyckpt import cli

    code = cli.main(["convert", str(folder), str(out)])
    _, err = capsys.readouterr()
    return code, err.strip().splitlines()


def test_convert_writes_plain_param_groups_that_load_with_weights_only(tmp_path, capsys):
    """The good case beside the refusals below: plain values reach DeepSpeed's optimizer_state.pt, which
    torch.load(weights_only=True) then reads whole."""
    folder = _adam_folder(tmp_path / "in", name="decay", tags=[1, "x", None, 2.5])
    out = tmp_path / "u" / "step2_universal"
    out.parent.mkdir()
    code, lines = _convert(capsys, folder, out)
    assert code == 0, lines
    saved = torch.load(out / "zero" / "optimizer_state.pt", weights_only=True)
    (group, ) = saved["param_groups"]
    assert group["lr"] == 0.01 and tuple(group["betas"]) == (0.9, 0.99)
    assert group["name"] == "decay" and group["tags"] == [1, "x", None, 2.5]


NOT_PLAIN = {
    "namespace": (lambda: __import__("argparse").Namespace(lr=0.1), "a argparse.Namespace"),
    "path": (lambda: Path("/tmp/lr"), "a pathlib.PosixPath"),
    "dtype": (lambda: torch.float32, "a torch.float32"),
    "nested": (lambda: [0.1, (Path("/x"), )], "a pathlib.PosixPath"),
    "deep": (lambda: [[[[[0.1]]]]], "a list nested more than 4 levels deep"),
}


@pytest.mark.parametrize("case", list(NOT_PLAIN))
def test_convert_refuses_a_param_group_value_that_is_not_plain_data(tmp_path, capsys, case):
    """DeepSpeed's universal load reads zero/optimizer_state.pt with torch.load(weights_only=False), which
    imports and calls what the pickle names: a param group value the allowlist reader parsed as a record or
    a global (an argparse.Namespace, a path, a dtype), anywhere inside it, is refused as the DCP export
    refuses it, in one line naming the data file, the key and the type; nothing is written."""
    make, kind = NOT_PLAIN[case]
    folder = _adam_folder(tmp_path / "in", lr=make())
    before = _snapshot(folder)
    out = tmp_path / "u" / "step2_universal"
    out.parent.mkdir()
    code, lines = _convert(capsys, folder, out)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"pyckpt: error: {_data_file(folder)} (record at bytes ["), lines
    assert f"param group value 'optim.param_groups.0.lr' is {kind};" in lines[0], lines
    assert "weights_only=False" in lines[0]
    assert os.listdir(out.parent) == [] and _snapshot(folder) == before


def test_convert_refuses_a_nested_hyper_parameter_instead_of_dropping_it(tmp_path, capsys):
    """dcp.save flattens a dict-valued param group entry into deeper keys (``param_groups.0.sched.warmup``);
    the conversion read only the top level and dropped it without a word, so the job resumed without it.
    Refused in one line naming the key; nothing is written."""
    folder = _adam_folder(tmp_path / "in", sched={"warmup": 10, "kind": "linear"})
    before = _snapshot(folder)
    out = tmp_path / "u" / "step2_universal"
    out.parent.mkdir()
    code, lines = _convert(capsys, folder, out)
    assert code == 1 and len(lines) == 1, lines
    assert "param group value 'optim.param_groups.0.sched." in lines[0] and "nested" in lines[0], lines
    assert os.listdir(out.parent) == [] and _snapshot(folder) == before


# ------------------------------------------------------------------------------------ what an error line quotes

def test_a_megabyte_transform_descriptor_gives_a_short_line(ck, tmp_path, capsys):
    """A storage record's transform_descriptors is the checkpoint's to fill: a megabyte of it was quoted whole
    (a 1,000,189-character error line). The line names the file and the rule and is cut, with the length."""
    from pyckpt import cli

    md = read_metadata(ck)
    md.storage_data[_chunk_index(md, "model.w", 0)].transform_descriptors = ["z" * 1_000_000]
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), UnsupportedCheckpointError)
    assert len(str(error)) < 1000 and "DCP storage transforms" in str(error) and "characters)" in str(error)
    for command in (["inspect", str(ck)], ["verify", str(ck)], ["convert", str(ck), str(tmp_path / "u" / "x")]):
        cli.main(command)
        out, err = capsys.readouterr()
        line = next(l for l in (out + err).splitlines() if ".metadata" in l)
        assert len(line) < 1000 and "pyckpt does not decode" in line, (command, len(line))


@pytest.mark.parametrize("where", ["key", "dtype", "value"])
def test_huge_metadata_content_is_quoted_short(ck, tmp_path, where):
    """The other places a .metadata's content reaches a message: an entry's name (a megabyte long), a
    dtype that is a megabyte string, a chunk size that is one."""
    md = read_metadata(ck)
    huge = "k" * 1_000_000
    if where == "key":
        md.state_dict_metadata[huge] = md.state_dict_metadata["model.w"]  # no storage record names it
        md.planner_data[huge] = (huge, )
    elif where == "dtype":
        md.state_dict_metadata["model.w"].properties.dtype = huge
    else:
        md.state_dict_metadata["model.w"].chunks[0].sizes = [huge, 5]
    write_metadata(ck, md)
    error = refused(ck, tmp_path, _meta(ck), CheckpointFormatError)
    assert len(str(error)) < 1000 and "1,000,0" in str(error), str(error)[:2000]
