"""The load backend's gather into live tensors (pyckpt/deepspeed/load/gather.py): in place on CPU, and
through two host staging windows for device tensors. The staged path runs on CPU tensors here (the
same windows, cuts and copies; only pinning and asynchrony are CUDA's), against the in-place path:
casts, zero runs, runs cut at every window edge, and bytes no run covers keeping their values."""

from __future__ import annotations

import os

import pytest
import torch

from pyckpt.formats.torch_zip import SourceFile
from pyckpt.deepspeed.load.gather import TensorFill


@pytest.fixture()
def sources(tmp_path):
    torch.manual_seed(0)
    values = {"a": torch.randn(1000, dtype=torch.bfloat16), "b": torch.randn(777), "c": torch.randn(64).half()}
    out = {}
    for name, t in values.items():
        path = os.fspath(tmp_path / f"{name}.pt")
        torch.save({"param": t}, path)
        sf = SourceFile(path)
        out[name] = (sf, sf.load()["param"], t)
    return out


def _fill(dest, sources) -> TensorFill:
    """Runs that cast, skip, zero and leave gaps: dest[0:300] <- a[100:400] (bf16), a gap of 5,
    dest[305:1082] <- b whole, zeros [1082:1100], dest[1150:1180] <- c[10:40] (fp16), b[0:3] at the end."""
    fill = TensorFill(dest)
    sa, ta, _ = sources["a"]
    sb, tb, _ = sources["b"]
    sc, tc, _ = sources["c"]
    fill.add(sa, ta, [(100, 300)], 0)
    fill.add(sb, tb, [(0, 777)], 305)
    fill.add(None, None, [(None, 18)], 1082)
    fill.add(sc, tc, [(10, 30)], 1150)
    fill.add(sb, tb, [(0, 3)], dest.numel() - 3)
    return fill


def _expected(sources, n):
    a, b, c = (sources[k][2] for k in "abc")
    out = torch.full((n, ), 7.5)
    out[0:300] = a[100:400].float()
    out[305:1082] = b
    out[1082:1100] = 0
    out[1150:1180] = c[10:40].float()
    out[n - 3:] = b[:3]
    return out


@pytest.mark.parametrize("window", [None, 1, 2, 4, 10, 4095, 4096, 1 << 20])
def test_staged_windows_fill_exactly_what_the_in_place_gather_fills(sources, window):
    n = 1300
    dest = torch.full((n, ), 7.5)
    fill = _fill(dest, sources)
    fill.run(staging=window)
    assert torch.equal(dest, _expected(sources, n))
    assert fill.bytes_read == 300 * 2 + 777 * 4 + 30 * 2 + 3 * 4


def test_windows_cut_rows_on_element_boundaries(sources):
    fill = _fill(torch.zeros(1300), sources)
    seen = 0
    for w0, w1, rows, written in fill._windows(12):  # 3 fp32 elements a window
        assert w1 - w0 == 12
        for lo, hi in written:
            assert 0 <= lo < hi <= 12 and lo % 4 == 0 and hi % 4 == 0
            seen += hi - lo
    assert seen == (300 + 777 + 18 + 30 + 3) * 4, "every written byte once; the gaps never"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA destinations need a GPU")
@pytest.mark.parametrize("window", [4, 36, 4096, 1 << 20])
def test_a_cuda_tensor_is_filled_through_pinned_windows(sources, window):
    n = 1300
    dest = torch.full((n, ), 7.5, device="cuda")
    _fill(dest, sources).run(staging=window)
    assert torch.equal(dest.cpu(), _expected(sources, n))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA destinations need a GPU")
@pytest.mark.parametrize("window", [36, 4096, 1 << 16])
def test_a_large_cuda_fill_overlaps_windows_and_matches_the_host_fill(tmp_path, window):
    """Many windows in flight in turn (8 MiB of float32 through windows of 36 B to 64 KiB, the
    next gathered while the last is copied): the device tensor equals the same fill done in place
    on the host, bit for bit, bf16 widened on the way."""
    torch.manual_seed(2)
    src = torch.randn(1 << 21, dtype=torch.bfloat16)
    path = os.fspath(tmp_path / "big.pt")
    torch.save({"param": src}, path)
    sf = SourceFile(path)
    ref = sf.load()["param"]
    runs = [(0, 700_001), (800_000, 1_000_000), (1_900_000, 197_151)]
    n = sum(length for _, length in runs) + 5
    host = torch.full((n, ), 3.25)
    device = torch.full((n, ), 3.25, device="cuda")
    for dest, staging in ((host, None), (device, window)):
        fill = TensorFill(dest)
        fill.add(sf, ref, runs, 0)
        fill.run(staging=staging)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), host)
    assert torch.equal(host[:700_001], src[:700_001].float()) and host[-5:].eq(3.25).all()


def _matrix_source(tmp_path, dtype):
    torch.manual_seed(1)
    m = torch.randn(64, 48).to(dtype)
    path = os.fspath(tmp_path / f"m_{dtype}.pt")
    torch.save({"param": m}, path)
    sf = SourceFile(path)
    return sf, sf.load()["param"], m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4, 36, 4096, 1 << 20])
def test_a_cut_along_dim_1_gathers_as_strided_ops(tmp_path, dtype, window):
    """A tensor-parallel cut along dim 1 (columns 12:24 of a 64 x 48 matrix: one run per matrix row),
    narrowed to a ZeRO partition that starts and ends inside a row: three ops (the partial first
    row, 62 strided whole rows, the partial last row) instead of 64, filling the destination exactly
    as slicing does, in place and through staging windows that cut the strided op anywhere."""
    from pyckpt.universal.slice import narrow, select_along

    sf, ref, m = _matrix_source(tmp_path, dtype)
    runs = narrow(select_along((64, 48), 1, [(12, 24)]), 5, 64 * 12 - 5 - 7)
    n = 64 * 12 - 12 + 3  # the runs, then 3 elements no run covers
    dest = torch.full((n, ), 7.5)
    fill = TensorFill(dest)
    fill.add(sf, ref, runs, 0)
    assert [(r[7], r[9]) for r in fill._rows] == [(1, 0), (62, 48 * m.element_size()), (1, 0)]
    fill.run(staging=window)
    expected = torch.full((n, ), 7.5)
    expected[:n - 3] = m[:, 12:24].reshape(-1)[5:-7].float()
    assert torch.equal(dest, expected)
    assert fill.bytes_read == (n - 3) * m.element_size()


def test_runs_that_continue_in_the_source_become_one_op(sources):
    """Adjacent runs in both source and destination merge into one contiguous op; runs at a changing
    distance stay separate."""
    sb, tb, b = sources["b"]
    fill = TensorFill(torch.zeros(40))
    fill.add(sb, tb, [(0, 5), (5, 5), (20, 5), (30, 5), (45, 5), (60, 5)], 0)
    assert [(r[1], r[5], r[7], r[9]) for r in fill._rows] == [(sb.tensor_byte_range(tb, 0, 1)[0], 40, 1, 0),
                                                              (sb.tensor_byte_range(tb, 20, 1)[0], 20, 2, 40),
                                                              (sb.tensor_byte_range(tb, 45, 1)[0], 20, 2, 60)]
    fill.run()
    assert torch.equal(fill.tensor[:30], torch.cat([b[0:10], b[20:25], b[30:35], b[45:50], b[60:65]]))
