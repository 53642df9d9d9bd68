"""Below Python: the native reader and executor under hostile bytes and failing syscalls.

Member names that are not text, inputs that shrink while memory-mapped (SIGBUS), FIFOs, output
paths outside the staging root or already present, and injected ENOSPC/EIO/... on every output
syscall. Each must end in an error naming the file, with nothing partial left behind. Cases that
could kill the interpreter if the guard failed run in a subprocess, so a regression fails the test
instead of the whole session.
"""

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import zipfile

import numpy as np
import pytest

import pyckpt
from pyckpt import _core
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.errors import CheckpointFormatError
from pyckpt.execution.leftovers import stale_entries

from compare import diff_folders, digest
from edit import copy_checkpoint
from native_hooks import hooks


def ops_array(rows):
    return np.array(rows, dtype=np.int64).reshape(-1, 9)


def _python(script, *args, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=tempfile.gettempdir())


# -- member names ------------------------------------------------------------------------------------

PLACEHOLDER = b"QQQQQQ"


def _archive_with_name(path, raw_name: bytes):
    """A stored ZIP whose member name is `raw_name` (same length as the placeholder) in both headers."""
    assert len(raw_name) == len(PLACEHOLDER)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("arc/data.pkl", b"x")
        zf.writestr("arc/" + PLACEHOLDER.decode(), b"payload")
    data = path.read_bytes()
    assert data.count(PLACEHOLDER) == 2  # local header and central directory
    path.write_bytes(data.replace(PLACEHOLDER, raw_name))


BAD_MEMBER_NAMES = {
    "latin1": b"caf\xe9QQ",
    "lone-continuation": b"\x80QQQQQ",
    "overlong-slash": b"\xc0\xafQQQQ",
    "surrogate": b"\xed\xa0\x80QQQ",
    "newline": b"QQ\nQQQ",
    "nul": b"QQ\x00QQQ",
    "escape": b"\x1b[31mQ",
    "c1-control": b"\xc2\x85QQQQ",
}


