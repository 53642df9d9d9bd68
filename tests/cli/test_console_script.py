"""The pyckpt console script (pyckpt/cli/): subcommands that are the python -m entry points.

Most checks call cli.main in-process; those about the installed script, start-up cost and signals
start it. The slow ones run it on a real DeepSpeed checkpoint next to python -m pyckpt.convert.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from pyckpt import cli
from pyckpt.cli import common as cli_common
from pyckpt.execution.leftovers import stale_entries

from child_signals import default_signals
from compare import digest

SCRIPT = Path(sys.executable).with_name("pyckpt")
MODULES = {"convert": "pyckpt.convert", "export": "pyckpt.export", "inspect": "pyckpt.describe",
           "verify": "pyckpt.verify"}


def run(*args, check=False):
    # From a neutral folder: in the repository root the source `pyckpt/` would shadow the installed package.
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          env={**os.environ, "COLUMNS": "100"}, preexec_fn=default_signals())
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed with {proc.returncode}:\n{proc.stderr}")
    return proc


def call(capsys, *argv):
    """cli.main in-process: (exit status, stdout, stderr); argparse's exits count as statuses."""
    try:
        code = cli.main(list(map(str, argv)))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _after_usage(text: str) -> str:
    # The usage block wraps by the program name's length; everything after it must be identical.
    return text.split("\n\n", 1)[1]


@pytest.fixture
def broken_checkpoint(tmp_path):
    """A ZeRO tag folder whose optimizer shard is two bytes."""
    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"garbage")
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x\n")
    return tag


@pytest.fixture
def broken_universal(tmp_path):
    """A universal folder whose model-state file is not a ZIP archive."""
    out = tmp_path / "u"
    (out / "zero").mkdir(parents=True)
    (out / "mp_rank_00_model_states.pt").write_bytes(b"garbage")
    return out


# -- the command and its help ------------------------------------------------------------------

def test_console_script_is_installed_and_lists_the_subcommands():
    assert SCRIPT.is_file() and os.access(SCRIPT, os.X_OK), f"{SCRIPT}: pip install the package (it declares it)"
    proc = run(SCRIPT, "--help", check=True)
    lines = proc.stdout.splitlines()
    for name, summary in cli.COMMANDS:
        assert any(line.split() == [name, *summary.split()] for line in lines), (name, proc.stdout)
    assert proc.stdout.startswith("usage: pyckpt ")


