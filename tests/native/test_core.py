"""Tests of the native core (pyckpt._core) against torch.save / torch.load and zipfile."""

import filecmp
import io
import os
import pathlib
import random
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch

from pyckpt import _core

from native_hooks import hooks

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


# ----------------------------------------------------------------------------------------------
# helpers


def local_data_offset(path, info):
    """Absolute data offset of a zip member, computed independently from its local header."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        fields = LOCAL_HEADER.unpack(f.read(LOCAL_HEADER.size))
    return info.header_offset + LOCAL_HEADER.size + fields[9] + fields[10]


def storage_bytes(t):
    return bytes(t.untyped_storage().tolist())


def template(path, state):
    """torch.save `state` to `path` and describe it as write_archives records.

    Returns (records, data) where data/<key> records are left for ops (None) and data maps the
    record index to (member name, absolute offset, size) in the template file.
    """
    torch.save(state, path)
    records, data = [], {}
    with _core.Archive(str(path)) as ar:
        for name, off, size, _crc in ar.members():
            short = name.split("/", 1)[1]
            if short.startswith("data/"):
                data[len(records)] = (short, off, size)
                records.append((short, size, None))
            else:
                records.append((short, size, ar.read(name)))
    return records, data


def _save(path, state):
    torch.save(state, path)
    return path


def ops_array(rows):
    return np.array(rows, dtype=np.int64).reshape(-1, 9)


def assert_valid_zip(path):
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        for info in zf.infolist():
            assert local_data_offset(path, info) % 64 == 0, info.filename
            assert info.compress_type == zipfile.ZIP_STORED


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def copy_plan(src_path, out_path, pieces=1, strided=False, seed=0):
    """Ops that rebuild src_path as out_path, each data record split into `pieces` ops."""
    rng = random.Random(seed)
    records, data = template(src_path, torch.load(src_path, weights_only=True))
    rows = []
    for rec, (_name, off, size) in data.items():
        if strided and size % 8 == 0 and size >= 64:
            # contiguous rows expressed with rows/stride (merged into one run by the core)
            rows.append([0, off, 0, rec, 0, 8, 0, size // 8, 8])
            continue
        cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(pieces - 1))})
        for a, b in zip(cuts, cuts[1:]):
            rows.append([0, off + a, 0, rec, a, b - a, 0, 1, 0])
    return [str(src_path)], [(str(out_path), "out", records)], ops_array(rows)


@pytest.fixture
def state():
    big = torch.arange(100, dtype=torch.float32)
    return {
        "w": torch.randn(17, 33),
        "bf": torch.randn(5, 7).to(torch.bfloat16),
        "view": big[10:30].view(4, 5),  # saved as its whole 400-byte storage
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(-50, 50, dtype=torch.int64),
        "mask": torch.rand(13) > 0.5,
        "half": torch.randn(9).half(),
        "empty": torch.empty(0, 4),  # a zero-byte storage record
    }


# ----------------------------------------------------------------------------------------------
# crc32


@pytest.mark.parametrize("impl", _core.crc32_implementations())
def test_crc32_matches_zlib(impl):
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, size=(1 << 22) + 128, dtype=np.uint8).tobytes()
    mv = memoryview(buf)
    for _ in range(600):
        off = int(rng.integers(0, 64))
        n = int(rng.integers(0, 10001))
        init = int(rng.integers(0, 1 << 32))
        assert _core.crc32_using(impl, mv[off:off + n], init) == zlib.crc32(mv[off:off + n], init)
    for n in (1 << 20, 3 * (1 << 20) + 77, 1 << 22):
        assert _core.crc32_using(impl, mv[5:5 + n]) == zlib.crc32(mv[5:5 + n])


def test_crc32_default_and_combine():
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, size=50000, dtype=np.uint8).tobytes()
    assert _core.crc32(b"") == 0
    assert _core.crc32(data) == zlib.crc32(data)
    assert _core.crc32(bytearray(data), 12345) == zlib.crc32(data, 12345)
    assert _core.crc32(np.frombuffer(data, dtype=np.uint8)) == zlib.crc32(data)
    for _ in range(50):
        k = int(rng.integers(0, len(data)))
        a, b = zlib.crc32(data[:k]), zlib.crc32(data[k:])
        assert _core.crc32_combine(a, b, len(data) - k) == zlib.crc32(data)
    assert _core.crc32_active_implementation() in _core.crc32_implementations()
    with pytest.raises(ValueError):
        _core.crc32_using("no-such-impl", b"x")


# ----------------------------------------------------------------------------------------------
# Archive


def test_archive_matches_zipfile(tmp_path, state):
    p = tmp_path / "model.pt"
    torch.save(state, p)
    with _core.Archive(str(p)) as ar, zipfile.ZipFile(p) as zf:
        assert ar.path == str(p)
        assert ar.size == os.path.getsize(p)
        assert ar.prefix == "model"
        members = ar.members()
        infos = zf.infolist()
        assert [m[0] for m in members] == [i.filename for i in infos]
        for (name, off, size, crc), info in zip(members, infos):
            assert off == local_data_offset(p, info)
            assert off % 64 == 0
            assert size == info.file_size
            assert crc == info.CRC
            assert ar.read(name) == zf.read(name)
        raw = p.read_bytes()
        by_name = {m[0]: m for m in members}
        # torch numbers storages in the order the pickler meets them (dict order here)
        for key, t in zip(state, range(len(state))):
            _, off, size, _ = by_name[f"model/data/{t}"]
            assert raw[off:off + size] == storage_bytes(state[key])
        assert by_name["model/data/2"][2] == 400  # the view's whole storage
        assert by_name["model/data/7"][2] == 0
        with pytest.raises(KeyError) as ei:
            ar.read("model/missing")
        assert str(p) in str(ei.value) and "model/missing" in str(ei.value)
    with pytest.raises(ValueError):
        ar.members()


def test_archive_accepts_pathlike_and_close(tmp_path):
    p = tmp_path / "x.pt"
    torch.save({"a": torch.ones(3)}, p)
    ar = _core.Archive(p)
    assert ar.read("x/byteorder") == b"little"
    ar.close()
    ar.close()
    with pytest.raises(ValueError):
        ar.read("x/byteorder")


def _stored_zip(path, members):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return bytearray(path.read_bytes())


def _eocd(buf):
    pos = buf.rfind(b"PK\x05\x06")
    return pos, struct.unpack_from("<IHHHHIIH", buf, pos)


def _central_entries(buf):
    pos, (_, _, _, _, n, _, cd_off, _) = _eocd(buf)
    out = []
    for _ in range(n):
        nl, el, cl = struct.unpack_from("<HHH", buf, cd_off + 28)
        out.append(cd_off)
        cd_off += 46 + nl + el + cl
    return out


def _expect_archive_error(path, *needles):
    with pytest.raises(_core.ArchiveError) as ei:
        _core.Archive(str(path))
    msg = str(ei.value)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, msg
    assert isinstance(ei.value, ValueError)
    return msg


def test_archive_rejects_truncated_and_garbage(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"a": torch.randn(100)}, good)
    raw = good.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(raw[: len(raw) // 2])
    _expect_archive_error(cut, "end-of-central-directory")
    tiny = tmp_path / "tiny.pt"
    tiny.write_bytes(b"PK")
    _expect_archive_error(tiny, "too short")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    _expect_archive_error(empty, "too short")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    _expect_archive_error(junk)


def test_archive_rejects_central_directory_past_eof(tmp_path):
    p = tmp_path / "cd.pt"
    torch.save({"a": torch.randn(10)}, p)
    buf = bytearray(p.read_bytes())
    pos, _ = _eocd(buf)
    struct.pack_into("<I", buf, pos + 16, len(buf) + 1000)
    z64 = buf.rfind(b"PK\x06\x06")  # torch writes a ZIP64 end record, whose offset wins
    if z64 >= 0:
        struct.pack_into("<Q", buf, z64 + 48, len(buf) + 1000)
    p.write_bytes(buf)
    _expect_archive_error(p, "central directory past end of file")


def test_archive_rejects_compressed_member(tmp_path):
    p = tmp_path / "deflated.pt"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("arc/data.pkl", b"x" * 100)
        zf.writestr("arc/data/0", b"y" * 1000, compress_type=zipfile.ZIP_DEFLATED)
    _expect_archive_error(p, "arc/data/0", "compressed")


def test_archive_rejects_encrypted_member(tmp_path):
    p = tmp_path / "enc.pt"
    buf = _stored_zip(p, [("arc/a", b"1234"), ("arc/b", b"5678")])
    cd = _central_entries(buf)
    flags = struct.unpack_from("<H", buf, cd[1] + 8)[0]
    struct.pack_into("<H", buf, cd[1] + 8, flags | 1)
    p.write_bytes(buf)
    _expect_archive_error(p, "arc/b", "encrypted")


def test_archive_rejects_local_name_mismatch(tmp_path):
    p = tmp_path / "name.pt"
    buf = _stored_zip(p, [("arc/a", b"1234"), ("arc/b", b"5678")])
    lho = struct.unpack_from("<I", buf, _central_entries(buf)[1] + 42)[0]
    buf[lho + 30 + 4] = ord("z")  # arc/b -> arc/z in the local header only
    p.write_bytes(buf)
    _expect_archive_error(p, "arc/b", "name mismatch")


def test_archive_rejects_overlapping_members(tmp_path):
    p = tmp_path / "overlap.pt"
    buf = _stored_zip(p, [("arc/a", b"1234"), ("arc/b", b"5678")])
    cd = _central_entries(buf)
    # grow member a (consistently in both headers) so that its data runs over b's header
    lho_a = struct.unpack_from("<I", buf, cd[0] + 42)[0]
    struct.pack_into("<II", buf, cd[0] + 20, 40, 40)
    struct.pack_into("<II", buf, lho_a + 18, 40, 40)
    p.write_bytes(buf)
    _expect_archive_error(p, "arc/a", "arc/b", "overlaps")


def test_archive_rejects_member_past_eof(tmp_path):
    p = tmp_path / "past.pt"
    buf = _stored_zip(p, [("arc/a", b"1234"), ("arc/b", b"5678")])
    cd = _central_entries(buf)
    lho_b = struct.unpack_from("<I", buf, cd[1] + 42)[0]
    struct.pack_into("<II", buf, cd[1] + 20, 1 << 20, 1 << 20)
    struct.pack_into("<II", buf, lho_b + 18, 1 << 20, 1 << 20)
    p.write_bytes(buf)
    _expect_archive_error(p, "arc/b", "past end of file")


def test_archive_rejects_truncated_zip64(tmp_path, state):
    src = _save(tmp_path / "s.pt", state)
    out = tmp_path / "z64.pt"
    sources, outputs, ops = copy_plan(src, out)
    _core.write_archives(sources, outputs, ops, 1, force_zip64=True)
    buf = bytearray(out.read_bytes())
    loc = buf.rfind(b"PK\x06\x07")
    assert loc > 0
    # point the locator at a record that would run into the locator itself
    struct.pack_into("<Q", buf, loc + 8, loc - 10)
    out.write_bytes(buf)
    _expect_archive_error(out, "truncated ZIP64")


# ----------------------------------------------------------------------------------------------
# write_archives


@pytest.mark.parametrize("pieces,strided", [(1, False), (5, False), (1, True)])
def test_write_roundtrip(tmp_path, state, pieces, strided):
    src = _save(tmp_path / "src.pt", state)
    out = tmp_path / "out.pt"
    sources, outputs, ops = copy_plan(src, out, pieces=pieces, strided=strided)
    res = _core.write_archives(sources, outputs, ops, 2, window_bytes=4096)
    assert res == {"bytes_written": os.path.getsize(out), "files": 1, "records": len(outputs[0][2])}
    assert_valid_zip(out)
    for mmap in (False, True):
        assert_same_tensors(torch.load(out, weights_only=True, mmap=mmap), state)
    with _core.Archive(str(out)) as ar, zipfile.ZipFile(out) as zf:
        assert ar.prefix == "out"
        for name, off, size, crc in ar.members():
            assert off % 64 == 0
            assert crc == zlib.crc32(zf.read(name))


def test_write_force_zip64(tmp_path, state):
    src = _save(tmp_path / "src.pt", state)
    out = tmp_path / "out.pt"
    sources, outputs, ops = copy_plan(src, out, pieces=3)
    _core.write_archives(sources, outputs, ops, 2, force_zip64=True)
    raw = out.read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw
    assert_valid_zip(out)
    assert_same_tensors(torch.load(out, weights_only=True), state)
    assert_same_tensors(torch.load(out, weights_only=True, mmap=True), state)
    with _core.Archive(str(out)) as ar, zipfile.ZipFile(out) as zf:
        for (name, off, size, crc), info in zip(ar.members(), zf.infolist()):
            assert (name, off, size, crc) == (info.filename, local_data_offset(out, info), info.file_size, info.CRC)


def test_write_more_than_65535_members(tmp_path):
    n = 70000
    records = [(f"m{i}", 1 + i % 3, bytes([i % 256]) * (1 + i % 3)) for i in range(n)]
    out = tmp_path / "many.zip"
    res = _core.write_archives([], [(str(out), "arc", records)], ops_array([]), 2)
    assert res["records"] == n
    raw = out.read_bytes()
    assert b"PK\x06\x06" in raw
    with zipfile.ZipFile(out) as zf:
        infos = zf.infolist()
        assert len(infos) == n
        assert zf.read("arc/m69999") == records[-1][2]
    with _core.Archive(str(out)) as ar:
        members = ar.members()
        assert len(members) == n
        assert members[12345][0] == "arc/m12345"
        assert ar.read("arc/m12345") == records[12345][2]
        assert all(off % 64 == 0 for _, off, _, _ in members)


CONVERSIONS = [
    ("bf16", _core.KIND_BF16_TO_F32, lambda g: torch.randn(3001, generator=g).to(torch.bfloat16)),
    ("f16", _core.KIND_F16_TO_F32, None),
    ("f64", _core.KIND_F64_TO_F32, None),
    ("i64", _core.KIND_I64_TO_F32,
     lambda g: torch.cat([torch.randint(-(1 << 62), 1 << 62, (2000,), generator=g),
                          torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63), (1 << 24) + 1, (1 << 53) + 1])])),
    ("i32", _core.KIND_I32_TO_F32,
     lambda g: torch.cat([torch.randint(-(1 << 31), (1 << 31) - 1, (2000,), generator=g, dtype=torch.int32),
                          torch.tensor([(1 << 24) + 1, -(1 << 31)], dtype=torch.int32)])),
    ("i16", _core.KIND_I16_TO_F32, lambda g: torch.randint(-32768, 32767, (2001,), generator=g, dtype=torch.int16)),
    ("i8", _core.KIND_I8_TO_F32, lambda g: torch.randint(-128, 127, (2001,), generator=g, dtype=torch.int8)),
    ("u8", _core.KIND_U8_TO_F32, lambda g: torch.randint(0, 255, (2001,), generator=g, dtype=torch.uint8)),
    ("bool", _core.KIND_BOOL_TO_F32, lambda g: torch.rand(2001, generator=g) > 0.5),
]


def _special_f16(g):
    bits = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0200, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
                     0x7E00, 0xFE00, 0x7C01, 0x7D55, 0xFDFF, 0x3C00], dtype=np.uint16)
    rand = torch.randint(0, 1 << 16, (3000,), generator=g, dtype=torch.int32).numpy().astype(np.uint16)
    return torch.from_numpy(np.concatenate([bits, rand]).view(np.int16)).view(torch.float16)


def _special_f64(g):
    vals = torch.tensor([0.0, -0.0, 1e-310, -1e-320, 1e-45, 1.5e-45, 3.4028235e38, 3.4028236e38, 1e300, -1e300,
                         float("inf"), float("-inf"), float("nan"), 1.0000000596046448, 0.1], dtype=torch.float64)
    nan_payload = torch.from_numpy(np.array([0x7FF0000000000001, 0xFFF8000000000123], dtype=np.uint64).view(np.int64))
    return torch.cat([vals, nan_payload.view(torch.float64), torch.randn(3000, generator=g, dtype=torch.float64) * 1e3])


@pytest.mark.parametrize("name,kind,make", CONVERSIONS, ids=[c[0] for c in CONVERSIONS])
def test_write_conversions_bit_exact(tmp_path, name, kind, make):
    g = torch.Generator().manual_seed(7)
    t = {"f16": _special_f16, "f64": _special_f64}.get(name, make)(g)
    src = _save(tmp_path / "src.pt", {"x": t})
    with _core.Archive(str(src)) as ar:
        _, src_off, src_size, _ = next(m for m in ar.members() if m[0].endswith("/data/0"))
    expected = t.float()
    records, data = template(tmp_path / "tpl.pt", {"x": expected})
    (rec, (_, _, dst_size)), = data.items()
    item = t.element_size()
    assert dst_size == src_size // item * 4
    # three pieces with element-aligned cuts, odd window size so windows split floats
    n = t.numel()
    cuts = [0, n // 3, n // 3 + 1, n]
    rows = [[0, src_off + a * item, 0, rec, a * 4, (b - a) * item, kind, 1, 0] for a, b in zip(cuts, cuts[1:])]
    out = tmp_path / "out.pt"
    _core.write_archives([str(src)], [(str(out), "out", records)], ops_array(rows), 2, window_bytes=4099)
    assert_valid_zip(out)
    got = torch.load(out, weights_only=True)["x"]
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_conversions_ignore_caller_flush_denormal(tmp_path):
    """Threads inherit the caller's FTZ/DAZ mode; conversions must not depend on it."""
    t = _special_f16(torch.Generator().manual_seed(1))
    d = torch.tensor([1e-40, -3e-42, 1e-45, 1.0], dtype=torch.float64)
    expected_h, expected_d = t.float(), d.float()
    assert expected_d[0] != 0  # a subnormal float32 result
    ph, pd = tmp_path / "h.bin", tmp_path / "d.bin"
    ph.write_bytes(t.view(torch.int16).numpy().tobytes())
    pd.write_bytes(d.numpy().tobytes())
    n = t.numel()
    dst = np.zeros(n + 4, dtype=np.float32)
    ops = ops_array([[0, 0, 0, 0, 0, 2 * n, _core.KIND_F16_TO_F32, 1, 0],
                     [1, 0, 0, 0, 4 * n, 32, _core.KIND_F64_TO_F32, 1, 0]])
    supported = torch.set_flush_denormal(True)
    try:
        _core.execute_into([str(ph), str(pd)], ops, dst, 2, window_bytes=4096)
        portable = hooks().f16_to_f32_portable(t.view(torch.int16).numpy().tobytes())
    finally:
        torch.set_flush_denormal(False)
    assert supported  # x86 has FTZ/DAZ, so the flush mode really was on
    assert np.array_equal(dst[:n].view(np.int32), expected_h.view(torch.int32).numpy())
    assert np.array_equal(dst[n:].view(np.int32), expected_d.view(torch.int32).numpy())
    assert portable == expected_h.numpy().tobytes()