@pytest.mark.parametrize("raw", BAD_MEMBER_NAMES.values(), ids=BAD_MEMBER_NAMES.keys())
def test_member_name_that_is_not_text_is_refused_on_one_line(raw, tmp_path):
    path = tmp_path / "bad.pt"
    _archive_with_name(path, raw)
    with pytest.raises(_core.ArchiveError) as ei:
        _core.Archive(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: member '") and "not UTF-8 text without control characters" in msg, msg
    assert "\n" not in msg and "\x00" not in msg and "\x1b" not in msg
    bad = next(b for b in raw if b < 0x20 or b >= 0x80)
    assert f"\\x{bad:02x}" in msg, msg
    # The Python layer turns it into the input error class, still one line naming the file.
    with pytest.raises(CheckpointFormatError) as ei:
        SourceFile(str(path))
    assert str(path) in str(ei.value) and "\n" not in str(ei.value)


def test_clean_non_ascii_member_names_are_accepted(tmp_path):
    path = tmp_path / "ok.pt"
    _archive_with_name(path, "é_ü_".encode())  # 2 + 1 + 2 + 1 bytes: valid UTF-8 text
    with _core.Archive(path) as ar:
        assert "arc/é_ü_" in [m[0] for m in ar.members()]


def test_missing_member_lookup_escapes_the_name(tmp_path):
    path = tmp_path / "ok.pt"
    _archive_with_name(path, PLACEHOLDER)
    with _core.Archive(path) as ar, pytest.raises(KeyError) as ei:
        ar.read("arc/\nnot there")
    assert "\\x0a" in str(ei.value) and "\n" not in str(ei.value)


# -- inputs that shrink under the mapping (SIGBUS) ---------------------------------------------------

SHRINK_ARCHIVE = """
    import os, sys, torch
    from pyckpt import _core
    path = sys.argv[1]
    torch.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, path)
    with _core.Archive(path) as ar:
        member = next(m for m in ar.members() if m[0].endswith("/data/0"))
        os.truncate(path, 4096)  # another process truncates the shard after we mapped it
        try:
            ar.read(member[0])
        except _core.SourceChangedError as exc:
            print("REFUSED", exc)
            sys.exit(0)
    print("READ ZEROS WITHOUT NOTICE")
    sys.exit(1)
"""


def test_archive_read_after_the_file_shrank_raises_instead_of_sigbus(tmp_path):
    path = tmp_path / "shard.pt"
    proc = _python(SHRINK_ARCHIVE, path)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert f"REFUSED {path}: became shorter while it was being read" in proc.stdout


# The executor maps sources lazily and streams; the progress callback (on the calling thread)
# truncates the source while workers still have windows to read. The source grows until the
# truncation lands mid-copy, so the test never passes without exercising the fault.
SHRINK_EXECUTOR = """
    import os, sys, numpy as np
    from pyckpt import _core
    mode, folder = sys.argv[1], sys.argv[2]
    src = os.path.join(folder, "src.bin")
    window = 1 << 20
    for size in (64 << 20, 256 << 20, 1 << 30):
        with open(src, "wb") as f:
            f.truncate(size)  # sparse: fast to read, no disk used
        seen = {}
        def progress(done, total):
            if not seen:
                seen["remaining"] = total - done
                os.truncate(src, 0)
        ops = np.array([[0, 0, 0, 1, 0, size, 0, 1, 0]], dtype=np.int64)
        out = os.path.join(folder, "out.pt")
        if os.path.exists(out):
            os.remove(out)  # a smaller try finished before the truncation
        try:
            if mode == "write":
                _core.write_archives([src], [(out, "arc", [("v", 2, b"3\\n"), ("blob", size, None)])], ops, 1,
                                     False, progress, window_bytes=window)
            elif mode.startswith("raw"):  # copied in the kernel by descriptor, or through the mapping
                head = b"h" * 4096  # the copy then starts on a page boundary, as in the source
                _core.write_archives([src], [(out, None, [("h", 4096, head), ("blob", size, None)])], ops, 1,
                                     False, progress, window_bytes=window, copy_in_kernel=mode == "raw")
            else:
                ops[0, 3] = 0
                _core.execute_into([src], ops, np.empty(size, np.uint8), 1, progress, window_bytes=window)
        except _core.SourceChangedError as exc:
            if seen.get("remaining", 0) < 4 * window:
                continue  # truncated too late to matter; try a larger source
            assert not os.path.exists(out), "partial output left behind"
            print("REFUSED", exc)
            sys.exit(0)
        if seen.get("remaining", 0) >= 4 * window:
            print("COPIED ZEROS WITHOUT NOTICE")
            sys.exit(1)
    print("NEVER TRUNCATED MID-COPY")
    sys.exit(2)
"""


@pytest.mark.parametrize("mode", ["write", "gather", "gather-in-memory", "raw", "raw-mapped"])
def test_executor_source_shrinking_mid_copy_raises_and_leaves_nothing(mode, tmp_path):
    folder = tmp_path
    if mode == "gather-in-memory":  # a file on tmpfs: its plain runs are read by pread, not mapped
        folder = tempfile.mkdtemp(prefix="pyckpt-test-", dir="/dev/shm")
    try:
        proc = _python(SHRINK_EXECUTOR, mode, folder, timeout=300)
    finally:
        if folder is not tmp_path:
            shutil.rmtree(folder, ignore_errors=True)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "REFUSED source '" in proc.stdout
    # A source is mapped lazily: the shrink shows as a read past the end of a live mapping, or, where the
    # in-kernel copy came up short and maps the source to go on after the truncation (the executor's
    # prefetch), as a source smaller than the plan validated. Both are the same refusal (SourceChangedError,
    # nothing left behind, checked in the script); which one comes depends on when the truncation lands.
    assert "became shorter while it was being read" in proc.stdout or \
        (mode.startswith("raw") and "bytes after validation (ops read up to byte" in proc.stdout), proc.stdout


def test_in_kernel_copy_refuses_a_source_replaced_after_validation(tmp_path):
    """The in-kernel copy reopens a source by path: another file renamed over it after the plan
    was validated is refused, not copied, and nothing is left behind. The sources grow until the
    replacement lands mid-copy, so the test never passes without exercising it."""
    src, other, out = tmp_path / "src.bin", tmp_path / "other.bin", tmp_path / "out.raw"
    window = 1 << 20
    for size in (64 << 20, 256 << 20, 1 << 30):
        for p in (src, other):
            with open(p, "wb") as f:
                f.truncate(size)  # sparse: fast to read, no disk used
        seen = {}

        def progress(done, total):
            if not seen:
                seen["remaining"] = total - done
                os.replace(other, src)

        ops = np.array([[0, 0, 0, 1, 0, size, 0, 1, 0]], dtype=np.int64)
        if out.exists():
            out.unlink()  # a smaller try finished before the replacement
        try:
            # a page-sized head puts the copy on a page boundary, as in the source: copied in the kernel
            _core.write_archives([str(src)], [(str(out), None, [("h", 4096, b"h" * 4096), ("blob", size, None)])],
                                 ops, 1, False, progress, window_bytes=window)
        except _core.SourceChangedError as exc:
            assert "was replaced by another file after it was validated" in str(exc) and str(src) in str(exc)
            assert not out.exists(), "partial output left behind"
            return
        assert seen.get("remaining", 0) < 4 * window, "copied from a replaced source without notice"
    pytest.fail("the replacement never landed mid-copy")


def test_python_sigbus_handler_chain_still_reports_real_faults(tmp_path):
    """A SIGBUS outside pyckpt's mappings still reaches the handler that was there before."""
    script = """
        import faulthandler, mmap, os, sys
        from pyckpt import _core
        path = sys.argv[1]
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
        ar_path = path + ".zip"
        import zipfile
        with zipfile.ZipFile(ar_path, "w") as zf:
            zf.writestr("a/data.pkl", b"x")
        _core.Archive(ar_path).close()  # installs pyckpt's handler
        faulthandler.enable()  # installed after ours; ours is put back in front on the next mapping
        _core.Archive(ar_path).close()
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 8192, prot=mmap.PROT_READ)
        os.truncate(path, 0)
        m[4096]  # not one of pyckpt's mappings: must still die of SIGBUS
        print("SURVIVED")
    """
    proc = _python(script, tmp_path / "f.bin")
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)
    assert "SURVIVED" not in proc.stdout
    assert "Bus error" in proc.stderr  # faulthandler, the previous handler, ran


