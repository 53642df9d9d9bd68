"""Crashes, kills and concurrent runs: OUTPUT is always complete (old or new) or absent, the input is
untouched, and nothing a dead run left survives the next run (or --clean).

Runs are real `python -m pyckpt.convert` processes. A kill lands at a named step through the
PYCKPT_TEST_KILL_AT hook (SIGKILL: no clean-up code runs), or at a barrier inside the copy that the
test waits for before signalling the process."""

import errno
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from child_signals import default_signals
from compare import diff_folders, digest
from edit import copy_checkpoint
from pyckpt.execution.leftovers import stale_entries
from pyckpt.execution.output_lock import OutputLock

NAME = "s1_fp32_dp2"


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    root, _ = copy_checkpoint(checkpoints[NAME].tag_dir, tmp_path)
    return root


@pytest.fixture
def reference(deepspeed_universal):
    return str(deepspeed_universal[NAME])




# A runner that can bend the process before the CLI starts: make the atomic renames unavailable
# (the two-rename fallback), stop inside the copy at a barrier (until T_BARRIER.go exists), limit
# the file size. The command then starts as `python -m pyckpt.convert` does, start-up handler included.
RUNNER = textwrap.dedent("""
    import errno, os, runpy, sys, time
    from pyckpt.execution import publisher
    from pyckpt.native import _core
    if os.environ.get("T_NO_RENAMEAT2"):
        def unsupported(*a):
            raise OSError(errno.EINVAL, "unsupported here")
        publisher._core.rename_exchange = unsupported
        publisher._core.rename_noreplace = unsupported
    barrier = os.environ.get("T_BARRIER")
    if barrier:
        real = _core.write_archives
        def paused(sources, outputs, ops, workers, fsync, progress, *a, **k):
            def hold(done, total):
                open(barrier, "w").close()
                while not os.path.exists(barrier + ".go"):
                    time.sleep(0.05)
            return real(sources, outputs, ops, workers, fsync, hold, *a, **k)
        _core.write_archives = paused
    runpy.run_module("pyckpt.convert", run_name="__main__", alter_sys=True)
""")


def _start(*args, env=None, preexec_fn=None):
    return subprocess.Popen([sys.executable, "-c", RUNNER, *map(str, args)], cwd=tempfile.gettempdir(),
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_signals(preexec_fn))


def _run(*args, env=None, preexec_fn=None, timeout=120):
    proc = _start(*args, env=env, preexec_fn=preexec_fn)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _old_output(out):
    """An existing OUTPUT that a run may replace only with --overwrite: recognisable by a marker."""
    out.mkdir(parents=True)
    (out / "OLD").write_text("the previous output")
    (out.parent / "latest_universal").write_text(out.name)


def _state(out, reference):
    """'new' (complete, bit-equal to DeepSpeed's), 'old' (the marker folder) or 'absent'."""
    if not out.exists():
        return "absent"
    if (out / "OLD").exists():
        assert sorted(os.listdir(out)) == ["OLD"], os.listdir(out)
        return "old"
    assert diff_folders(reference, str(out)) == []
    return "new"


def _pointer(out):
    p = out.parent / "latest_universal"
    return p.read_text() if p.exists() else None


POINTS = ["before-publish", "after-publish", "before-pointer-rename", "after-pointer"]


# Every step of every publishing path; only the two-rename swap of an existing output has a step
# between its renames.
KILLS = [(p, e, f) for p in POINTS for e in (False, True) for f in (False, True)] + [("between-renames", True, True)]


@pytest.mark.parametrize("point,existing,fallback", KILLS,
                         ids=[f"{p}-{'overwrite' if e else 'fresh'}-{'two-renames' if f else 'renameat2'}"
                              for p, e, f in KILLS])
