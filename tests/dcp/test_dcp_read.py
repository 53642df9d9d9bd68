"""The DCP reader (pyckpt/dcp/read.py, read_safetensors.py) on small folders made in this process by
torch's own ``torch.distributed.checkpoint.save`` (no process group: one rank), and on chunk layouts a
single process cannot save (FSDP2's row shards, tensor parallelism's column shards, 2-D and 3-D
grids, empty chunks): each chunk saved by torch as an entry of its own, then the ``.metadata``
rewritten with torch's own metadata classes so that the chunks form one tensor. torch's
``dcp_to_torch_save`` reads every crafted folder back, so each one is a layout torch itself loads.

Every tensor the reader assembles is gathered by pyckpt's executor and compared bit for bit with
the tensor torch saved.

The helpers here are shared with test_dcp_hostile.py, which damages these folders.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata)

from pyckpt.dcp.read import DcpCheckpoint, is_dcp_folder, read_dcp  # noqa: E402
from pyckpt.dcp.to_hf import model_entries  # noqa: E402
from pyckpt.execution.executor import gather_tensor  # noqa: E402
from pyckpt.tensors import ITEMSIZE  # noqa: E402

DTYPES = {name: getattr(torch, name) for name in ITEMSIZE}


# ---------------------------------------------------------------------------------------------- helpers

def save(state: dict, folder, *, thread_count: int = 1) -> Path:
    """``state`` saved by torch's dcp.save into ``folder`` (one rank, no process group)."""
    from torch.distributed.checkpoint import FileSystemWriter

    folder = Path(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving on one rank"
        dcp.save(state, storage_writer=FileSystemWriter(str(folder), thread_count=thread_count))
    return folder


def save_hf(state: dict, folder) -> Path:
    """``state`` saved by torch's HuggingFaceStorageWriter(save_distributed=True)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    folder = Path(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))
    return folder


def read_metadata(folder):
    with open(Path(folder) / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own folder: trusted


def write_metadata(folder, md) -> None:
    with open(Path(folder) / ".metadata", "wb") as f:
        pickle.dump(md, f)


def chunk_grid(shape, cuts) -> list:
    """(offsets, sizes) of the grid that cuts dimension d of ``shape`` at the points ``cuts[d]``."""
    import itertools

    spans = []
    for d, n in enumerate(shape):
        points = [0, *cuts.get(d, []), n]
        spans.append([(a, b - a) for a, b in zip(points, points[1:])])
    return [(tuple(o for o, _ in cell), tuple(s for _, s in cell)) for cell in itertools.product(*spans)]


def save_chunked(folder, tensors: dict, *, extra: dict | None = None, thread_count: int = 1) -> Path:
    """A DCP folder whose entry ``name`` is the tensor ``full`` in the chunks ``layout`` for each
    ``name: (full, layout)`` of ``tensors`` (layout: [(offsets, sizes)]): each chunk saved by dcp.save
    as an entry of its own, the metadata then rewritten so that they are the chunks of one entry, as
    a sharded save records them. ``extra`` entries are saved as they are."""
    pieces = {}
    for name, (full, layout) in tensors.items():
        for i, (offsets, sizes) in enumerate(layout):
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            pieces[f"{name}@{i}"] = full[index].clone().contiguous()
    save({**pieces, **(extra or {})}, folder, thread_count=thread_count)
    md = read_metadata(folder)
    for name, (full, layout) in tensors.items():
        props = None
        chunks = []
        for i, (offsets, sizes) in enumerate(layout):
            key = f"{name}@{i}"
            props = md.state_dict_metadata.pop(key).properties
            md.planner_data.pop(key, None)
            info = md.storage_data.pop(MetadataIndex(key, torch.Size([0] * full.dim())))
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            md.storage_data[MetadataIndex(name, torch.Size(offsets), i)] = info
        md.state_dict_metadata[name] = TensorStorageMetadata(properties=props, size=torch.Size(full.shape),
                                                             chunks=chunks)
        path = tuple(name.split("."))
        md.planner_data[name] = path
    write_metadata(folder, md)
    return Path(folder)


def torch_loaded(folder) -> dict:
    """Every entry of a DCP folder as torch's dcp_to_torch_save rebuilds it."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(str(folder), os.path.join(tmp, "full.pt"))
        return torch.load(os.path.join(tmp, "full.pt"), weights_only=False)


def bits(t) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def gathered(ck: DcpCheckpoint, key: str) -> bytes:
    """The bytes of entry ``key`` as pyckpt's executor gathers them from the data files."""
    t = ck.tensor(key)
    buf = bytearray(t.numel() * ITEMSIZE[t.dtype])
    gather_tensor(t, buf)
    return bytes(buf)


def sample(dtype, shape, seed: int = 0):
    """A tensor of ``dtype`` whose bytes are all distinct-ish (random bits, so a misplaced element shows)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * ITEMSIZE[str(dtype).split(".")[1]],), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def write_sharded_safetensors(folder, files: dict) -> Path:
    """The safetensors-backed layout written by hand: ``files`` = {file name: {tensor name: (chunk,
    saved_offsets)}}; each file's header carries DCP_SHARDING_INFO as torch's writer puts it."""
    from pyckpt.formats.safetensors import DTYPES as ST

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for fname, entries in files.items():
        header, sharding, blobs, at = {}, {}, [], 0
        for name, (chunk, offsets) in entries.items():
            data = bits(chunk)
            header[name] = {"dtype": ST[str(chunk.dtype).split(".")[1]][0], "shape": list(chunk.shape),
                            "data_offsets": [at, at + len(data)]}
            sharding[name] = {"saved_offsets": list(offsets)}
            blobs.append(data)
            at += len(data)
        header = {"__metadata__": {"DCP_VERSION": "1.0", "format": "pt",
                                   "DCP_SHARDING_INFO": json.dumps(sharding)}, **header}
        raw = json.dumps(header, separators=(",", ":")).encode()
        (folder / fname).write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return folder


# ---------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype):
    t = sample(DTYPES[dtype], (5, 3), seed=len(dtype))
    scalar = sample(DTYPES[dtype], (), seed=7)
    folder = save({"model": {"w": t, "s": scalar, "e": torch.empty(0, 4, dtype=DTYPES[dtype])}}, tmp_path / "ck")
    ck = read_dcp(folder)
    assert ck.layout == "torch_save"
    assert {k: (v.dtype, v.shape) for k, v in ck.tensors.items()} == {
        "model.w": (dtype, (5, 3)), "model.s": (dtype, ()), "model.e": (dtype, (0, 4))}
    assert gathered(ck, "model.w") == bits(t)
    assert gathered(ck, "model.s") == bits(scalar) and len(bits(scalar)) == ITEMSIZE[dtype]
    assert gathered(ck, "model.e") == b""
    assert ck.tensor("model.e").pieces == [] or len(ck.tensor("model.e").pieces) == 0


def test_entries_paths_and_values(tmp_path):
    state = {"model": {"layers": {"0": {"w": torch.ones(2, 2)}}, "b": torch.zeros(3)},
             "optim": {"state": {"model.b": {"step": torch.tensor(4.0), "exp_avg": torch.ones(3)}},
                       "param_groups": [{"lr": 0.001, "betas": (0.9, 0.95), "params": ["model.b"]}]},
             "step": 12, "name": "run-7", "flags": [True, None, 2.5], "nested": {"a": {"b": (1, "x")}}}
    ck = read_dcp(save(state, tmp_path / "ck"))
    assert ck.tensors["model.layers.0.w"].path == ("model", "layers", "0", "w")
    assert ck.tensors["optim.state.model.b.exp_avg"].path == ("optim", "state", "model.b", "exp_avg")
    assert ck.value("step") == 12
    assert ck.value("name") == "run-7"
    assert ck.value("flags") == [True, None, 2.5]  # a list of no tensors stays one value
    assert ck.value("nested.a.b") == (1, "x")
    assert ck.value("optim.param_groups.0.lr") == 0.001
    assert ck.value("optim.param_groups.0.betas") == (0.9, 0.95)
    assert ck.objects["optim.param_groups.0.lr"].path == ("optim", "param_groups", 0, "lr")
    assert set(ck.entries()) == set(ck.tensors) | set(ck.objects)
    assert is_dcp_folder(tmp_path / "ck") and not is_dcp_folder(tmp_path) and not is_dcp_folder(tmp_path / "no")


def test_model_key_selection(tmp_path):
    state = {"model": {"a.weight": torch.ones(2), "b.weight": torch.zeros(2)}, "optim": {"x": torch.ones(1)},
             "extra": {"c.weight": torch.ones(3)}, "top": torch.ones(4), "step": 3}
    ck = read_dcp(save(state, tmp_path / "ck"))
    auto = model_entries(ck)
    assert auto.key == "model" and dict(auto.names) == {"a.weight": "model.a.weight", "b.weight": "model.b.weight"}
    assert dict(model_entries(ck, "extra").names) == {"c.weight": "extra.c.weight"}
    assert dict(model_entries(ck, "").names) == {"top": "top"}
    from pyckpt.errors import CheckpointFormatError

    with pytest.raises(CheckpointFormatError, match="no tensors under 'nope'.*'extra', 'model'"):
        model_entries(ck, "nope")
    # a model-only save (torchtitan's layout): the top level
    only = read_dcp(save({"w": torch.ones(2), "v": torch.ones(1), "step": 1}, tmp_path / "only"))
    assert model_entries(only).key == "" and sorted(model_entries(only).names) == ["v", "w"]


LAYOUTS = {
    # FSDP2: rows split over 3 ranks, unevenly
    "rows": ((7, 5), {0: [3, 6]}),
    # FSDP2 on more ranks than rows: the empty shards are one chunk at the tensor's end (torch 2.13 gives
    # each the offset of the dimension's size; the plans' merge keeps one)
    "rows_with_empty": ((2, 3), {0: [1, 2]}),
    # tensor parallelism, column-wise
    "columns": ((4, 6), {1: [2, 5]}),
    # FSDP2 x TP: a 2-D grid
    "grid": ((6, 8), {0: [2, 4], 1: [3]}),
    # a 3-D tensor cut along its last two dimensions (one piece per index of the first)
    "cube_inner": ((3, 4, 6), {1: [2], 2: [1, 4]}),
    # cut along every dimension
    "cube_all": ((4, 3, 5), {0: [1, 3], 1: [2], 2: [2]}),
    # a 1-D tensor
    "vector": ((10,), {0: [4, 9]}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_chunk_layouts_reassemble_bit_exact(tmp_path, name, dtype):
    shape, cuts = LAYOUTS[name]
    full = sample(DTYPES[dtype], shape, seed=3)
    layout = chunk_grid(shape, cuts)
    # saved in a shuffled order: the reader must place chunks by their offsets, not their order
    layout = layout[1::2] + layout[::2]
    folder = save_chunked(tmp_path / "ck", {"model.w": (full, layout)}, extra={"model.b": torch.ones(2)})
    assert bits(torch_loaded(folder)["model"]["w"]) == bits(full)  # the crafted folder is one torch reads
    ck = read_dcp(folder)
    assert ck.tensors["model.w"].shape == shape and len(ck.tensors["model.w"].chunks) == len(layout)
    assert gathered(ck, "model.w") == bits(full)
    assert gathered(ck, "model.b") == bits(torch.ones(2))


def test_chunks_over_several_data_files(tmp_path):
    full = sample(torch.float16, (8, 4), seed=5)
    other = sample(torch.float64, (3, 3), seed=6)
    folder = save_chunked(tmp_path / "ck", {"w": (full, chunk_grid((8, 4), {0: [2, 4, 6]})),
                                            "v": (other, chunk_grid((3, 3), {1: [1]}))}, thread_count=3)
    files = {c.record.file.path for t in read_dcp(folder).tensors.values() for c in t.chunks}
    assert len(files) > 1
    ck = read_dcp(folder)
    assert ck.assemble(["w", "v"]).keys() == {"w", "v"}
    assert gathered(ck, "w") == bits(full) and gathered(ck, "v") == bits(other)


def test_torch_hf_writer_layout(tmp_path):
    w, b = sample(torch.float32, (3, 4), seed=1), sample(torch.bfloat16, (2,), seed=2)
    folder = save_hf({"w": w, "b": b}, tmp_path / "hf")
    assert is_dcp_folder(folder)
    ck = read_dcp(folder)
    assert ck.layout == "safetensors" and not ck.objects
    assert {k: (t.dtype, t.shape) for k, t in ck.tensors.items()} == {"w": ("float32", (3, 4)), "b": ("bfloat16", (2,))}
    assert gathered(ck, "w") == bits(w) and gathered(ck, "b") == bits(b)


def test_sharded_safetensors_chunks(tmp_path):
    full = sample(torch.float32, (6, 4), seed=9)
    col = sample(torch.int16, (2, 6), seed=10)
    folder = write_sharded_safetensors(tmp_path / "st", {
        "shard-00001-model-00001-of-00001.safetensors": {"w": (full[:4], (0, 0)), "c": (col[:, :3], (0, 0))},
        "shard-00002-model-00001-of-00001.safetensors": {"w": (full[4:], (4, 0)), "c": (col[:, 3:], (0, 3))},
    })
    ck = read_dcp(folder)
    assert ck.tensors["w"].shape == (6, 4) and ck.tensors["c"].shape == (2, 6)
    assert gathered(ck, "w") == bits(full) and gathered(ck, "c") == bits(col)


def test_export_of_a_small_save(tmp_path):
    import pyckpt
    from safetensors.torch import load_file

    w = sample(torch.bfloat16, (4, 3), seed=4)
    full = sample(torch.float32, (6, 2), seed=8)
    folder = save_chunked(tmp_path / "ck", {"model.x.weight": (full, chunk_grid((6, 2), {0: [3]}))},
                          extra={"model": {"w.weight": w}, "optim": {"step": 3}})
    pyckpt.export_hf(folder, tmp_path / "hf")  # fp32: bfloat16 widens exactly
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == ["w.weight", "x.weight"]
    assert bits(got["w.weight"]) == bits(w.float()) and bits(got["x.weight"]) == bits(full)


# ---------------------------------------------------------------------------------------------- inspect, verify

def _cli(capsys, *argv) -> tuple:
    from pyckpt import cli

    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """get_state_dict's layout: the model (one tensor in row chunks), Adam's state per parameter, param groups."""
    folder = tmp_path_factory.mktemp("trained") / "ck"
    w = sample(torch.float32, (6, 4), seed=11)
    state = {"model": {"b": torch.ones(4, dtype=torch.bfloat16)},
             "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(6, 4),
                                       "exp_avg_sq": torch.zeros(6, 4)},
                                 "b": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4),
                                       "exp_avg_sq": torch.zeros(4)}},
                       "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": ["w", "b"]}]},
             "step": 3, "run": "\x1b[2Jname"}
    return save_chunked(folder, {"model.w": (w, chunk_grid((6, 4), {0: [2, 4]}))}, extra=state)


def test_inspect_describes_a_dcp_folder(trained, capsys):
    from pyckpt.dcp.describe import describe_dcp

    info = describe_dcp(trained)
    assert (info["format"], info["layout"]) == ("torch.distributed.checkpoint", "torch_save")
    assert info["tensors"] == 8 and info["values"] == 5
    assert info["top_level"]["model"] == {"tensors": 2, "numel": 28, "values": 0}
    assert info["top_level"]["optim"] == {"tensors": 6, "numel": 58, "values": 3}
    assert info["model"] == {"key": "model", "tensors": 2, "parameters": 28, "dtypes": {"float32": 1, "bfloat16": 1}}
    optim = info["optimizer"]
    assert (optim["key"], optim["layout"], optim["params"], optim["param_groups"]) == ("optim", "nested", 2, 1)
    assert list(optim["states"].items()) == [("exp_avg", 2), ("exp_avg_sq", 2), ("step", 2)]
    assert info["value_entries"]["step"] == {"value": 3}
    assert info["value_entries"]["optim.param_groups.0.betas"] == {"value": [0.9, 0.99]}
    assert set(info["file_sizes"]) == {".metadata", "__0_0.distcp"}
    assert info["bytes"] == sum(os.path.getsize(trained / n) for n in info["file_sizes"])

    code, out, err = _cli(capsys, "inspect", trained)
    assert code == 0 and not err
    assert "torch.distributed.checkpoint (torch_save layout)" in out
    assert "model: 2 tensors under 'model', 28 parameters" in out
    assert "per state: exp_avg 2, exp_avg_sq 2, step 2" in out
    assert "\x1b" not in out  # the value from the checkpoint is shown escaped
    code, out, _ = _cli(capsys, "inspect", trained, "--json")
    assert code == 0 and json.loads(out)["optimizer"]["states"] == {"exp_avg": 2, "exp_avg_sq": 2, "step": 2}


def test_inspect_of_a_flat_optimizer_and_the_safetensors_layout(tmp_path, capsys):
    from pyckpt.dcp.describe import describe_dcp

    flat = save({"tok.weight": torch.ones(3, 2), "optimizer": {"state.tok.weight.exp_avg": torch.zeros(3, 2),
                                                               "state.tok.weight.step": 4,
                                                               "param_groups.tok.weight.lr": 0.1}},
                tmp_path / "flat")
    info = describe_dcp(flat)
    assert info["model"]["key"] == "" and info["model"]["tensors"] == 1
    assert info["optimizer"]["layout"] == "flat" and dict(info["optimizer"]["states"]) == {"exp_avg": 1, "step": 1}
    hf = save_hf({"w": torch.ones(2, 2)}, tmp_path / "hf")
    code, out, _ = _cli(capsys, "inspect", hf)
    assert code == 0 and "(safetensors layout)" in out and "optimizer state: none" in out


def test_verify_alone_passes_good_folders(trained, tmp_path, capsys):
    from pyckpt.dcp.check import check_dcp

    report = check_dcp(trained)
    assert report.ok, report.problems
    assert report.files == 2 and report.params == 2
    assert report.bytes_checked == sum(os.path.getsize(trained / n) for n in os.listdir(trained))
    code, out, _ = _cli(capsys, "verify", trained)
    assert code == 0 and out.startswith("OK: 2 parameters, 2 files")
    hf = save_hf({"w": torch.ones(2, 2)}, tmp_path / "hf")
    code, out, _ = _cli(capsys, "verify", hf, "--json")
    assert code == 0 and json.loads(out)["ok"] is True