def _special_f32(g):
    """Every rounding boundary of float32 -> bf16/f16: ties both ways, overflow to inf, subnormal halves,
    signed zeros, NaNs with payloads, and random values over the whole exponent range."""
    bits = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FBFFFFF,
            0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x7F7FFFFF, 0xFF7FFFFF,  # half overflow
            0x38800000, 0x387FFFFF, 0x387FF000, 0x33000000, 0x33000001, 0x32FFFFFF, 0x33800000, 0x33C00000,
            0x34200000, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # bf16 ties
            0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001, 0x7F7F8000, 0x7F7FFFFF]
    rand_bits = torch.randint(0, 1 << 32, (4000,), generator=g, dtype=torch.int64).numpy().astype(np.uint32)
    wide = (torch.randn(4000, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-30, 20, (4000,),
                                                                                             generator=g))).float()
    arr = np.concatenate([np.array(bits, dtype=np.uint32), rand_bits, wide.numpy().view(np.uint32)])
    return torch.from_numpy(arr.view(np.int32)).view(torch.float32)


NARROWING = [
    ("f32_bf16", _core.KIND_F32_TO_BF16, _special_f32, torch.bfloat16),
    ("f32_f16", _core.KIND_F32_TO_F16, _special_f32, torch.float16),
    ("bf16_f16", _core.KIND_BF16_TO_F16, lambda g: _special_f32(g).to(torch.bfloat16), torch.float16),
    ("f16_bf16", _core.KIND_F16_TO_BF16, _special_f16, torch.bfloat16),
    ("f64_bf16", _core.KIND_F64_TO_BF16, _special_f64, torch.bfloat16),
    ("f64_f16", _core.KIND_F64_TO_F16, _special_f64, torch.float16),
]