# -- special files and output paths ------------------------------------------------------------------

def test_fifo_source_is_refused_without_blocking(tmp_path):
    script = """
        import errno, os, sys, numpy as np
        from pyckpt import _core
        fifo, out = sys.argv[1], sys.argv[2]
        os.mkfifo(fifo)
        ops = np.array([[0, 0, 0, 1, 0, 8, 0, 1, 0]], dtype=np.int64)
        for call in ("write", "archive"):
            try:
                if call == "write":
                    _core.write_archives([fifo], [(out, "arc", [("v", 2, b"3\\n"), ("b", 8, None)])], ops, 1)
                else:
                    _core.Archive(fifo)
            except OSError as exc:
                assert exc.errno == errno.EINVAL and "not a regular file" in str(exc) and fifo in str(exc), exc
                continue
            sys.exit(1)
        assert not os.path.exists(out)
        print("REFUSED")
    """
    proc = _python(script, tmp_path / "shard.pt", tmp_path / "o.pt", timeout=60)  # a hang fails by timeout
    assert proc.returncode == 0 and "REFUSED" in proc.stdout, (proc.stdout, proc.stderr)


def _job(tmp_path, names=("a.pt", "b.pt", "c.pt"), raw=()):
    """Three outputs of an inline record and a copied one; those named in `raw` are raw files."""
    src = tmp_path / "raw.bin"
    src.write_bytes(bytes(range(256)) * 64)
    root = tmp_path / "stage"
    root.mkdir(exist_ok=True)
    outputs = [(str(root / n), None if n in raw else "arc", [("v", 2, b"3\n"), ("blob", 4096, None)]) for n in names]
    ops = ops_array([[0, 4096 * i, i, 1, 0, 4096, 0, 1, 0] for i in range(len(names))])
    return [str(src)], outputs, ops, root


