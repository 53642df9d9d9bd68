"""The allowlist unpickler refuses code, and the pickle writer produces what torch.load reads."""

import os
import pickle
from collections import OrderedDict

import pytest
import torch

from pyckpt import CheckpointFormatError, UnsafePickleError
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.execution.executor import execute
from pyckpt.planning.plan import Piece, Plan
from pyckpt.formats.pickle_read import GlobalName, Opaque, TensorRef, loads
from pyckpt.tensors import NewTensor


class _RunsCode:
    """Pickles to os.system(cmd): what a hostile checkpoint would do."""

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd, ))


def test_malicious_global_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"optimizer_state_dict": _RunsCode(f"touch {marker}")}, protocol=2)
    with pytest.raises(UnsafePickleError) as err:
        loads(payload, where="evil_optim_states.pt")
    msg = str(err.value)
    assert "evil_optim_states.pt" in msg and ("posix.system" in msg or "os.system" in msg)
    assert not marker.exists()


def test_malicious_torch_file_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"x": torch.ones(2), "evil": _RunsCode(f"touch {marker}")}, path)
    sf = SourceFile(path)
    with pytest.raises(UnsafePickleError, match=str(path)):
        sf.load()
    assert not marker.exists()


@pytest.mark.parametrize("name", ["builtins.eval", "subprocess.Popen", "torch.load", "numpy.load"])
def test_other_dangerous_globals_are_refused(name):
    module, attr = name.rsplit(".", 1)
    payload = b"\x80\x02c" + module.encode() + b"\n" + attr.encode() + b"\nX\x01\x00\x00\x001\x85R."
    with pytest.raises(UnsafePickleError, match=name.replace(".", r"\.")):
        loads(payload, where="f.pt")


def test_garbage_pickle_is_a_format_error():
    with pytest.raises(CheckpointFormatError, match="f.pt"):
        loads(b"\x80\x02}q\x00(X\x01", where="f.pt")


def test_reader_returns_references_not_data(tmp_path):
    big = torch.arange(12, dtype=torch.float32)
    path = tmp_path / "t.pt"
    torch.save({"view": big[3:9].view(2, 3), "whole": big, "s": torch.Size([4, 5]), "b": b"\x00\xff"}, path)
    obj = SourceFile(path).load()
    v = obj["view"]
    assert isinstance(v, TensorRef)
    assert (v.dtype, v.shape, v.stride, v.offset) == ("float32", (2, 3), (3, 1), 3)
    assert v.storage is obj["whole"].storage  # one record, shared as in torch
    assert obj["s"] == torch.Size([4, 5]) and obj["b"] == b"\x00\xff"


def _write(tmp_path, obj, name="out.pt"):
    plan = Plan()
    plan.add_archive(name, obj)
    execute(plan, str(tmp_path), workers=2)
    return tmp_path / name


def test_writer_round_trips_checkpoint_values(tmp_path):
    src_path = tmp_path / "src.pt"
    base = torch.arange(10, dtype=torch.float32)
    torch.save({"t": base}, src_path)
    sf = SourceFile(src_path)
    ref = sf.load()["t"]
    off, nbytes = sf.tensor_byte_range(ref, 2, 6)
    new = NewTensor("float32", (2, 3), [Piece(sf, off, nbytes, 0)], requires_grad=True)
    obj = {
        "cat_dim": 0,
        "param": new,
        "copied": ref,
        "od": OrderedDict([("a", 1), ("b", [1.5, None, True])]),
        "size": torch.Size([3, 4]),
        "big": 2**70,
        "neg": -5,
        "s": {1, 2},
        "tup": (1, "x", (2, 3), [4]),
    }
    out = _write(tmp_path, obj)
    for kwargs in ({}, {"mmap": True}, {"weights_only": True}):
        got = torch.load(out, **kwargs)
        assert torch.equal(got["param"], base[2:8].view(2, 3)) and got["param"].requires_grad
        assert torch.equal(got["copied"], base)
        assert got["od"] == obj["od"] and isinstance(got["od"], OrderedDict)
        assert got["size"] == torch.Size([3, 4]) and isinstance(got["size"], torch.Size)
        assert (got["big"], got["neg"], got["s"], got["tup"]) == (2**70, -5, {1, 2}, obj["tup"])


