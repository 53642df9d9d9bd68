"""The virtual universal view a direct resume reads (`pyckpt.deepspeed.load.zero_view`) against the
folder the conversion writes.

For every parameter folder and state key of a converted checkpoint, the whole tensor is gathered
twice into fresh memory: from the universal file, and from the ZeRO shards through the view. The
bytes, the layout keys and the step must be equal. The Megatron-style tensor-parallel checkpoints
cover what the plan computes in memory (averaged replicas) and strided merges; the real DeepSpeed
checkpoints (slow) cover every saved layout, including the module fallback that casts a frozen bf16
parameter to float32.
"""

from __future__ import annotations

import os

import pytest
import torch

import pyckpt
from pyckpt.errors import CheckpointFormatError
from pyckpt.native import KIND_SOURCE_DTYPE
from pyckpt.deepspeed.load.gather import TensorFill
from pyckpt.deepspeed.load.state_files import FolderStates
from pyckpt.deepspeed.load.zero_view import VirtualStateFile, ZeroView
# The Megatron TP x PP cases, proven against DeepSpeed's converter in tests/zero/test_megatron_tp_pp.py.
from megatron_cases import AFFINE_INFO, LEGACY_INFO, affine_params, legacy_params, megatron_info, megatron_params
from tp_builder import build

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gather(sf, fill_dtype=torch.float32) -> torch.Tensor:
    n = sf.tensor.numel()
    # filled with a pattern no gather writes, so an element the runs miss shows
    out = torch.full((n, ), float("nan"), dtype=fill_dtype)
    fill = TensorFill(out)
    assert fill.add(sf.source, sf.tensor, [(0, n)], 0) == n
    fill.run()
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _compare(tag_folder, universal, stage: int) -> dict:
    """Every state of every parameter folder, through the view and from the files; returns what the
    view's tensors were made of (shard, computed, cast) to show the case exercises each."""
    view, files = ZeroView(str(tag_folder)), FolderStates(str(universal))
    names = sorted(os.listdir(os.path.join(universal, "zero")))
    names.remove("optimizer_state.pt")
    assert names
    kinds = {"computed": 0, "cast": 0, "shard": 0}
    for name in names:
        theirs, ours = files.param_states(name, stage), view.param_states(name, stage)
        assert sorted(ours.states) == sorted(theirs.states), name
        assert (ours.step is None) == (theirs.step is None), name
        if ours.step is not None:
            assert _same_bits(ours.step.reshape(-1), theirs.step.reshape(-1)), name
        for key, sf in theirs.states.items():
            mine = ours.states[key]
            assert tuple(mine.tensor.shape) == tuple(sf.tensor.shape), (name, key)
            assert mine.meta == sf.meta and mine.is_dict == sf.is_dict, (name, key)
            expected = _gather(sf)
            assert not expected.isnan().any() or sf.tensor.numel() == 0, (name, key)
            assert _same_bits(_gather(mine), expected), (name, key)
            planned = mine.tensor
            # into a bf16 destination the same elements arrive as torch's cast of the float32 ones
            # gives them, where one cast can give them; a wider source would be rounded twice: refused
            sources = {KIND_SOURCE_DTYPE.get(p.kind, "float32") for p in planned.pieces if p.src is not None}
            if sources <= {"float32", "bfloat16", "float16"}:
                assert _same_bits(_gather(mine, torch.bfloat16), expected.to(torch.bfloat16)), (name, key)
            else:
                with pytest.raises(CheckpointFormatError, match=r"cannot load \w+ \(as float32\) into a bfloat16"):
                    _gather(mine, torch.bfloat16)
            kinds["computed"] += planned.data is not None
            kinds["cast"] += any(p.kind and p.src is not None for p in planned.pieces)
            kinds["shard"] += any(p.src is not None for p in planned.pieces)
    return kinds


TP_CASES = {
    "megatron_tp2_pp2_dp3_z2": lambda: (megatron_params()[0], megatron_info(megatron_params()[1]), 2, 2, 3, 2),
    "megatron_tp2_pp2_dp2_z1": lambda: (megatron_params()[0], megatron_info(megatron_params()[1]), 2, 2, 2, 1),
    "legacy_subparams_tp2_pp1_dp2": lambda: (legacy_params(), LEGACY_INFO, 2, 1, 2, 2),
    "affine_maps_tp2_pp1_dp2": lambda: (affine_params(), AFFINE_INFO, 2, 1, 2, 2),
}


@pytest.mark.parametrize("name", list(TP_CASES))
def test_the_view_of_a_tensor_parallel_checkpoint_equals_its_conversion(name, tmp_path):
    params, info, tp, pp, dp, stage = TP_CASES[name]()
    folder = build(tmp_path / "ck", params, info, tp, pp, dp, stage)
    pyckpt.convert_to_universal(folder, tmp_path / "u")
    kinds = _compare(folder, tmp_path / "u", 2)
    assert kinds["shard"] > 0
    if name.startswith("megatron"):
        # post_attention_layernorm is averaged over its tp replicas: computed, not copied
        assert kinds["computed"] == 3, kinds  # fp32, exp_avg, exp_avg_sq


def test_a_computed_tensor_is_served_from_its_bytes_in_any_slice():
    from pyckpt.tensors import NewTensor

    values = torch.arange(10, dtype=torch.float32)
    t = NewTensor("float32", (10, ), [])
    t.data = values.numpy().tobytes()
    vf = VirtualStateFile("zero/x/fp32.pt", t)
    out = torch.zeros(6)
    fill = TensorFill(out)
    fill.add(vf, t, [(7, 3), (None, 1), (2, 2)], 0)
    fill.run()
    assert out.tolist() == [7, 8, 9, 0, 2, 3]
    assert fill.bytes_read == 0  # nothing mapped: the bytes were read when the plan was made


def test_a_planned_tensor_with_a_hole_is_refused():
    from pyckpt.tensors import NewTensor

    t = NewTensor("float32", (10, ), [])
    t.data = bytes(36)
    with pytest.raises(CheckpointFormatError, match="give 36 bytes of a 40-byte tensor"):
        VirtualStateFile("zero/x/fp32.pt", t)


REAL = ["s1_fp32_dp2", "s2_bf16_dp2", "s3_fp32_dp2_subgroups", "s3_bf16_dp3", "s2_bf16_frozen_tied",
        "s3_frozen_tied", "s2_fp32_dp2_no_uc_info", "s1_bf16_dp2_bf16_optimizer", "ep_s2_bf16", "ep_s3_fp32",
        "tp_s2_bf16", "tp_s3_fp32"]


@pytest.mark.parametrize("name", REAL)
def test_the_view_of_a_real_checkpoint_equals_its_conversion(name, checkpoints, pyckpt_universal):
    ck = checkpoints[name]
    kinds = _compare(ck.tag_dir, pyckpt_universal[name], 3 if "s3" in name else 2)
    assert kinds["shard"] > 0
    if name == "s2_bf16_frozen_tied":
        # the frozen proj.weight (and the tied alias out.weight) reach fp32.pt by the module's .float()
        assert kinds["cast"] >= 2, kinds