@pytest.mark.parametrize("name", ["../escape.pt", "sub/../../escape.pt", "./a.pt", "sub//a.pt", "/abs.pt"])
def test_output_outside_the_root_is_refused_before_anything_is_written(name, tmp_path):
    sources, outputs, ops, root = _job(tmp_path)
    bad = name if name.startswith("/") else f"{root}/{name}"
    outputs[1] = (bad, *outputs[1][1:])
    with pytest.raises(_core.PlanError, match="is not inside the output root"):
        _core.write_archives(sources, outputs, ops, 2, root=str(root))
    assert os.listdir(root) == [] and not (tmp_path / "escape.pt").exists()


def test_outputs_inside_the_root_are_written(tmp_path):
    sources, outputs, ops, root = _job(tmp_path)
    _core.write_archives(sources, outputs, ops, 2, root=str(root) + "/")
    assert sorted(os.listdir(root)) == ["a.pt", "b.pt", "c.pt"]
    with zipfile.ZipFile(root / "b.pt") as zf:
        assert zf.read("arc/blob") == (bytes(range(256)) * 64)[4096:8192]


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_existing_file_or_symlink_at_an_output_path_is_not_written_through(kind, tmp_path):
    sources, outputs, ops, root = _job(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    if kind == "file":
        shutil.copy(victim, root / "b.pt")
    else:
        os.symlink(victim, root / "b.pt")
    with pytest.raises(FileExistsError) as ei:
        _core.write_archives(sources, outputs, ops, 1, root=str(root))
    assert str(root / "b.pt") in str(ei.value)
    assert victim.read_text() == "keep me"
    # The outputs this call created are removed; what was there before is left alone.
    assert os.listdir(root) == ["b.pt"]


# -- injected I/O errors in the executor -------------------------------------------------------------

@pytest.fixture
def faults():
    testing = hooks()  # the test build's: a build without them fails here, saying so
    testing.clear_faults()
    yield testing.inject_fault
    testing.clear_faults()


CALLS = [("open", errno.EMFILE), ("write", errno.ENOSPC), ("write", errno.EIO), ("fsync", errno.EIO),
         ("close", errno.EIO)]


@pytest.mark.parametrize("raw", [(), ("b.pt", )], ids=["zip", "zip+raw"])
@pytest.mark.parametrize("after", [0, 1, 2])
@pytest.mark.parametrize("call,err", CALLS, ids=[f"{c}-{errno.errorcode[e]}" for c, e in CALLS])
def test_injected_fault_names_the_file_and_removes_every_output(call, err, after, raw, faults, tmp_path):
    sources, outputs, ops, root = _job(tmp_path, raw=raw)
    faults(call, err, after)
    with pytest.raises(OSError) as ei:
        _core.write_archives(sources, outputs, ops, 2, fsync=True, root=str(root))
    assert ei.value.errno == err
    assert any(o[0] in str(ei.value) for o in outputs), str(ei.value)
    assert os.listdir(root) == []
    # Injection is one-shot: the same job then succeeds.
    _core.write_archives(sources, outputs, ops, 2, fsync=True, root=str(root))
    assert sorted(os.listdir(root)) == ["a.pt", "b.pt", "c.pt"]


def test_inject_fault_rejects_unknown_calls():
    with pytest.raises(ValueError, match="open, write, fsync, close"):
        hooks().inject_fault("rename", errno.EIO)


# -- the same faults through a whole conversion ------------------------------------------------------

NAME = "s1_fp32_dp2"


E2E = [(c, e, a) for c, e in CALLS for a in (0, 7)]


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "overwrite"])
@pytest.mark.parametrize("call,err,after", E2E, ids=[f"{c}-{errno.errorcode[e]}-{a}" for c, e, a in E2E])
def test_conversion_survives_injected_fault(call, err, after, existing, faults, checkpoints, deepspeed_universal,
                                            tmp_path):
    root, _ = copy_checkpoint(checkpoints[NAME].tag_dir, tmp_path)
    before = digest(root)
    out = tmp_path / "out" / "u"
    if existing:
        out.mkdir(parents=True)
        (out / "OLD").write_text("previous output")
        (out.parent / "latest_universal").write_text("u")
    faults(call, err, after)
    with pytest.raises(OSError) as ei:
        pyckpt.convert_to_universal(root, out, overwrite=existing, progress=False, fsync=True)
    assert ei.value.errno == err and str(out.parent) in str(ei.value), str(ei.value)
    # Complete (old) or absent, the pointer untouched, no orphan, the input as it was.
    if existing:
        assert sorted(os.listdir(out)) == ["OLD"] and (out.parent / "latest_universal").read_text() == "u"
    else:
        assert not out.exists() and not (out.parent / "latest_universal").exists()
    assert stale_entries(str(out.parent), "u") == []
    assert digest(root) == before
    pyckpt.convert_to_universal(root, out, overwrite=existing, progress=False)
    assert diff_folders(str(deepspeed_universal[NAME]), str(out)) == []