def test_python_dash_m_pyckpt_is_the_same_command():
    proc = run(sys.executable, "-m", "pyckpt", "--help", check=True)
    assert proc.stdout.startswith("usage: python -m pyckpt ")
    assert _after_usage(proc.stdout) == _after_usage(run(SCRIPT, "--help", check=True).stdout)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_subcommand_help_is_its_module_help(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = call(capsys, name, "--help")
    assert code == 0 and out.startswith(f"usage: pyckpt {name} ")
    module = run(sys.executable, "-m", MODULES[name], "--help", check=True).stdout
    assert _after_usage(out) == _after_usage(module)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_python_dash_m_module_only_forwards_to_the_subcommand(name):
    """pyckpt/NAME.py (describe.py for inspect) is the documented `python -m` door to pyckpt.cli.NAME: the
    subcommand's own main, and no command of its own."""
    import importlib
    door, command = importlib.import_module(MODULES[name]), importlib.import_module(f"pyckpt.cli.{name}")
    assert door.main is command.main
    assert not any(hasattr(door, attr) for attr in ("run", "add_arguments", "DESCRIPTION"))


def test_clean_help(capsys):
    code, out, _ = call(capsys, "clean", "--help")
    assert code == 0 and out.startswith("usage: pyckpt clean ")
    for word in ("OUTPUT", ".pyckpt-", "--json", "--quiet", "--debug"):
        assert word in out, word


def test_every_registered_module_is_a_command():
    import importlib
    for name, summary in cli.COMMANDS:
        command = importlib.import_module(f"pyckpt.cli.{name}")
        assert callable(command.add_arguments) and callable(command.run) and command.DESCRIPTION, name
        assert summary and "\n" not in summary and len(f"    {name:9} {summary}") <= 100, name


@pytest.mark.parametrize("argv", [["frobnicate"], [], ["--json"], ["convert", "--frobnicate", "a", "b"]],
                         ids=["unknown", "none", "top-level-flag", "unknown-flag"])
def test_usage_errors_exit_2(argv, capsys):
    code, out, err = call(capsys, *argv)
    assert code == 2 and out == "" and err.startswith("usage: pyckpt")
    assert "Traceback" not in err


def test_unknown_subcommand_from_the_installed_script():
    proc = run(SCRIPT, "frobnicate")
    assert proc.returncode == 2 and "invalid choice: 'frobnicate'" in proc.stderr


def test_convert_usage_error_is_the_modules():
    """A usage mistake argparse cannot see (--clean with two folders) exits 2 with the subcommand's usage."""
    proc = run(SCRIPT, "convert", "--clean", "a", "b")
    module = run(sys.executable, "-m", "pyckpt.convert", "--clean", "a", "b")
    assert proc.returncode == module.returncode == 2
    assert proc.stderr.startswith("usage: pyckpt convert ")
    assert proc.stderr.splitlines()[-1] == module.stderr.splitlines()[-1].replace("python -m pyckpt.convert",
                                                                                  "pyckpt convert")


# -- parsing is cheap ------------------------------------------------------------------------------

PARSE_ONLY = textwrap.dedent("""
    import sys
    from pyckpt import cli
    heavy = lambda: [m for m in ("numpy", "torch", "pyckpt._core") if m in sys.modules]
    command, parser, args = cli.parse(sys.argv[1:])
    print(heavy())
    for name in command.IMPORTS:
        __import__(name)
    print(heavy())
""")


@pytest.mark.parametrize("argv", [["convert", "in", "out"], ["export", "in", "out"], ["inspect", "ck"],
                                  ["verify", "u", "--against", "ck"], ["clean", "u"]], ids=lambda a: a[0])
def test_parsing_imports_neither_numpy_nor_torch(argv):
    proc = run(sys.executable, "-c", PARSE_ONLY, *argv, check=True)
    # The native module comes with the command's IMPORTS, loaded before Ctrl-C stops counting as
    # start-up; numpy (a tenth of a second, a large share of a short export) only where a tensor is
    # computed in memory, and torch never.
    assert proc.stdout.splitlines() == ["[]", "['pyckpt._core']"], proc.stdout


# -- errors ------------------------------------------------------------------------------------------

def _same_as_module(name, *args):
    proc = run(SCRIPT, name, *args)
    module = run(sys.executable, "-m", MODULES[name], *args)
    assert (proc.returncode, proc.stdout, proc.stderr) == (module.returncode, module.stdout, module.stderr)
    return proc


def test_inspect_broken_checkpoint_is_one_line_naming_the_file(broken_checkpoint):
    proc = _same_as_module("inspect", broken_checkpoint)
    shard = broken_checkpoint / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"pyckpt: error: {shard}: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_verify_broken_output_names_each_file(broken_universal):
    proc = _same_as_module("verify", broken_universal, "--quiet")
    assert proc.returncode == 1 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{broken_universal / 'mp_rank_00_model_states.pt'}: ") and "ZIP" in lines[0]
    assert lines[-1].startswith("FAILED: ") and "Traceback" not in proc.stdout


def test_verify_unreadable_output_is_one_line_exit_2(tmp_path):
    proc = _same_as_module("verify", tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"pyckpt: error: {tmp_path}: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_convert_broken_checkpoint_is_one_line_exit_1(broken_checkpoint, tmp_path):
    proc = _same_as_module("convert", broken_checkpoint, tmp_path / "out" / "u", "--quiet")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "optim_states.pt" in proc.stderr
    assert not (tmp_path / "out" / "u").exists()


def test_debug_shows_the_traceback(broken_checkpoint, capsys):
    with pytest.raises(Exception, match="optim_states.pt"):
        cli.main(["inspect", str(broken_checkpoint), "--debug"])


def test_one_line_keeps_names_whole():
    assert cli_common.one_line(OSError("a\nb: c")) == "a b: c"
    assert cli_common.one_line(KeyError("param_shapes")) == "missing key 'param_shapes'"
    assert cli_common.one_line(RuntimeError()) == "RuntimeError"


# -- clean -------------------------------------------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _orphans(parent: Path):
    """What a run killed mid-copy leaves (a staging folder named after its dead pid) and what a killed
    swap leaves (the previous output set aside, OUTPUT itself gone)."""
    staging = parent / f".u.pyckpt-tmp-{os.uname().nodename}-{_dead_pid()}-abcd1234"
    (staging / "zero").mkdir(parents=True)
    (staging / "zero" / "half.pt").write_bytes(b"partial")
    old = parent / f".u.pyckpt-old-otherhost-{_dead_pid()}-ffff0000"
    old.mkdir()
    (old / "OLD").write_text("previous output")
    return staging, old


def test_clean_removes_a_dead_runs_staging_and_restores_the_set_aside_output(tmp_path, capsys):
    staging, old = _orphans(tmp_path)
    other = tmp_path / ".v.pyckpt-tmp-host-1-aaaa"  # another output's: not ours to touch
    other.mkdir()
    code, out, err = call(capsys, "clean", tmp_path / "u")
    assert code == 0 and out == "", err
    assert not staging.exists() and not old.exists() and (tmp_path / "u" / "OLD").read_text() == "previous output"
    assert other.exists() and stale_entries(str(tmp_path), "u") == []
    assert f"cleaned {staging.name}" in err and "cleaned 2 entries beside" in err


def test_clean_is_convert_dash_dash_clean(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    staging_a, _ = _orphans(a)
    staging_b, _ = _orphans(b)
    proc = run(SCRIPT, "clean", a / "u", "--json")
    module = run(sys.executable, "-m", "pyckpt.convert", "--clean", b / "u", "--json")
    assert proc.returncode == module.returncode == 0, proc.stderr + module.stderr
    report, expected = json.loads(proc.stdout), json.loads(module.stdout)
    assert report["output"] == str(a / "u") and expected["output"] == str(b / "u")
    assert sorted(n.split("-")[1] for n in report["removed"]) == sorted(n.split("-")[1] for n in expected["removed"])
    assert not staging_a.exists() and not staging_b.exists()
    assert stale_entries(str(a), "u") == stale_entries(str(b), "u") == []


def test_clean_with_nothing_to_clean(tmp_path, capsys):
    code, out, err = call(capsys, "clean", tmp_path / "u", "--quiet")
    assert (code, out, err) == (0, "", "")


# -- Ctrl-C --------------------------------------------------------------------------------------------

# `pyckpt inspect` with SIGINT sent at a known moment: while its parser is built, while a module
# of its IMPORTS loads (as numpy's could be), or once it runs.
INTERRUPT_AT = textwrap.dedent("""
    import signal, sys
    from pyckpt import cli
    from pyckpt.cli import inspect as cli_inspect
    def interrupt(*a, **k):
        signal.raise_signal(signal.SIGINT)
    where, folder = sys.argv[1:3]
    if where == "IMPORTS":
        sys.path.insert(0, folder)
        cli_inspect.IMPORTS = ("interrupted_import",) + cli_inspect.IMPORTS
    else:
        setattr(cli_inspect, where, interrupt)
    sys.argv[1:] = ["inspect", folder]
    sys.exit(cli.main())
""")


@pytest.mark.parametrize("where,said", [("add_arguments", "interrupted while starting; nothing was written"),
                                        ("IMPORTS", "interrupted while starting; nothing was written"),
                                        ("run", "interrupted")])
def test_ctrl_c_is_one_line(where, said, tmp_path):
    (tmp_path / "interrupted_import.py").write_text("import signal\nsignal.raise_signal(signal.SIGINT)\n")
    proc = run(sys.executable, "-c", INTERRUPT_AT, where, tmp_path)
    assert (proc.returncode, proc.stderr) == (130, f"pyckpt: {said}\n")


def test_in_process_callers_keep_their_signal_handlers(tmp_path, capsys):
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    call(capsys, "--help")
    call(capsys, "clean", tmp_path / "u")  # a command that turns SIGTERM/SIGHUP into clean-up while it runs
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == before


# -- against python -m pyckpt.convert on a real checkpoint ---------------------------------------------

NAME = "s1_fp32_dp2"


def test_console_script_converts_byte_for_byte_as_the_module(checkpoints, tmp_path):
    ck = checkpoints[NAME]
    a, b = tmp_path / "a" / "u", tmp_path / "b" / "u"
    module = run(sys.executable, "-m", "pyckpt.convert", ck.tag_dir, a, "--workers", "2", "--quiet", check=True)
    script = run(SCRIPT, "convert", ck.tag_dir, b, "--workers", "2", "--quiet", check=True)
    assert (script.stdout, script.stderr) == (module.stdout, module.stderr) == ("", "")
    assert digest(a.parent) == digest(b.parent) and len(digest(a)) > 3
    # The plan printed by a dry run names the same files and bytes.
    plans = [run(*cmd, ck.tag_dir, tmp_path / "c" / "u", "--dry-run", check=True).stdout
             for cmd in ([sys.executable, "-m", "pyckpt.convert"], [SCRIPT, "convert"])]
    assert plans[0] == plans[1] and "zero/optimizer_state.pt" in plans[0]


# From 0.3 s on the command is importing torch and numpy (the long part of start-up); before that lies
# only the interpreter's own start-up, a few lines ahead of the handler the command installs.
@pytest.mark.parametrize("delay", [0.3, 0.6, 1.0, 1.5])
@pytest.mark.parametrize("launcher", ["python -m pyckpt.convert", "pyckpt convert"])
def test_ctrl_c_during_start_up_prints_no_traceback(launcher, delay, checkpoints, tmp_path):
    out = tmp_path / "out" / "u"
    command = [sys.executable, "-m", "pyckpt.convert"] if launcher.startswith("python") else [str(SCRIPT), "convert"]
    proc = subprocess.Popen(command + [str(checkpoints[NAME].root), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(), preexec_fn=default_signals())
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if "init_import_site" in err:
        return  # interrupted inside the interpreter's own start-up, before any pyckpt code ran
    assert "Traceback" not in err, err
    # Killed by the signal before Python took it over, or interrupted and said so, or (a slow
    # start-up can't be told apart from a fast run) done.
    assert proc.returncode in (-signal.SIGINT, 130, 0), (proc.returncode, err)
    if proc.returncode == 130:
        assert "interrupted" in err and not out.exists(), err
    if proc.returncode != 0 and out.parent.exists():
        assert stale_entries(str(out.parent), "u") == []