def test_writer_keeps_deepspeed_objects_without_importing_them(tmp_path):
    # Opaque records come back from the reader; writing them must reproduce the same global and state.
    cls = type("LossScaler", (Opaque, ), {"_global": ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")})
    scaler = cls.__new__(cls)
    scaler.__setstate__({"cur_scale": 4.0, "dynamic": False})
    out = _write(tmp_path, {"loss_scaler": scaler, "dtype": GlobalName("torch", "bfloat16")})
    got = torch.load(out, weights_only=False)
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    assert isinstance(got["loss_scaler"], LossScaler) and got["loss_scaler"].cur_scale == 4.0
    assert got["dtype"] is torch.bfloat16
    again = SourceFile(out).load()
    assert again["loss_scaler"] == scaler


def test_conversion_pieces_match_tensor_float(tmp_path):
    src_path = tmp_path / "src.pt"
    values = {
        "bf16": torch.randn(33).to(torch.bfloat16),
        "f16": torch.tensor([1e-7, -0.0, float("inf"), float("nan"), 65504.0, 3.14], dtype=torch.float16),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "b": torch.tensor([True, False, True]),
    }
    torch.save(values, src_path)
    sf = SourceFile(src_path)
    refs = sf.load()
    from pyckpt.zero.stage12 import _as_float32
    out = _write(tmp_path, {k: _as_float32(sf, k, refs[k]) for k in values})
    got = torch.load(out, weights_only=True)
    for k, v in values.items():
        expected = v.float()
        assert got[k].dtype == torch.float32
        nan = torch.isnan(expected)
        # torch itself gives a NaN payload that depends on the tensor's length (vector vs scalar path),
        # so NaN positions are compared as NaN; every other element bit for bit.
        assert torch.equal(torch.isnan(got[k]), nan), k
        assert got[k][~nan].view(torch.int32).tolist() == expected[~nan].view(torch.int32).tolist(), k


def _records(storages):
    return [(st.key, st.dtype, st.numel, id(st.source)) for st in storages]


def test_storages_of_names_the_records_dumps_writes(tmp_path):
    """A dry run counts every output's storage records without pickling it (storages_of): the
    same records, in the same order, with the same sources, as the pickle dumps writes; one
    storage named twice (a shared tensor, two views) is one record in both."""
    from pyckpt.formats.pickle_write import Constructed, dumps, storages_of
    import pyckpt.testing as mc
    from pyckpt.universal.write import build_plan
    from pyckpt.zero.discovery import discover

    src_path = tmp_path / "src.pt"
    base = torch.arange(12, dtype=torch.float32)
    torch.save({"a": base, "b": base[4:], "c": torch.ones(3, dtype=torch.bfloat16)}, src_path)
    loaded = SourceFile(src_path).load()
    new = NewTensor("float32", (2, 3), [Piece(SourceFile(src_path), 0, 24, 0)])
    scaler = type("Scaler", (Opaque, ), {"_global": ("m", "Scaler")})
    opaque = scaler.__new__(scaler)
    opaque.__setstate__({"t": loaded["c"]})
    opaque._items.append(new)
    opaque._setitems.append(("k", loaded["a"]))
    obj = {"first": loaded["b"], "again": loaded["a"], "new": new, "tied": new, "set": {1, 2},
           "od": OrderedDict([("x", [loaded["c"], (new, )])]), "opaque": opaque,
           "built": Constructed("m", "C", (loaded["a"], ), state={"s": loaded["c"]}), "size": torch.Size([2])}
    assert _records(storages_of(obj)) == _records(dumps(obj)[1])
    assert len(storages_of(obj)) == 3

    # every output of real plans: AutoEP ZeRO-2 (the resaved model states), ZeRO-3, AutoTP
    for i, kwargs in enumerate((dict(stage=2, experts=4, ep=2, moe_layers=2),
                                dict(stage=3, family="llama", vocab=64),
                                dict(stage=2, family="llama", tp=2, vocab=64))):
        tag = mc.make_checkpoint(tmp_path / f"ck{i}", dp=4, layers=2, hidden=8, **kwargs)
        plan, _ = build_plan(discover(tag), False, False, True)
        assert plan.archives
        for arc in plan.archives:
            assert _records(storages_of(arc.obj)) == _records(dumps(arc.obj)[1]), arc.relpath