def test_kill_at_every_step_leaves_old_or_new_and_no_orphan_after_next_run(point, existing, fallback, ckpt,
                                                                            reference, tmp_path):
    out = tmp_path / "out" / "u"
    if existing:
        _old_output(out)
    else:
        out.parent.mkdir()
    before = digest(ckpt)
    env = {"PYCKPT_TEST_KILL_AT": point, **({"T_NO_RENAMEAT2": "1"} if fallback else {})}
    code, err = _run(ckpt, out, "--overwrite", "--quiet", env=env)
    assert code == -signal.SIGKILL, err

    state = _state(out, reference)
    published = point not in ("before-publish", "between-renames")
    if point == "between-renames":
        # the old output is set aside, the new one not yet in: the one moment OUTPUT is absent, and
        # the next run (or --clean) renames the old one back first
        assert state == "absent"
        assert any(".pyckpt-old-" in n for n in stale_entries(str(out.parent), "u"))
    else:
        assert state == ("new" if published else ("old" if existing else "absent"))
    if _pointer(out) is not None:
        assert _pointer(out) == "u"
    assert digest(ckpt) == before

    if point == "between-renames":
        code, err = _run("--clean", out)
        assert code == 0, err
        assert _state(out, reference) == "old" and "restored" in err
    code, err = _run(ckpt, out, "--overwrite", "--quiet")
    assert code == 0, err
    assert _state(out, reference) == "new" and _pointer(out) == "u"
    assert stale_entries(str(out.parent), "u") == []
    assert sorted(os.listdir(out.parent)) == ["latest_universal", "u"]  # the killed run's lock file too
    assert digest(ckpt) == before


def _start_paused(ckpt, tmp_path, preexec_fn=None):
    """A conversion into tmp_path/out/u held inside its copy (until tmp_path/barrier.go exists):
    staging exists, nothing is published."""
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    barrier = tmp_path / "barrier"
    proc = _start(ckpt, out, env={"T_BARRIER": str(barrier)}, preexec_fn=preexec_fn)
    try:
        _wait_for(barrier, proc)
    except BaseException:
        proc.kill()
        proc.communicate(timeout=60)
        raise
    return proc, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda sig: sig.name)
def test_signal_mid_copy_cleans_up_and_says_so(sig, ckpt, tmp_path):
    proc, out = _start_paused(ckpt, tmp_path)
    assert stale_entries(str(out.parent), "u"), "staging exists while copying"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert "no output was published" in err and "Traceback" not in err
    assert os.listdir(out.parent) == []  # no output, pointer, staging or lock file


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT], ids=lambda sig: sig.name)
def test_a_signal_ignored_on_entry_stays_ignored_and_the_run_publishes(sig, ckpt, reference, tmp_path):
    # What `nohup pyckpt convert ... &` sets up: SIGHUP (nohup) and SIGINT (a background job) ignored
    # before the program starts, so that it outlives the terminal.
    proc, out = _start_paused(ckpt, tmp_path, preexec_fn=lambda: signal.signal(sig, signal.SIG_IGN))
    proc.send_signal(sig)
    time.sleep(0.5)  # the held copy runs Python every 50 ms: a handler would have ended the run by now
    (tmp_path / "barrier.go").touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert _state(out, reference) == "new" and _pointer(out) == "u"
    assert stale_entries(str(out.parent), "u") == []