@pytest.mark.parametrize("name,kind,make,dtype", NARROWING, ids=[c[0] for c in NARROWING])
def test_narrowing_conversions_match_torch(tmp_path, name, kind, make, dtype):
    """Tensor.to(bf16/f16) bit for bit, NaNs as NaNs: torch's own NaN bits differ between its scalar
    and vector paths, so only NaN-ness is compared there."""
    t = make(torch.Generator().manual_seed(11))
    src = tmp_path / "src.bin"
    src.write_bytes(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    n, item = t.numel(), t.element_size()
    dst = np.zeros(n, dtype=np.uint16)
    cuts = [0, n // 3, n // 3 + 1, n]  # element-aligned pieces; an odd window size splits elements
    ops = ops_array([[0, a * item, 0, 0, a * 2, (b - a) * item, kind, 1, 0] for a, b in zip(cuts, cuts[1:])])
    _core.execute_into([str(src)], ops, dst, 2, window_bytes=4099)
    got = torch.from_numpy(dst.view(np.int16)).view(dtype)
    # torch converts a double to a 16-bit float by way of float; so does the executor
    expected = (t.float() if t.dtype == torch.float64 else t).to(dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    if name == "f32_f16":  # the portable path and the F16C path agree bit for bit, NaN payloads included
        assert hooks().f32_to_f16_portable(t.numpy().tobytes()) == dst.tobytes()


@pytest.mark.parametrize("window", [0, 4, 6, 4099])
def test_strided_source_rows_gather_a_column_block(tmp_path, window):
    """src_stride: an op's rows spread out in the source, one after another in the destination (a
    block of columns of a matrix), copied and cast, cut into any windows; a 9-column table means
    src_stride 0, rows end to end in the source."""
    m = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    src = tmp_path / "m.bin"
    src.write_bytes(m.numpy().tobytes())
    # columns 3:7 of rows 2..10 as fp32, then of rows 0..11 cast to bf16 bits, then rows 4..5 whole
    copy = [0, (2 * 10 + 3) * 4, 0, 0, 0, 4 * 4, _core.KIND_COPY, 9, 4 * 4, 10 * 4]
    dst = np.zeros(9 * 4 + 2 * 10, dtype=np.float32)
    whole = [0, 4 * 10 * 4, 0, 0, 9 * 4 * 4, 2 * 10 * 4, _core.KIND_COPY, 1, 0]
    _core.execute_into([str(src)], np.array([copy, whole + [0]], dtype=np.int64), dst, 2, window_bytes=window)
    assert np.array_equal(dst[:36], m[2:11, 3:7].reshape(-1).numpy())
    assert np.array_equal(dst[36:], m[4:6].reshape(-1).numpy())
    half = np.zeros(12 * 4, dtype=np.uint16)
    cast = [0, 3 * 4, 0, 0, 0, 4 * 4, _core.KIND_F32_TO_BF16, 12, 4 * 2, 10 * 4]
    _core.execute_into([str(src)], np.array([cast], dtype=np.int64), half, 1, window_bytes=window)
    assert np.array_equal(half, m[:, 3:7].to(torch.bfloat16).reshape(-1).view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("row,match", [
    ([0, 0, 0, 0, 0, 16, 0, 3, 16, 8], "source rows overlap"),
    ([0, 0, 0, 0, 0, 16, 0, 3, 16, -40], "negative src_stride"),
    ([0, 400, 0, 0, 0, 16, 0, 3, 16, 40], "outside"),  # the last row ends at 400 + 2*40 + 16 > 480
    ([0, 0, 0, 0, 0, 16, 0, 5, 16, 1 << 62], "overflows"),  # 4 * 2**62 wraps
])
def test_strided_source_rows_are_checked_against_the_source(tmp_path, row, match):
    src = tmp_path / "m.bin"
    src.write_bytes(bytes(480))
    with pytest.raises(_core.PlanError, match=match):
        _core.execute_into([str(src)], np.array([row], dtype=np.int64), np.zeros(48, dtype=np.uint8), 1)


def test_narrowing_ignores_caller_flush_denormal(tmp_path):
    """Subnormal halves come out the same whatever FTZ/DAZ mode the caller's threads inherit."""
    t = torch.tensor([6e-8, 3e-6, -6.1e-5, 1e-7, 5.96e-8, 1.0], dtype=torch.float32)
    src = tmp_path / "src.bin"
    src.write_bytes(t.numpy().tobytes())
    dst = np.zeros(t.numel(), dtype=np.uint16)
    supported = torch.set_flush_denormal(True)
    try:
        _core.execute_into([str(src)], ops_array([[0, 0, 0, 0, 0, 4 * t.numel(), _core.KIND_F32_TO_F16, 1, 0]]),
                           dst, 1)
    finally:
        torch.set_flush_denormal(False)
    assert supported
    assert np.array_equal(dst.view(np.int16), t.to(torch.float16).view(torch.int16).numpy())
    assert (dst[:5] & 0x7C00 == 0).all() and (dst[:5] & 0x3FF != 0).all()  # subnormal halves, not flushed


@pytest.mark.parametrize("kind", ["copy", "bf16"])
def test_write_row_strided_cat_dim1(tmp_path, kind):
    g = torch.Generator().manual_seed(3)
    dtype = torch.float32 if kind == "copy" else torch.bfloat16
    a = torch.randn(37, 11, generator=g).to(dtype)
    b = torch.randn(37, 6, generator=g).to(dtype)
    pa = _save(tmp_path / "a.pt", {"w": a})
    pb = _save(tmp_path / "b.pt", {"w": b})
    offs = []
    for p in (pa, pb):
        with _core.Archive(str(p)) as ar:
            offs.append(next(m[1] for m in ar.members() if m[0].endswith("/data/0")))
    expected = torch.cat([a, b], dim=1).float()
    records, data = template(tmp_path / "tpl.pt", {"w": expected})
    (rec, _), = data.items()
    k = _core.KIND_COPY if kind == "copy" else _core.KIND_BF16_TO_F32
    item = a.element_size()
    row_bytes = 17 * 4
    rows = [[0, offs[0], 0, rec, 0, 11 * item, k, 37, row_bytes],
            [1, offs[1], 0, rec, 11 * 4, 6 * item, k, 37, row_bytes]]
    out = tmp_path / "out.pt"
    _core.write_archives([str(pa), str(pb)], [(str(out), "out", records)], ops_array(rows), 2, window_bytes=100)
    assert_valid_zip(out)
    assert torch.equal(torch.load(out, weights_only=True)["w"], expected)


def test_write_zero_fill_and_multiple_outputs(tmp_path):
    src = _save(tmp_path / "src.pt", {"x": torch.arange(1000, dtype=torch.float32)})
    with _core.Archive(str(src)) as ar:
        _, off, _, _ = next(m for m in ar.members() if m[0].endswith("/data/0"))
    want0 = torch.zeros(1 << 18)
    want1 = torch.cat([torch.zeros(100), torch.arange(1000, dtype=torch.float32), torch.zeros(50)])
    r0, d0 = template(tmp_path / "t0.pt", {"z": want0})
    r1, d1 = template(tmp_path / "t1.pt", {"y": want1})
    (rec0, _), = d0.items()
    (rec1, _), = d1.items()
    rows = [[-1, 0, 0, rec0, 0, 4 << 18, 0, 1, 0],
            [-1, 12345, 1, rec1, 0, 400, 0, 1, 0],
            [0, off, 1, rec1, 400, 4000, 0, 1, 0],
            [-1, 0, 1, rec1, 4400, 200, 0, 1, 0]]
    outs = [(str(tmp_path / "o0.pt"), "o0", r0), (str(tmp_path / "o1.pt"), "o1", r1)]
    res = _core.write_archives([str(src)], outs, ops_array(rows), 2, True, window_bytes=1 << 16)  # fsync
    assert res["files"] == 2
    assert res["bytes_written"] == sum(os.path.getsize(o[0]) for o in outs)
    for (path, _, _), want, key in zip(outs, (want0, want1), ("z", "y")):
        assert_valid_zip(path)
        assert torch.equal(torch.load(path, weights_only=True)[key], want)


def test_write_workers_identical(tmp_path, state):
    src = _save(tmp_path / "src.pt", state)
    paths = []
    for w in (1, 2, 4):
        out = tmp_path / f"out{w}.pt"
        sources, outputs, ops = copy_plan(src, out, pieces=4)
        _core.write_archives(sources, outputs, ops, w, window_bytes=256)
        paths.append(out)
    sources, outputs, ops = copy_plan(src, tmp_path / "default.pt", pieces=4)
    _core.write_archives(sources, outputs, ops, None, window_bytes=256)
    paths.append(tmp_path / "default.pt")
    for p in paths[1:]:
        assert filecmp.cmp(paths[0], p, shallow=False)


def test_write_big_fast_path(tmp_path):
    g = torch.Generator().manual_seed(5)
    t = torch.randint(-(1 << 31), (1 << 31) - 1, (16 << 20,), generator=g, dtype=torch.int32)  # 64 MiB
    src = _save(tmp_path / "big.pt", {"t": t})
    out = tmp_path / "out.pt"
    sources, outputs, ops = copy_plan(src, out)
    calls = []
    res = _core.write_archives(sources, outputs, ops, 2, progress=lambda d, tot: calls.append((d, tot)))
    assert calls and calls[-1] == (res["bytes_written"], res["bytes_written"])
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    assert {c[1] for c in calls} == {res["bytes_written"]}
    with zipfile.ZipFile(out) as zf, zipfile.ZipFile(src) as zs:
        assert zf.getinfo("out/data/0").CRC == zs.getinfo("big/data/0").CRC
    assert torch.equal(torch.load(out, weights_only=True, mmap=True)["t"], t)

    # the same 64 MiB through the staging path (two interleaved strided sources)
    half = t.view(4096, 4096)
    pa = _save(tmp_path / "a.pt", {"w": half[:, :1000].contiguous()})
    pb = _save(tmp_path / "b.pt", {"w": half[:, 1000:].contiguous()})
    offs = []
    for p in (pa, pb):
        with _core.Archive(str(p)) as ar:
            offs.append(next(m[1] for m in ar.members() if m[0].endswith("/data/0")))
    records, data = template(tmp_path / "tpl.pt", {"w": half})
    (rec, _), = data.items()
    rows = [[0, offs[0], 0, rec, 0, 4000, 0, 4096, 4096 * 4], [1, offs[1], 0, rec, 4000, 3096 * 4, 0, 4096, 4096 * 4]]
    out2 = tmp_path / "cat.pt"
    _core.write_archives([str(pa), str(pb)], [(str(out2), "cat", records)], ops_array(rows), 2)
    assert_valid_zip(out2)
    assert torch.equal(torch.load(out2, weights_only=True)["w"], half)


def test_write_bounded_rss(tmp_path):
    psutil = pytest.importorskip("psutil")
    src = tmp_path / "raw.bin"
    chunk = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()
    with open(src, "wb") as f:
        for _ in range(16):  # 256 MiB
            f.write(chunk)
    size = 256 << 20
    out = tmp_path / "out.zip"
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak = [before]
    _core.write_archives([str(src)], [(str(out), "arc", [("blob", size, None)])], ops_array([[0, 0, 0, 0, 0, size, 0, 1, 0]]),
                         2, progress=lambda d, t: peak.append(proc.memory_info().rss))
    peak.append(proc.memory_info().rss)
    assert max(peak) - before < 96 << 20
    with zipfile.ZipFile(out) as zf:
        assert zf.getinfo("arc/blob").CRC == zlib.crc32(chunk * 16)


def test_write_progress_exception_removes_outputs(tmp_path, state):
    src = _save(tmp_path / "src.pt", state)
    out = tmp_path / "out.pt"
    sources, outputs, ops = copy_plan(src, out)

    class Stop(Exception):
        pass

    def progress(done, total):
        raise Stop("stop here")

    with pytest.raises(Stop, match="stop here"):
        _core.write_archives(sources, outputs, ops, 2, progress=progress)
    assert not out.exists()


def test_write_io_error_names_path_and_cleans_up(tmp_path, state):
    src = _save(tmp_path / "src.pt", state)
    good = tmp_path / "good.pt"
    bad = tmp_path / "missing-dir" / "bad.pt"
    sources, outputs, ops = copy_plan(src, good)
    outputs.append((str(bad), "bad", [("version", 2, b"3\n")]))
    with pytest.raises(FileNotFoundError) as ei:
        _core.write_archives(sources, outputs, ops, 1)
    assert str(bad) in str(ei.value)
    assert not good.exists()


def _single_record_job(tmp_path, nbytes=1000):
    src = tmp_path / "raw.bin"
    src.write_bytes(bytes(range(256)) * 8)
    out = tmp_path / "o.zip"
    return [str(src)], [(str(out), "arc", [("v", 2, b"3\n"), ("blob", nbytes, None)])], out


@pytest.mark.parametrize(
    "rows,names_output,needles",
    [
        ([[0, 0, 0, 1, 0, 999, 0, 1, 0]], True, ["gap", "blob", "[999, 1000)"]),
        ([[0, 0, 0, 1, 0, 600, 0, 1, 0], [0, 0, 0, 1, 500, 500, 0, 1, 0]], True, ["overlap", "blob"]),
        ([[0, 0, 0, 1, 0, 500, 0, 1, 0], [0, 0, 0, 1, 500, 501, 0, 1, 0]], True, ["outside", "blob"]),
        ([[0, 1500, 0, 1, 0, 1000, 0, 1, 0]], True, ["outside", "raw.bin"]),
        ([[0, 0, 0, 1, 0, 100, 0, 10, 99]], True, ["stride"]),
        ([[0, 0, 0, 1, 0, 100, 0, 5, 200]], True, ["gap", "blob"]),
        ([[0, 0, 0, 1, 0, 999, 2, 1, 0]], True, ["multiple"]),
        ([[0, 0, 0, 1, 0, 1000, 42, 1, 0]], True, ["kind"]),
        ([[0, 0, 0, 0, 0, 2, 0, 1, 0], [0, 0, 0, 1, 0, 1000, 0, 1, 0]], True, ["inline", "'v'"]),
        ([[3, 0, 0, 1, 0, 1000, 0, 1, 0]], False, ["source index"]),
        ([[0, 0, 5, 1, 0, 1000, 0, 1, 0]], False, ["output index"]),
        ([[0, 0, 0, 7, 0, 1000, 0, 1, 0]], False, ["record index"]),
        ([[0, -5, 0, 1, 0, 1000, 0, 1, 0]], True, ["negative"]),
    ],
    ids=["gap", "overlap", "dst-range", "src-range", "self-overlap", "strided-gap", "itemsize", "kind", "inline",
         "src-index", "out-index", "rec-index", "negative"],
)
def test_write_validation_errors(tmp_path, rows, names_output, needles):
    sources, outputs, out = _single_record_job(tmp_path)
    # One typed error for every broken plan rule, so callers can tell a bad plan from an I/O error.
    with pytest.raises(_core.PlanError) as ei:
        _core.write_archives(sources, outputs, ops_array(rows), 2)
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, msg
    if names_output:
        assert str(out) in msg and ("'blob'" in msg or "'v'" in msg)
    assert not out.exists()


def test_write_argument_errors(tmp_path):
    sources, outputs, out = _single_record_job(tmp_path)
    good = ops_array([[0, 0, 0, 1, 0, 1000, 0, 1, 0]])
    with pytest.raises(ValueError, match="inline"):
        _core.write_archives(sources, [(str(out), "arc", [("v", 3, b"3\n")])], ops_array([]), 1)
    with pytest.raises(ValueError, match="shape"):
        _core.write_archives(sources, outputs, np.zeros((1, 8), dtype=np.int64), 1)
    with pytest.raises(TypeError):
        _core.write_archives(sources, outputs, good.astype(np.float64), 1)
    with pytest.raises(ValueError, match="more than once"):
        _core.write_archives(sources, outputs + outputs, good, 1)
    with pytest.raises(ValueError, match="same file"):
        _core.write_archives(sources, [(sources[0], "arc", outputs[0][2])], good, 1)
    with pytest.raises(ValueError):
        _core.write_archives(sources, outputs, good, -1)
    assert not out.exists()
    assert os.path.getsize(sources[0]) == 2048
    # and the valid call works
    assert _core.write_archives(sources, outputs, good, 1)["records"] == 2
    with zipfile.ZipFile(out) as zf:
        assert zf.read("arc/blob") == (bytes(range(256)) * 8)[:1000]


@pytest.mark.parametrize("in_kernel,head", [(True, 4096), (True, 13), (False, 4096)],
                         ids=["copy_file_range", "pages-misaligned", "through-the-mapping"])
def test_raw_files_hold_their_records_back_to_back(tmp_path, in_kernel, head):
    """archive_name None: no ZIP framing, inline records as given, copied and converted records after
    them, holes for zero-fill; in one call with a torch archive. Plain copies give the same bytes
    whichever way they go: in the kernel (source and output offsets on the same page offset), or
    through the source's mapping (offsets that do not line up, or in-kernel copies off)."""
    src = tmp_path / "src.bin"
    payload = np.arange(3000, dtype=np.float32)
    src.write_bytes(payload.tobytes())
    raw, arc = tmp_path / "out.raw", tmp_path / "out.pt"
    header = b"H" * head
    outputs = [(str(raw), None, [("header", head, header), ("a", 4000, None), ("b", 3000, None), ("z", 9000, None)]),
               (str(arc), "arc", [("data/0", 4000, None)])]
    ops = ops_array([[0, 0, 0, 1, 0, 4000, 0, 1, 0],                          # floats 0..999 copied
                     [0, 4000, 0, 2, 0, 6000, _core.KIND_F32_TO_F16, 1, 0],   # 1000..2499 to half
                     [-1, 0, 0, 3, 0, 9000, 0, 1, 0],                          # zeros
                     [0, 8000, 1, 0, 0, 4000, 0, 1, 0]])
    stats = _core.write_archives([str(src)], outputs, ops, 2, window_bytes=1001, copy_in_kernel=in_kernel)
    data = raw.read_bytes()
    assert stats["files"] == 2 and len(data) == head + 4000 + 3000 + 9000
    assert data[:head] == header
    assert data[head:head + 4000] == payload[:1000].tobytes()
    assert data[head + 4000:head + 7000] == payload[1000:2500].astype(np.float16).tobytes()
    assert data[head + 7000:] == bytes(9000)
    with zipfile.ZipFile(arc) as zf:
        assert zf.read("arc/data/0") == payload[2000:3000].tobytes()


def test_raw_files_take_no_archive_name_and_keep_the_checks(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(64))
    out = str(tmp_path / "o.raw")
    with pytest.raises(_core.PlanError, match="is listed more than once"):
        _core.write_archives([str(src)], [(out, None, [("a", 4, b"abcd"), ("a", 4, b"abcd")])], ops_array([]), 1)
    with pytest.raises(_core.PlanError, match=r"record .a.: gap: bytes \[4, 8\) are not covered"):
        _core.write_archives([str(src)], [(out, None, [("a", 8, None)])], ops_array([[0, 0, 0, 0, 0, 4, 0, 1, 0]]), 1)
    assert not os.path.exists(out)


def test_a_series_is_archives_back_to_back_each_readable_from_its_slice(tmp_path):
    """An output with archive starts: one self-contained ZIP per group of records, each starting on a
    64-byte boundary where series_layout says, its offsets its own (zipfile and torch.load read it from
    its slice alone, CRCs checked); record names repeat across archives, not within one."""
    src = tmp_path / "src.bin"
    payload = np.arange(1000, dtype=np.float32)
    src.write_bytes(payload.tobytes())
    out = tmp_path / "f.distcp"
    records, starts, rows = [], [], []
    sizes = [3, 700, 0, 17]
    at = 0
    for k, n in enumerate(sizes):
        starts.append(len(records))
        records += [("head", 5, b"hello"), ("data/0", 4 * n, None), ("tail", 1, bytes([k]))]
        if n:
            rows.append([0, 4 * at, 0, len(records) - 2, 0, 4 * n, 0, 1, 0])
        at += n
    stats = _core.write_archives([str(src)], [(str(out), "archive", records, starts)], ops_array(rows), 2,
                                 window_bytes=1000)
    assert stats["files"] == 1 and stats["records"] == len(records)
    where = _core.series_layout("archive", [(n, size) for n, size, _ in records], starts)
    data = out.read_bytes()
    assert where[-1][0] + where[-1][1] == len(data)
    assert all(off % 64 == 0 for off, _ in where)
    at = 0
    for k, ((off, length), n) in enumerate(zip(where, sizes)):
        with zipfile.ZipFile(io.BytesIO(data[off:off + length])) as zf:
            assert zf.testzip() is None
            assert zf.read("archive/head") == b"hello" and zf.read("archive/tail") == bytes([k])
            assert zf.read("archive/data/0") == payload[at:at + n].tobytes()
        at += n


def test_a_series_refuses_bad_archive_starts(tmp_path):
    out = str(tmp_path / "f")
    recs = [("a", 1, b"x"), ("a", 1, b"y")]
    for starts, problem in (([1], "ascend from record 0"), ([0, 0], "ascend"), ([0, 2], "ascend"), ([], "ascend")):
        with pytest.raises(_core.PlanError, match=problem):
            _core.write_archives([], [(out, "archive", recs, starts)], ops_array([]), 1)
    with pytest.raises(_core.PlanError, match="is listed more than once"):
        _core.write_archives([], [(out, "archive", recs, [0])], ops_array([]), 1)
    with pytest.raises(ValueError, match="raw file"):
        _core.write_archives([], [(out, None, recs, [0, 1])], ops_array([]), 1)
    assert not os.path.exists(out)
    _core.write_archives([], [(out, "archive", recs, [0, 1])], ops_array([]), 1)
    with pytest.raises(ValueError, match="ascend"):
        _core.series_layout("archive", [("a", 1)], [1])


def test_kind_constants():
    names = ["COPY", "BF16_TO_F32", "F16_TO_F32", "F64_TO_F32", "I64_TO_F32", "I32_TO_F32", "I16_TO_F32",
             "I8_TO_F32", "U8_TO_F32", "BOOL_TO_F32", "F32_TO_BF16", "F32_TO_F16", "BF16_TO_F16", "F16_TO_BF16",
             "F64_TO_BF16", "F64_TO_F16"]
    assert [getattr(_core, "KIND_" + n) for n in names] == list(range(16))


# ----------------------------------------------------------------------------------------------
# execute_into


def test_execute_into_gathers(tmp_path):
    rng = np.random.default_rng(11)
    a = rng.standard_normal(4000).astype(np.float32)
    b = rng.standard_normal((30, 50)).astype(np.float32)
    h = rng.standard_normal(777).astype(np.float16)
    pa, pb, ph = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "h.bin"
    pa.write_bytes(b"\0" * 64 + a.tobytes())
    pb.write_bytes(b.tobytes())
    ph.write_bytes(b"\1" * 3 + h.tobytes())
    n_out = 20000
    expect = np.zeros(n_out, dtype=np.float32)
    rows = []
    # plain copy of a[100:1100] to elements [0, 1000)
    rows.append([0, 64 + 400, 0, 0, 0, 4000, 0, 1, 0])
    expect[0:1000] = a[100:1100]
    # b (30x50) written transposed-ish: each row lands with a stride of 60 floats
    rows.append([1, 0, 0, 0, 4 * 2000, 200, 0, 30, 240])
    for i in range(30):
        expect[2000 + 60 * i:2000 + 60 * i + 50] = b[i]
    # f16 -> f32 conversion from an odd source offset
    rows.append([2, 3, 0, 0, 4 * 5000, 777 * 2, _core.KIND_F16_TO_F32, 1, 0])
    expect[5000:5777] = h.astype(np.float32)
    # zero fill over pre-set garbage
    rows.append([-1, 0, 0, 0, 4 * 10000, 4000, 0, 1, 0])
    dst = np.full(n_out, 7.0, dtype=np.float32)
    mask = np.zeros(n_out, dtype=bool)
    mask[:1000] = mask[5000:5777] = mask[10000:11000] = True
    for i in range(30):
        mask[2000 + 60 * i:2000 + 60 * i + 50] = True
    expect[~mask] = 7.0
    ops = ops_array(rows)
    written = _core.execute_into([str(pa), str(pb), str(ph)], ops, dst, 2, window_bytes=1000)
    assert written == 4000 + 30 * 200 + 777 * 4 + 4000
    assert np.array_equal(dst.view(np.uint32), expect.view(np.uint32))

    ba = bytearray(n_out * 4)
    _core.execute_into([str(pa), str(pb), str(ph)], ops, ba, 1)
    mv = memoryview(bytearray(n_out * 4))
    _core.execute_into([str(pa), str(pb), str(ph)], ops, mv, 4)
    exp0 = expect.copy()
    exp0[~mask] = 0
    assert bytes(ba) == exp0.tobytes() == bytes(mv)


@pytest.fixture
def shm_dir():
    """A private folder on /dev/shm (tmpfs), removed after the test."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="pyckpt-test-", dir="/dev/shm")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_execute_into_reads_plain_runs_of_files_in_memory_without_mapping_them(tmp_path, shm_dir):
    """A window that is one plain run of a file on tmpfs (a memory tier's slot) is read by the kernel straight
    into the buffer: no fault per source page. The same bytes, across window edges and from an odd offset.
    A file on a disk, and a cast from any file, still go through the mapping (its read-ahead stops at the
    run; an evicted run streams faster than by pread)."""
    with open("/proc/mounts") as f:
        assert any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f), "no tmpfs at /dev/shm"
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    h = rng.standard_normal(1000).astype(np.float16)

    def mapped(path):
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(str(path)) for line in f)

    def gather(path, dst, kind, n):
        seen = []
        _core.execute_into([str(path)], ops_array([[0, 3, 0, 0, 0, n, kind, 1, 0]]), dst, 2,
                           lambda done, total: seen.append(mapped(path)) or True, window_bytes=(1 << 20) + 17)
        assert seen
        return any(seen)

    for folder, in_memory in ((shm_dir, True), (tmp_path, False)):
        plain, cast = folder / "plain.bin", folder / "cast.bin"
        plain.write_bytes(b"\7" * 3 + data.tobytes())
        cast.write_bytes(b"\7" * 3 + h.tobytes())
        dst = np.zeros(data.size, dtype=np.uint8)
        assert gather(plain, dst, 0, data.size) is not in_memory, (folder, "mapped" if in_memory else "not mapped")
        assert np.array_equal(dst, data)
        out = np.zeros(1000, dtype=np.float32)
        assert gather(cast, out, _core.KIND_F16_TO_F32, 2000)
        assert np.array_equal(out, h.astype(np.float32))


def test_execute_into_errors(tmp_path):
    p = tmp_path / "s.bin"
    p.write_bytes(b"x" * 100)
    dst = np.zeros(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="out == 0"):
        _core.execute_into([str(p)], ops_array([[0, 0, 1, 0, 0, 5, 0, 1, 0]]), dst, 1)
    with pytest.raises(ValueError, match="outside"):
        _core.execute_into([str(p)], ops_array([[0, 0, 0, 0, 5, 6, 0, 1, 0]]), dst, 1)
    with pytest.raises(ValueError, match="outside"):
        _core.execute_into([str(p)], ops_array([[0, 99, 0, 0, 0, 2, 0, 1, 0]]), dst, 1)
    with pytest.raises((TypeError, BufferError)):
        _core.execute_into([str(p)], ops_array([[0, 0, 0, 0, 0, 5, 0, 1, 0]]), b"0123456789", 1)
    with pytest.raises(FileNotFoundError) as ei:
        _core.execute_into([str(tmp_path / "nope.bin")], ops_array([[0, 0, 0, 0, 0, 5, 0, 1, 0]]), dst, 1)
    assert "nope.bin" in str(ei.value)
    assert _core.execute_into([str(p)], ops_array([]), dst, 1) == 0


def test_type_stub_matches_the_module():
    """pyckpt/_core.pyi must name exactly what the binding exports, so the two cannot drift apart."""
    import ast
    import pathlib

    stub = pathlib.Path(__file__).resolve().parents[2] / "pyckpt" / "_core.pyi"
    tree = ast.parse(stub.read_text())
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    declared -= {"_Path", "_Buffer", "_Progress"}
    exported = {n for n in dir(_core) if not n.startswith("__")}
    assert declared == exported


def test_op_columns_come_from_the_native_schema():
    """The op table's column order is defined once in C++ (ops.hpp) and exported as OP_COLUMNS."""
    assert _core.OP_COLUMNS == ("src", "src_off", "out", "rec", "dst_off", "nbytes", "kind", "rows", "stride",
                                "src_stride")
