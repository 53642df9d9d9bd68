"""AutoEP load-side rules and read_expert_slice (the rows one EP rank loads, and only those bytes)."""

import os

import pytest
import torch

from pyckpt import CheckpointFormatError
from pyckpt.universal.expert_slice import check_load_topology, expert_rows, read_expert_slice

from pagecache import evict, resident_bytes

LAYERS = [
    {"module_path": "model.layers.0.mlp", "expert_key_prefix": "model.layers.0.mlp.experts", "num_experts": 8},
    {"module_path": "model.layers.1.mlp", "expert_key_prefix": "model.layers.1.mlp.experts", "num_experts": 8},
]


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_eight_experts_load_at_divisors(ep):
    check_load_topology(LAYERS, autoep_size=ep, world_size=8)


def test_eight_experts_refuse_three_and_list_valid_sizes():
    with pytest.raises(ValueError) as err:
        check_load_topology(LAYERS, autoep_size=3, world_size=6)
    msg = str(err.value)
    assert "model.layers.0.mlp" in msg and "num_experts=8" in msg and "autoep_size=3" in msg
    assert "[1, 2]" in msg  # divisors of 8 that also divide the stage size 6


def test_autoep_size_must_divide_stage_size():
    with pytest.raises(ValueError, match=r"world_size=8 / pp_size=2 = 4\). Valid autoep_size values: \[1, 2, 4\]"):
        check_load_topology(LAYERS, autoep_size=8, world_size=8, pp_size=2)


def test_ep1_needs_full_expert_shape():
    ckpt = {f"model.layers.0.mlp.experts.w{i}": (8, 6, 4) for i in (1, 2, 3)}
    check_load_topology(LAYERS[:1], 1, 2, target_shapes={k: (8, 6, 4) for k in ckpt}, checkpoint_shapes=ckpt)
    check_load_topology(LAYERS[:1], 4, 4, target_shapes={k: (2, 6, 4) for k in ckpt}, checkpoint_shapes=ckpt)
    with pytest.raises(ValueError, match=r"target shape \(4, 6, 4\).*autoep_size=1 give \(8, 6, 4\)"):
        check_load_topology(LAYERS[:1], 1, 2, target_shapes={k: (4, 6, 4) for k in ckpt}, checkpoint_shapes=ckpt)
    with pytest.raises(ValueError, match=r"target shape \(2, 5, 4\)"):
        check_load_topology(LAYERS[:1], 4, 4, target_shapes={k: (2, 5, 4) for k in ckpt}, checkpoint_shapes=ckpt)


def test_expert_rows():
    assert expert_rows(8, 3, 4) == (6, 2)
    with pytest.raises(ValueError, match=r"not divisible by ep_size \(3\). Valid ep sizes: \[1, 2, 4, 8\]"):
        expert_rows(8, 0, 3)
    with pytest.raises(ValueError, match="outside"):
        expert_rows(8, 4, 4)


def _expert_file(path, num_experts=8, shape=(6, 4), dtype=torch.float32):
    full = torch.randn((num_experts, ) + shape).to(dtype)
    torch.save({"param": full, "cat_dim": 0, "is_expert_param": True, "ep_num_experts": num_experts}, path)
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep", [1, 2, 8])
def test_read_expert_slice_equals_torch_slicing(tmp_path, ep, dtype):
    path = tmp_path / "fp32.pt"
    full = _expert_file(path, dtype=dtype)
    local = 8 // ep
    for rank in range(ep):
        got = read_expert_slice(path, rank, ep)
        assert got.dtype == dtype and torch.equal(got, full[rank * local:(rank + 1) * local])
    out = torch.empty((local, 6, 4), dtype=dtype)
    assert read_expert_slice(path, ep - 1, ep, out=out) is out and torch.equal(out, full[-local:])


def test_read_expert_slice_refuses_dense_files(tmp_path):
    path = tmp_path / "dense.pt"
    torch.save({"param": torch.ones(8, 2), "cat_dim": 0}, path)
    with pytest.raises(CheckpointFormatError, match="is_expert_param"):
        read_expert_slice(path, 0, 2)
    with pytest.raises(ValueError, match=r"not divisible by ep_size \(3\)"):
        _expert_file(tmp_path / "e.pt")
        read_expert_slice(tmp_path / "e.pt", 0, 3)


def test_read_expert_slice_touches_only_its_rows(tmp_path):
    path = tmp_path / "fp32.pt"
    full = _expert_file(path, num_experts=64, shape=(256, 256))  # 16 MiB
    size = os.path.getsize(path)
    evict(path)
    baseline = resident_bytes(path)
    assert baseline < size // 16, "the page cache did not let go of the file; the measurement would mean nothing"
    got = read_expert_slice(path, 3, 8)
    touched = resident_bytes(path) - baseline
    assert torch.equal(got, full[24:32])
    # 1/8 of the file, plus the pickle and the kernel's readahead around the range.
    assert size / 8 * 0.95 <= touched <= size / 8 + 1024 * 1024, (touched, size)