def test_sigkill_mid_copy_orphan_is_removed_by_next_run(ckpt, reference, tmp_path):
    proc, out = _start_paused(ckpt, tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    orphans = stale_entries(str(out.parent), "u")
    assert orphans and all(".u.pyckpt-tmp-" in n for n in orphans)
    assert not out.exists()
    code, err = _run(ckpt, out)
    assert code == 0, err
    assert "left by an earlier run" in err
    assert _state(out, reference) == "new" and sorted(os.listdir(out.parent)) == ["latest_universal", "u"]


def test_clean_removes_orphans_of_any_host_and_legacy_names(tmp_path):
    out = tmp_path / "u"
    out.mkdir()
    for name in (".u.pyckpt-tmp-otherhost-123-abcd", ".u.pyckpt-tmp-4242", "u.pyckpt-old-4242",
                 ".u.pyckpt-ptr-otherhost-1-ffff"):
        p = tmp_path / name
        p.mkdir() if "ptr" not in name else p.write_text("u")
    (tmp_path / ".v.pyckpt-tmp-otherhost-1-aaaa").mkdir()  # another output's: not ours to touch
    code, err = _run("--clean", out)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == [".v.pyckpt-tmp-otherhost-1-aaaa", "u"]


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupt_right_after_staging_is_made_leaves_nothing(error, tmp_path, monkeypatch):
    # Ctrl-C is taken at the first bytecode after a call returns: right after mkdir made the staging
    # folder, before the context manager had returned it (seen in CI as a stale .u.pyckpt-tmp-*)
    from pyckpt.execution import publisher

    made, real_mkdir = [], os.mkdir

    def mkdir_then_fail(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        made.append(path)
        raise error()

    monkeypatch.setattr(publisher.os, "mkdir", mkdir_then_fail)
    with pytest.raises(error):
        with publisher.Publisher(str(tmp_path / "u")):
            pass
    monkeypatch.undo()
    assert len(made) == 1 and made[0].startswith(str(tmp_path / ".u.pyckpt-tmp-"))
    assert stale_entries(str(tmp_path), "u") == [] and os.listdir(tmp_path) == []  # the lock released too


def test_a_staging_folder_mkdir_found_is_not_removed(tmp_path, monkeypatch):
    # mkdir refusing with EEXIST means the folder was not made by this run: it is left to its maker
    from pyckpt.execution import publisher

    real_mkdir = os.mkdir

    def another_made_it(path, *args, **kwargs):
        real_mkdir(path)
        (tmp_path / os.path.basename(path) / "theirs").write_text("x")
        raise FileExistsError(errno.EEXIST, "File exists", path)

    monkeypatch.setattr(publisher.os, "mkdir", another_made_it)
    with pytest.raises(FileExistsError):
        with publisher.Publisher(str(tmp_path / "u"), owner="shared"):
            pass
    monkeypatch.undo()
    assert (tmp_path / ".u.pyckpt-tmp-shared" / "theirs").read_text() == "x"


def test_clean_does_not_touch_a_live_run(ckpt, tmp_path):
    proc, out = _start_paused(ckpt, tmp_path)
    try:
        staging = stale_entries(str(out.parent), "u")
        cleaner = _start("--clean", out)
        time.sleep(1.0)  # give it the chance to do harm; it must be waiting for the lock instead
        assert cleaner.poll() is None
        assert stale_entries(str(out.parent), "u") == staging
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    _, err = cleaner.communicate(timeout=60)
    assert cleaner.returncode == 0 and os.listdir(out.parent) == []  # the killed run's lock file too


def _wait_for(path, proc, timeout=120):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"process ended before the barrier: {proc.communicate()[1]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("barrier not reached")
        time.sleep(0.05)


# -- concurrent runs ---------------------------------------------------------------------------

def test_existing_output_appearing_during_the_run_is_never_replaced(ckpt, tmp_path):
    # Another process (not pyckpt: pyckpt runs take turns under the lock) creates OUTPUT while this
    # run copies; plain rename(2) would silently replace an empty folder.
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    code = textwrap.dedent(f"""
        import os, sys
        from pyckpt.cli import convert
        from pyckpt.native import _core
        real = _core.write_archives
        def racing(*a, **k):
            result = real(*a, **k)
            os.mkdir({str(out)!r})
            return result
        _core.write_archives = racing
        sys.exit(convert.main([{str(ckpt)!r}, {str(out)!r}, "--quiet"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    assert proc.returncode == 1 and "appeared while converting" in proc.stderr, proc.stderr
    assert out.is_dir() and os.listdir(out) == []
    assert _pointer(out) is None and stale_entries(str(out.parent), "u") == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_concurrent_runs_take_turns_and_never_replace_without_overwrite(overwrite, ckpt, reference, tmp_path):
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    held = OutputLock(str(out))  # stands for a run in progress
    try:
        args = (ckpt, out) + (("--overwrite", ) if overwrite else ())
        proc = _start(*args)
        line = _read_line(proc.stderr, timeout=60)
        assert "waiting for another pyckpt run" in line, line
        assert not out.exists()
        shutil.copytree(reference, out)  # the other run publishes
        (out / "OLD").write_text("x")
    finally:
        held.release()
    _, err = proc.communicate(timeout=120)
    if overwrite:
        assert proc.returncode == 0, err
        assert _state(out, reference) == "new"
    else:
        assert proc.returncode == 1 and "already exists" in err, err
        assert (out / "OLD").exists()
    assert stale_entries(str(out.parent), "u") == [] and not (out.parent / ".u.pyckpt-lock").exists()


LOCKER = textwrap.dedent("""
    import os, sys
    from pyckpt.execution.output_lock import OutputLock
    lock = OutputLock(sys.argv[1], notify=lambda text: print("waiting", flush=True))
    print("locked", os.fstat(lock.fd).st_ino, flush=True)
    sys.stdin.readline()
    lock.release()
""")


def test_a_lock_file_removed_on_release_is_locked_anew_by_whoever_waited_on_it(tmp_path):
    # The holder removes the lock file while holding it: a waiter then holds a lock on a file no longer
    # there, and a newcomer meanwhile creates and locks a new one. Both may not run at once.
    out = str(tmp_path / "u")
    path = tmp_path / ".u.pyckpt-lock"
    first, newcomer = OutputLock(out), None
    waiter = subprocess.Popen([sys.executable, "-c", LOCKER, out], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=tempfile.gettempdir())
    try:
        assert _read_line(waiter.stdout, timeout=60) == "waiting\n"
        # Stopped, the waiter cannot look at the path before the newcomer has locked the file there now
        # (if it took the released file first, it holds that one; the newcomer must not wait on it).
        os.kill(waiter.pid, signal.SIGSTOP)
        first.release()
        newcomer = OutputLock(out, wait=False)
        os.kill(waiter.pid, signal.SIGCONT)
        assert newcomer.held and os.stat(path).st_ino == os.fstat(newcomer.fd).st_ino
        ready, _, _ = select.select([waiter.stdout], [], [], 1.0)
        assert not ready, "the waiter locked while the newcomer held the lock"
        newcomer.release()
        line = _read_line(waiter.stdout, timeout=60)
        assert line.split()[0] == "locked" and int(line.split()[1]) == os.stat(path).st_ino, line
        assert not OutputLock(out, wait=False).held  # the waiter's lock excludes everyone else
    finally:
        for lock in (first, newcomer):
            if lock:
                lock.release()
        os.kill(waiter.pid, signal.SIGCONT)
        waiter.communicate("\n", timeout=60)
    assert waiter.returncode == 0 and os.listdir(tmp_path) == []


def _read_line(stream, timeout):
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "no output from the waiting run"
    return stream.readline()


# -- full disks and failing writes -------------------------------------------------------------

def test_file_size_limit_mid_write_leaves_nothing(ckpt, tmp_path):
    out = tmp_path / "out" / "u"
    out.parent.mkdir()

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, as for a full quota
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # below the largest output file

    before = digest(ckpt)
    code, err = _run(ckpt, out, preexec_fn=limit)
    assert code == 1, err
    assert err.count("\n") == 1 and "File too large" in err and str(out.parent) in err, err
    assert not out.exists() and _pointer(out) is None and stale_entries(str(out.parent), "u") == []
    assert digest(ckpt) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (RLIMIT_FSIZE covers the same path)")
def test_full_filesystem_leaves_nothing(ckpt, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mount is not permitted in this sandbox (RLIMIT_FSIZE covers the same path)")
    try:
        out = mnt / "u"
        code, err = _run(ckpt, out)
        assert code == 1 and "No space left on device" in err and err.count("\n") == 1, err
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)])


def test_latest_universal_that_is_a_folder_is_refused_before_work(ckpt, tmp_path):
    out = tmp_path / "out" / "u"
    (out.parent / "latest_universal").mkdir(parents=True)
    code, err = _run(ckpt, out)
    assert code == 1 and "latest_universal exists and is not a file" in err, err
    assert os.listdir(out.parent) == ["latest_universal"]  # refused before anything was created


def test_old_output_that_cannot_be_removed_is_reported(ckpt, reference, tmp_path):
    # The swap succeeded; removing the previous output failed (e.g. a read-only subfolder owned by
    # someone else). The new output is in place; the leftover is named, not silently kept.
    out = tmp_path / "out" / "u"
    _old_output(out)
    code = textwrap.dedent(f"""
        import sys
        from pyckpt.cli import convert
        from pyckpt.execution import publisher
        def stuck(path):
            raise PermissionError(13, "Permission denied", path)
        publisher.remove_path = stuck
        sys.exit(convert.main([{str(ckpt)!r}, {str(out)!r}, "--overwrite", "--quiet"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr
    assert "could not be removed" in proc.stderr and "--clean" in proc.stderr
    assert _state(out, reference) == "new"
    leftover = stale_entries(str(out.parent), "u")
    assert len(leftover) == 1 and (out.parent / leftover[0] / "OLD").exists()
    code, err = _run("--clean", out)
    assert code == 0 and stale_entries(str(out.parent), "u") == []
