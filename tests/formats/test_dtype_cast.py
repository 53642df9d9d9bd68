"""The one numpy cast kernel (pyckpt/formats/dtype_cast.py) against torch: Tensor.float() of every
dtype the executor widens, and Tensor.to(bfloat16 / float16) of float32, bit for bit (NaN, inf,
subnormals and rounding ties included). Export's computed tensors and verify's independent
recomputation of converted pieces both go through it."""

import pytest
import torch

from pyckpt.formats.dtype_cast import cast_bytes, to_float32
from pyckpt.native import CONVERT_TO_F32, KIND_COPY

g = torch.Generator().manual_seed(0)


def _sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (257, ), generator=g).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (257, ), generator=g, dtype=torch.int64).to(dtype)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.finfo(dtype).bits // 8]
    raw = torch.randint(torch.iinfo(bits).min, torch.iinfo(bits).max, (2048, ), generator=g, dtype=torch.int64)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 65504.0, 3.0e38])
    return torch.cat([raw.to(bits).view(dtype), special.to(dtype)])


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", sorted(n for n, kind in CONVERT_TO_F32.items() if kind != KIND_COPY))
def test_widening_to_float32_is_torch_float(name):
    t = _sample(getattr(torch, name))
    got = to_float32(_bytes(t), name).tobytes()
    want = _bytes(t.float())
    # NaN payloads: torch keeps them quiet as the executor does; compare NaN positions, bits elsewhere
    a, b = torch.frombuffer(bytearray(got), dtype=torch.float32), torch.frombuffer(bytearray(want), dtype=torch.float32)
    assert torch.equal(a.isnan(), b.isnan())
    assert _bytes(a[~a.isnan()]) == _bytes(b[~b.isnan()])
    assert cast_bytes(_bytes(t), name, "float32") == got


@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_narrowing_float32_rounds_like_torch(dst):
    t = _sample(torch.float32)
    # ties between two bfloat16 values, rounded to even
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7F8000], dtype=torch.int32).view(torch.float32)
    t = torch.cat([t, ties])
    got = torch.frombuffer(bytearray(cast_bytes(_bytes(t), "float32", dst)), dtype=getattr(torch, dst))
    want = t.to(getattr(torch, dst))
    assert torch.equal(got.isnan(), want.isnan())
    assert _bytes(got[~got.isnan()]) == _bytes(want[~want.isnan()])
    if dst == "bfloat16":
        assert set(got[got.isnan()].view(torch.int16).tolist()) <= {0x7FC0}


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="cannot cast complex64"):
        to_float32(b"\0" * 8, "complex64")