# -- Ctrl-C at any moment, even while Python is still importing -------------------------------------



def test_executor_refusing_a_plan_becomes_a_pyckpt_error(checkpoints, tmp_path, monkeypatch):
    """A plan the executor refuses (a planner bug, or input that got past the planner's checks) is a
    one-line pyckpt error naming the staging folder, and nothing is published."""
    from pyckpt.errors import PlanCheckError
    from pyckpt.execution import executor

    real = executor.compile_plan

    def with_a_gap(plan, root):
        sources, outputs, ops, nbytes = real(plan, root)
        return sources, outputs, np.asarray(ops)[1:], nbytes  # the first copy is lost: its record has a gap

    monkeypatch.setattr(executor, "compile_plan", with_a_gap)
    out = tmp_path / "out" / "u"
    with pytest.raises(PlanCheckError) as ei:
        pyckpt.convert_to_universal(checkpoints[NAME].root, out, progress=False)
    msg = str(ei.value)
    assert "\n" not in msg and "failed the executor's checks" in msg and "gap" in msg and str(out.parent) in msg
    assert not out.exists() and stale_entries(str(out.parent), "u") == []


# -- pickle memo bombs -------------------------------------------------------------------------------

@pytest.mark.parametrize("bomb", [b"\x80\x02]r\x00\x00\x00\x40.", b"(lp1073741824\n.", b"\x80\x02]q\x05."],
                         ids=["LONG_BINPUT", "PUT", "BINPUT"])
def test_memo_index_beyond_the_stores_is_refused_before_unpickling(bomb):
    """CPython's unpickler would allocate and zero a memo array sized by the index (16 GiB for 2^30)."""
    from pyckpt.formats.pickle_read import loads
    with pytest.raises(CheckpointFormatError, match=r"^bomb\.pkl: memo index \d+ \(at byte \d+\) is beyond the"):
        loads(bomb, where="bomb.pkl")


@pytest.mark.parametrize("protocol", range(0, 6))
def test_memo_scan_agrees_with_pickletools(protocol):
    import pickle
    import pickletools
    shared = [1, 2.5, "x", b"yy", (3, 4), {5, 6}, frozenset([7]), None, True, 10**30, -5, bytearray(b"z")]
    obj = {"a": shared, "b": "é" * 300, "c": list(range(300)), "d": shared, "e": [shared] * 3}
    data = pickle.dumps(obj, protocol=protocol)
    ops = list(pickletools.genops(data))
    stores = sum(op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE") for op, _, _ in ops)
    explicit = [arg for op, arg, _ in ops if op.name in ("PUT", "BINPUT", "LONG_BINPUT")]
    got = _core.scan_pickle(data)
    assert (got.stores, got.max_index, got.overlong_at) == (stores, max(explicit, default=-1), -1)
    assert stores > 0


@pytest.mark.parametrize("bomb", [b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"xx.",
                                  b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + b"N.",
                                  b"\x80\x02X\xff\xff\xff\x7fab.", b"\x80\x02\x8b\x00\x00\x00\x40\x01."],
                         ids=["BINBYTES8", "FRAME", "BINUNICODE", "LONG4"])
def test_length_prefix_past_the_end_is_refused_before_allocating(bomb):
    from pyckpt.formats.pickle_read import loads
    with pytest.raises(CheckpointFormatError, match=r"^bomb\.pkl: the argument of the opcode at byte 2 claims more"):
        loads(bomb, where="bomb.pkl")
