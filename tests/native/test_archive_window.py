"""The native archive reader inside a byte window of a file (``_core.Archive(path, offset=, length=)``
and ``read_archive_heads(..., windows=)``), as the DCP reader opens each record of a ``.distcp``:
member offsets are the file's, a window past the end or one that cuts its archive is refused, garbage
around the window is never read, and both entry points agree."""

from __future__ import annotations

import io
import os
import zipfile

import pytest

from pyckpt import _core


def _archive(members: dict, prefix: str = "archive") -> bytes:
    """A stored ZIP of ``members`` under ``prefix``/, as torch.save lays one out (no compression)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(f"{prefix}/{name}", data)
    return buf.getvalue()


MEMBERS = {"data.pkl": b"\x80\x02}q\x00.", "data/0": bytes(range(256)) * 3, "version": b"3\n"}


@pytest.fixture
def framed(tmp_path):
    """A file of garbage, an archive, garbage, a second archive, garbage: (path, [(offset, length)], archives)."""
    first = _archive(MEMBERS)
    second = _archive({"data.pkl": b"\x80\x02]q\x00.", "data/7": b"\xab" * 100}, prefix="other")
    # garbage that looks like ZIP records, so a reader that strays outside its window finds something
    garbage = b"PK\x05\x06" + os.urandom(300) + b"PK\x01\x02" + os.urandom(123)
    parts, windows, at = [], [], 0
    for piece in (garbage, first, garbage[::-1], second, garbage):
        if piece in (first, second):
            windows.append((at, len(piece)))
        parts.append(piece)
        at += len(piece)
    path = tmp_path / "records.bin"
    path.write_bytes(b"".join(parts))
    return str(path), windows, (first, second)


def _plain(tmp_path, data: bytes) -> str:
    path = tmp_path / "plain.zip"
    path.write_bytes(data)
    return str(path)


def test_member_offsets_are_the_files(framed, tmp_path):
    path, windows, (first, _) = framed
    raw = open(path, "rb").read()
    plain = _core.Archive(_plain(tmp_path, first))
    (offset, length), = windows[:1]
    with _core.Archive(path, offset=offset, length=length) as a:
        assert a.prefix == "archive"
        assert a.size == length
        got = {name: (off, size, crc) for name, off, size, crc in a.members()}
        want = {name: (off + offset, size, crc) for name, off, size, crc in plain.members()}
        assert got == want
        for name, (off, size, _) in got.items():
            assert raw[off:off + size] == MEMBERS[name.split("/", 1)[1]]
            assert a.read(name) == MEMBERS[name.split("/", 1)[1]]
    plain.close()


def test_second_window_in_the_same_file(framed):
    path, windows, (_, second) = framed
    offset, length = windows[1]
    with _core.Archive(path, offset=offset, length=length) as a:
        assert a.prefix == "other"
        assert a.read("other/data/7") == b"\xab" * 100
        assert all(off >= offset and off + size <= offset + length for _, off, size, _ in a.members())


def test_heads_with_windows_equal_the_archive(framed):
    path, windows, _ = framed
    heads = _core.read_archive_heads([path, path], "data.pkl", 1 << 20, 0, windows)
    for (offset, length), head in zip(windows, heads):
        assert head is not None
        size, prefix, members, pkl = head
        with _core.Archive(path, offset=offset, length=length) as a:
            assert size == a.size == length
            assert prefix == a.prefix
            assert members == {name: (off, n, crc) for name, off, n, crc in a.members()}
            assert pkl == a.read(f"{prefix}/data.pkl")


def test_heads_without_windows_read_whole_files(framed, tmp_path):
    _, _, (first, _) = framed
    plain = _plain(tmp_path, first)
    (whole,) = _core.read_archive_heads([plain], "data.pkl", 1 << 20, 0)
    (windowed,) = _core.read_archive_heads([plain], "data.pkl", 1 << 20, 0, [(0, len(first))])
    assert whole == windowed


@pytest.mark.parametrize("cut", ["start_late", "end_early", "one_byte_short", "past_eof", "offset_past_eof",
                                 "empty"])
def test_bad_windows_are_refused(framed, cut):
    path, windows, _ = framed
    offset, length = windows[0]
    size = os.path.getsize(path)
    window = {"start_late": (offset + 1, length - 1), "end_early": (offset, length - 40),
              "one_byte_short": (offset, length - 1), "past_eof": (size - 10, 20),
              "offset_past_eof": (size + 1, 0), "empty": (offset, 0)}[cut]
    with pytest.raises(_core.ArchiveError) as caught:
        _core.Archive(path, offset=window[0], length=window[1])
    assert path in str(caught.value)
    (head,) = _core.read_archive_heads([path], "data.pkl", 1 << 20, 0, [window])
    assert head is None


def test_window_past_the_end_says_so(framed):
    path, _, _ = framed
    size = os.path.getsize(path)
    with pytest.raises(_core.ArchiveError, match="past the end"):
        _core.Archive(path, offset=size - 5, length=10)
    with pytest.raises(_core.ArchiveError, match="past the end"):
        _core.Archive(path, offset=2 ** 63, length=2 ** 63)


def test_window_holding_garbage_only(framed):
    path, windows, _ = framed
    with pytest.raises(_core.ArchiveError):
        _core.Archive(path, offset=0, length=windows[0][0])


def test_windows_of_one_batch_fail_alone(framed):
    path, windows, _ = framed
    bad = (windows[0][0] + 1, windows[0][1] - 1)
    heads = _core.read_archive_heads([path, path, path], "data.pkl", 1 << 20, 2, [windows[0], bad, windows[1]])
    assert heads[0] is not None and heads[1] is None and heads[2] is not None


def test_large_window_is_mapped(framed, tmp_path):
    # an archive over the read limit is mapped rather than read in; offsets stay absolute all the same
    big = _archive({"data.pkl": b"\x80\x02.", "data/0": os.urandom(9 << 20)})
    lead = os.urandom(4097)
    path = tmp_path / "big.bin"
    path.write_bytes(lead + big + lead)
    with _core.Archive(str(path), offset=len(lead), length=len(big)) as a:
        members = {name: (off, n) for name, off, n, _ in a.members()}
        off, n = members["archive/data/0"]
        assert off >= len(lead) and n == 9 << 20
        with open(path, "rb") as f:
            f.seek(off)
            assert f.read(n) == a.read("archive/data/0")


@pytest.mark.parametrize("windows", [[(0, 10)], [(0, 10), (0, 10), (0, 10)]])
def test_window_count_must_match_paths(framed, windows):
    path, _, _ = framed
    with pytest.raises((ValueError, TypeError)):
        _core.read_archive_heads([path, path], "data.pkl", 1 << 20, 0, windows)
