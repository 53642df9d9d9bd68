"""Hostile input against the command lines, third round (issue 36, items 7, 9, 10, 11): an absurd
expert count must cost no loop to it; every numeric flag and library keyword refuses inf, nan and
out-of-range values by name; what is not a checkpoint file beside the shards is skipped or named with
the rule, never a bare errno; and no string read from a checkpoint reaches the terminal unescaped.

Checkpoints come from pyckpt.testing (milliseconds, no DeepSpeed). A command whose old behaviour was
to loop forever runs in a subprocess under a timeout, so that it fails instead of hanging."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

import pyckpt
import pyckpt.testing as mc
from pyckpt.errors import CheckpointFormatError, PyckptError

from edit import copy_checkpoint, rewrite

TIMEOUT = 120  # the old code took hours (or forever) where these take well under a second


# cwd outside the source folder: `-m pyckpt...` must import the installed package, whose native module
# the source folder of a fresh clone does not hold
def _run(*args, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd="/")


def _python(code: str, timeout=TIMEOUT):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd="/",
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Small checkpoints (their tag folders), made once; tests edit copies."""
    root = tmp_path_factory.mktemp("made")
    return {"dense": mc.make_checkpoint(root / "dense", dp=2, stage=2, layers=1, hidden=8),
            "moe2": mc.make_checkpoint(root / "moe2", dp=2, stage=2, layers=2, hidden=8, experts=4, ep=2),
            "moe3": mc.make_checkpoint(root / "moe3", dp=2, stage=3, layers=2, hidden=8, experts=4, ep=2)}


def _model_files(tag):
    return sorted(p for p in tag.glob("*model_states.pt") if "expert" not in p.name)


def _edit_layers(tag, edit):
    for path in _model_files(tag):
        rewrite(path, lambda obj: [edit(layer) for layer in obj["ds_autoep_layers"]])


# -- item 7: divisors of an absurd expert count ---------------------------------------------------

def test_expert_parallel_sizes_come_from_factors_not_from_counting():
    """10**12 (169 divisors) and the Mersenne prime 2**61-1 in milliseconds, the list capped with how many
    more; the helper agrees with counting where counting is cheap."""
    got = _python("""
        import json
        from pyckpt.zero.autoep.ep_sizes import LISTED, divisors, valid_ep_sizes
        for n in range(1, 3000):
            every = [d for d in range(1, n + 1) if n % d == 0]
            s = divisors(n)
            assert list(s.listed) == every[:LISTED] and s.total == len(every), n
        big, prime = divisors(10**12), divisors(2**61 - 1)
        print(json.dumps({"big": [list(big.listed), big.total, str(big)], "prime": [list(prime.listed), prime.total],
                          "staged": list(valid_ep_sizes(10**12, 2**61 - 1).listed),
                          "huge": str(divisors(2**10 * (2**89 - 1)))}))
    """)
    listed, total, text = got["big"]
    assert total == 169 and listed[:6] == [1, 2, 4, 5, 8, 10] and len(listed) == 24
    assert text.endswith("and 145 more") and len(text) < 200
    assert got["prime"] == [[1, 2**61 - 1], 2]
    assert got["staged"] == [1]
    # What trial division leaves (an 89-bit prime) is proven prime: 11 * 2 divisors, all listed.
    assert got["huge"] == str([2**k for k in range(11)] + [2**k * (2**89 - 1) for k in range(11)])


def test_a_count_left_unsplit_lists_small_sizes_and_says_the_rest_is_not_counted():
    from pyckpt.zero.autoep.ep_sizes import TRIAL, divisors
    p, q = 1_000_003, 1_000_033  # primes above the trial bound: their product is not split
    s = divisors(6 * p * q)
    assert list(s.listed) == [1, 2, 3, 6] and s.total is None
    assert str(s).endswith(f"up to {TRIAL}; larger ones not counted)")
    assert divisors(0).listed == () and divisors(-4).total == 0


def test_load_side_messages_about_absurd_counts_stay_short():
    got = _python("""
        import json
        from pyckpt.universal.expert_slice import check_load_topology, expert_rows
        out = []
        for call in (lambda: expert_rows(10**12, 0, 7),
                     lambda: expert_rows(2**61 - 1, 0, 2),
                     lambda: check_load_topology([{"module_path": "m", "expert_key_prefix": "m.experts",
                                                    "num_experts": 10**12}], 7, 7),
                     lambda: check_load_topology([], 2, 2**61 - 1)):
            try:
                call()
            except ValueError as exc:
                out.append(str(exc))
        print(json.dumps(out))
    """)
    assert len(got) == 4 and all(len(m) < 400 for m in got), got
    assert got[0].endswith("[1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 80, 100, 125, 128, 160, 200, 250, 256, "
                           "320, 400, 500] and 145 more")
    assert got[1].endswith(f"Valid ep sizes: [1, {2**61 - 1}]")
    assert "Valid autoep_size values: [1]" in got[2]
    assert got[3].endswith(f"Valid autoep_size values: [1, {2**61 - 1}]")


@pytest.mark.parametrize("count,more", [(10**12, 145), (2**61 - 1, 0)])
def test_inspect_of_an_absurd_expert_count_finishes(made, tmp_path, count, more):
    root, tag = copy_checkpoint(made["moe2"], tmp_path)
    _edit_layers(tag, lambda layer: layer.update(num_experts=count))
    proc = _run("pyckpt.describe", root)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("resumable at: "))
    assert len(line) < 400
    if more:
        assert line.endswith(", 500 and 145 more")
    else:
        assert line.endswith(f"; expert-parallel 1, {count}")
    info = json.loads(_run("pyckpt.describe", root, "--json").stdout)["resumable"]
    assert len(info["expert_parallel"]) <= 24 and info.get("expert_parallel_more", 0) == more


@pytest.mark.parametrize("edit", ["placement", "uniform"])
def test_zero3_expert_placement_with_an_absurd_count_is_refused_quickly(made, tmp_path, edit):
    """A placement descriptor promising 10**12 experts (its coverage was a set of every id), or a
    uniform placement over 10**12 EP ranks (a tuple per rank, then a list of every missing rank)."""
    root, tag = copy_checkpoint(made["moe3"], tmp_path)

    def change(layer):
        if edit == "placement":
            layer["expert_placement"]["num_experts"] = 10**12
            layer["num_experts"] = 10**12
        else:
            layer.pop("expert_placement")
            layer.update(ep_size=10**12, num_experts=2 * 10**12)
    _edit_layers(tag, change)
    proc = _run("pyckpt.convert", root, tmp_path / "out", "--dry-run")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and len(lines[0]) < 700 and str(tag) in lines[0], lines
    assert ("and 999999999988 more" if edit == "placement" else "and 999999999990 more") in lines[0]


# -- item 9: numeric flags and keywords ---------------------------------------------------------------

BAD_COUNTS = ["inf", "-inf", "nan", "-1", "1e999", "99999999999999999999999", "1.5", "70000"]
BAD_SIZES = ["inf", "-inf", "nan", "-1", "0", "1e999", "1e300"]
BAD_RATES = ["inf", "-inf", "nan", "-1", "1e999", "-0.5"]
BAD_SHARDS = ["inf", "nanGB", "-1", "0", "-5GB", "1" + "0" * 400 + "GB", "5XB"]
FLAGS = ([("convert", flag, [], value) for flag in ("--workers", "-j", "--num_extract_workers",
                                                     "--num_merge_workers") for value in BAD_COUNTS]
         + [("export", flag, [], value) for flag in ("--workers", "-j") for value in BAD_COUNTS]
         + [("export", "--chunk-mb", ["--format", "dcp"], value) for value in BAD_SIZES]
         + [("export", "--initial-lr", ["--format", "dcp"], value) for value in BAD_RATES]
         + [("export", "--max_shard_size", [], value) for value in BAD_SHARDS])


@pytest.mark.parametrize("command,flag,extra,value", FLAGS,
                         ids=[f"{c}{f}={v[:12]}" for c, f, _, v in FLAGS])
def test_a_numeric_flag_refuses_what_is_not_a_finite_number_in_range(tmp_path, capsys, command, flag, extra, value):
    """A usage error (exit 2) naming the flag, before any input is read; never a traceback, an unnamed
    conversion error or an export that writes inf into the optimizer's groups."""
    from pyckpt.cli import main
    with pytest.raises(SystemExit) as info:
        main([command, str(tmp_path / "absent"), str(tmp_path / "out"), f"{flag}={value}", *extra])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert flag in err.strip().splitlines()[-1], err  # the error line (the usage above it lists every flag)
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,key,expected", [
    (["convert", "a", "b", "-j", "0"], "workers", 0),
    (["convert", "a", "b", "--num_merge_workers", "4"], "num_merge_workers", 4),
    (["export", "a", "b", "--workers=65536"], "workers", 65536),
    (["export", "a", "b", "--format", "dcp", "--chunk-mb", "0.5"], "chunk_mb", 0.5),
    (["export", "a", "b", "--format", "dcp", "--initial-lr", "0"], "initial_lr", 0.0),
    (["export", "a", "b", "--format", "dcp", "--initial-lr", "3e-4"], "initial_lr", 3e-4)])
def test_numeric_flags_take_their_valid_values(argv, key, expected):
    from pyckpt.cli import parse
    assert getattr(parse(argv)[2], key) == expected


LIBRARY = ([(pyckpt.convert_to_universal, "workers", v) for v in (-1, 10**30, 1.5, float("inf"), True)]
           + [(pyckpt.export_hf, "workers", v) for v in (-1, 10**30)]
           + [(pyckpt.export_hf, "max_shard_size", v) for v in (float("inf"), float("nan"), -1, 0,
                                                                 "1" + "0" * 400 + "GB")]
           + [(pyckpt.export_dcp, "workers", v) for v in (-3, float("nan"))]
           + [(pyckpt.export_dcp, "chunk_bytes", v) for v in (0, -1, float("inf"), 2.5, 1 << 63, 10**5000)]
           + [(pyckpt.export_dcp, "initial_lr", v) for v in (float("inf"), float("-inf"), float("nan"), -1e-3)])


@pytest.mark.parametrize("function,keyword,value", LIBRARY,
                         ids=[f"{f.__name__}-{k}-{i}" for i, (f, k, v) in enumerate(LIBRARY)])
def test_a_numeric_keyword_of_the_library_is_refused_by_name(made, tmp_path, function, keyword, value):
    with pytest.raises(ValueError, match=keyword) as info:
        function(made["dense"].parent, tmp_path / "out", dry_run=True, **{keyword: value})
    assert len(str(info.value)) < 300 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("keyword", ["arrival_timeout", "agree_timeout"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1.0, 1e300, True, "60"])
def test_save_checkpoint_timeouts_must_be_finite_and_positive(tmp_path, keyword, value):
    from pyckpt.deepspeed import save_checkpoint
    with pytest.raises(ValueError, match=f"^{keyword} must be a finite number > 0"):
        save_checkpoint(object(), tmp_path / "ck", **{keyword: value})
    assert not (tmp_path / "ck").exists()


# -- item 10: what is not a checkpoint file beside the shards -------------------------------------------

def _plant(path, kind):
    if kind == "dangling":
        os.symlink("no-such-file", path)
    elif kind == "loop":
        os.symlink(path.name, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "socket":  # bound by a short relative name: a socket's whole path may not pass 107 bytes
        s, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        os.chdir(path.parent)
        try:
            s.bind(path.name)
        finally:
            os.chdir(cwd)
            s.close()


@pytest.mark.parametrize("kind", ["dangling", "loop", "fifo", "folder", "socket"])
def test_inspect_skips_what_is_not_a_checkpoint_file(made, tmp_path, kind):
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    _plant(tag / "notes.txt", kind)
    proc = _run("pyckpt.describe", root)
    assert proc.returncode == 0, proc.stderr
    assert "notes.txt" not in proc.stdout and "mp_rank_00_model_states.pt" in proc.stdout
    info = json.loads(_run("pyckpt.describe", root, "--json").stdout)
    assert info["files"] == 3 and set(info["file_sizes"]) == {p.name for p in tag.iterdir() if p.name != "notes.txt"}


@pytest.mark.parametrize("command", ["describe", "convert", "export"])
@pytest.mark.parametrize("kind", ["loop", "dangling", "fifo", "folder"])
def test_a_non_file_named_like_a_model_state_file_is_named_with_the_rule(made, tmp_path, command, kind):
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    victim = tag / "mp_rank_01_model_states.pt"
    _plant(victim, kind)
    args = [root] if command == "describe" else [root, tmp_path / "out", "--dry-run"]
    proc = _run(f"pyckpt.{command}", *args)
    assert proc.returncode == 1, proc.stderr
    rule = {"loop": "a link in a loop", "dangling": "file not found", "fifo": "is a FIFO",
            "folder": "is a folder"}[kind]
    assert proc.stderr.startswith(f"pyckpt: error: {victim}: ")
    assert rule in proc.stderr and "Errno" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_verify_against_names_a_copied_file_that_is_no_file(made, tmp_path, kind):
    root, _ = copy_checkpoint(made["dense"], tmp_path)
    out = tmp_path / "universal"
    pyckpt.convert_to_universal(root, out)
    victim = out / "mp_rank_00_model_states.pt"
    victim.unlink()
    _plant(victim, kind)
    proc = _run("pyckpt.verify", out, "--against", root)
    assert proc.returncode == 1, proc.stderr  # problems found, not "cannot be read at all"
    assert "Errno" not in proc.stdout + proc.stderr and f"{victim}: " in proc.stdout


# -- item 11: strings from a checkpoint, escaped -------------------------------------------------------

HOSTILE = "\x1b[2J\nglobal_steps: 999"


def _no_controls(text: str) -> bool:
    return not any(not c.isprintable() and c != "\n" for c in text)


def test_printable_escapes_what_could_drive_a_terminal_or_forge_a_line():
    from pyckpt.errors import printable, printable_line
    assert printable("model.layers.0.weight") == "model.layers.0.weight" and printable("é ü 中") == "é ü 中"
    assert printable(HOSTILE) == "\\x1b[2J\\nglobal_steps: 999"
    assert printable("a\x9b31m\x85b\u2028c\u2029d\u202ee\u2066f\ufeffg\ud800h\\") == \
        "a\\x9b31m\\x85b\\u2028c\\u2029d\\u202ee\\u2066f\\ufeffg\\ud800h\\\\"
    assert printable_line("C:\\x \x1b") == "C:\\x \\x1b"  # a message's own backslashes stay
    exc = CheckpointFormatError(f"/ck/{HOSTILE}: not a ZIP archive")
    assert str(exc) == "/ck/\\x1b[2J\\nglobal_steps: 999: not a ZIP archive" and isinstance(exc, PyckptError)
    from pyckpt.cli.common import _escaped_warnings, one_line
    assert one_line(ValueError(f"bad {HOSTILE}")) == "bad \\x1b[2J global_steps: 999"
    import warnings
    shown = _escaped_warnings(warnings.formatwarning)(f"skipped {HOSTILE}", UserWarning, "f.py", 1, "")
    assert "\x1b" not in shown and "skipped \\x1b[2J\\nglobal_steps: 999" in shown


def test_inspect_escapes_a_hostile_ds_version(made, tmp_path):
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    rewrite(tag / "mp_rank_00_model_states.pt", lambda obj: obj.__setitem__("ds_version", HOSTILE + "\u202e"))
    proc = _run("pyckpt.describe", root)
    assert proc.returncode == 0, proc.stderr
    assert _no_controls(proc.stdout) and "\x1b" not in proc.stdout
    assert [x for x in proc.stdout.splitlines() if x.startswith("global_steps")] == ["global_steps: 1"]
    assert "ds_version: \\x1b[2J\\nglobal_steps: 999\\u202e\n" in proc.stdout
    assert json.loads(_run("pyckpt.describe", root, "--json").stdout)["ds_version"] == HOSTILE + "\u202e"


def test_inspect_escapes_a_hostile_tag_and_file_names(made, tmp_path):
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    hostile_tag = "global_step1\x1b]0;owned\x07\u2028zero_stage: 9"
    tag = tag.rename(root / hostile_tag)
    (root / "latest").write_text(hostile_tag)
    (tag / f"notes{HOSTILE}.txt").write_text("x")
    proc = _run("pyckpt.describe", root)
    assert proc.returncode == 0, proc.stderr
    assert _no_controls(proc.stdout)
    assert [x for x in proc.stdout.splitlines() if x.startswith(("zero_stage", "global_steps"))] == \
        ["zero_stage: 2", "global_steps: 1"]
    assert "global_step1\\x1b]0;owned\\x07\\u2028zero_stage: 9" in proc.stdout
    assert "notes\\x1b[2J\\nglobal_steps: 999.txt" in proc.stdout


def test_export_dry_run_escapes_a_hostile_parameter_name(made, tmp_path):
    """A tied alias (shared_params key) may hold a line separator or a bidi override and still be a name
    torch allows; the dry run's note listing it shows them escaped."""
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    alias = "head.weight\u2028global_steps: 999\u202e"
    rewrite(tag / "mp_rank_00_model_states.pt",
            lambda obj: obj["shared_params"].__setitem__(alias, next(iter(obj["param_shapes"][0]))))
    proc = _run("pyckpt.export", root, tmp_path / "hf", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert _no_controls(proc.stdout) and "\u2028" not in proc.stdout and "\u202e" not in proc.stdout
    assert "head.weight\\u2028global_steps: 999\\u202e" in proc.stdout


def test_a_parameter_name_with_a_c1_control_is_refused(made, tmp_path):
    """C1 controls (\\x9b is CSI on an 8-bit terminal) are control characters like C0: never a name."""
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    rewrite(tag / "mp_rank_00_model_states.pt",
            lambda obj: obj["shared_params"].__setitem__("head.weight\x9b2J", next(iter(obj["param_shapes"][0]))))
    with pytest.raises(CheckpointFormatError, match=r"shared_params key 'head.weight\\x9b2J' contains") as info:
        pyckpt.export_hf(root, tmp_path / "hf", dry_run=True)
    assert _no_controls(str(info.value))


def test_verify_escapes_a_hostile_parameter_folder_name(made, tmp_path):
    root, _ = copy_checkpoint(made["dense"], tmp_path)
    out = tmp_path / "universal"
    pyckpt.convert_to_universal(root, out)
    (out / "zero" / f"evil{HOSTILE}").mkdir()
    for args in ([out], [out, "--against", root]):
        proc = _run("pyckpt.verify", *args)
        assert proc.returncode == 1, proc.stderr
        assert _no_controls(proc.stdout + proc.stderr) and "\x1b" not in proc.stdout
        assert not any(x.startswith("global_steps") for x in proc.stdout.splitlines())
        assert "zero/evil\\x1b[2J" in proc.stdout


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt\n", "mp_rank_00_model_states.pt.bak",
                                  "mp_rank_00_model_states.pt\u2028x"])
def test_a_file_that_only_starts_like_a_model_state_file_is_refused_not_copied(made, tmp_path, name):
    """DeepSpeed's converter takes every mp_rank_* name as a model-state file; pyckpt copies model-state
    files into its output by name, so a name that only starts like one (a trailing newline, a backup)
    is refused naming it, escaped, and nothing is written."""
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    shutil.copyfile(tag / "mp_rank_00_model_states.pt", tag / name)
    proc = _run("pyckpt.convert", root, tmp_path / "out")
    assert proc.returncode == 1, proc.stderr
    assert "named like a model-state file but not mp_rank_NN_model_states.pt" in proc.stderr
    assert proc.stderr.count("\n") == 1 and _no_controls(proc.stderr)
    assert not (tmp_path / "out").exists()


# -- a megabyte of checkpoint content in one message ---------------------------------------------

MEGA = "h" * 1_000_000
SHORT = 1000  # a line quoting a megabyte stays under this, whatever it quotes


def test_quoting_helpers_cut_what_they_quote_and_say_how_long_it_was():
    from pyckpt.cli.common import _escaped_warnings, one_line
    from pyckpt.errors import bounded_line, clipped, quoted
    assert quoted("model.w") == "'model.w'" and quoted([1, "a"]) == "[1, 'a']"
    assert quoted(MEGA) == repr(MEGA[:200])[:200] + "...(1,000,000 characters)"
    assert quoted([MEGA]).endswith("...(1,000,004 characters)") and len(quoted([MEGA])) < 250
    assert quoted(7 ** 100_000) == "an integer of 280,736 bits"  # whose repr would raise
    assert clipped("abc") == "abc" and clipped(MEGA, 10) == "hhhhhhhhhh...(1,000,000 characters)"
    line = bounded_line("/ck/file.pt: " + MEGA + " is not a rule")
    assert line.startswith("/ck/file.pt: hhh") and line.endswith("hhh is not a rule") and len(line) < 4100
    assert "characters cut)" in line
    # everyone else's errors and the warnings, at the command line's one door
    assert len(one_line(ValueError(MEGA))) < 4100 and len(one_line(KeyError(MEGA))) < SHORT
    import warnings
    shown = _escaped_warnings(warnings.formatwarning)(f"skipped {MEGA}", UserWarning, "f.py", 1, "")
    assert len(shown) < 4200 and "characters cut)" in shown
    error = CheckpointFormatError(f"/ck/x.pt: {MEGA}: the rule")
    assert len(str(error)) < 4100 and str(error).startswith("/ck/x.pt: ") and str(error).endswith(": the rule")


def _lines(proc) -> list:
    return (proc.stdout + proc.stderr).splitlines()


def test_inspect_cuts_a_megabyte_ds_version(made, tmp_path):
    root, tag = copy_checkpoint(made["dense"], tmp_path)
    rewrite(tag / "mp_rank_00_model_states.pt", lambda obj: obj.__setitem__("ds_version", MEGA))
    proc = _run("pyckpt.describe", root)
    assert proc.returncode == 0, proc.stderr[:2000]
    (line, ) = [x for x in _lines(proc) if x.startswith("ds_version: ")]
    assert len(line) < SHORT and line.endswith("...(1,000,000 characters)"), line[:2000]


ZERO_EDITS = {
    # (checkpoint, file, edit, what the one error line says)
    "zero_stage": ("dense", "*optim_states.pt",
                   lambda obj: obj["optimizer_state_dict"].__setitem__("zero_stage", MEGA), "not a ZeRO stage"),
    "expert_count": ("moe2", "*model_states.pt",
                     lambda obj: [layer.__setitem__("num_local_experts", MEGA) for layer in obj["ds_autoep_layers"]],
                     "must be a positive integer"),
    "expert_prefix": ("moe2", "*model_states.pt",
                      lambda obj: [layer.__setitem__("expert_key_prefix", MEGA) for layer in obj["ds_autoep_layers"]],
                      "expert_key_prefix"),
}


@pytest.mark.parametrize("case", list(ZERO_EDITS))
def test_a_megabyte_value_in_zero_metadata_gives_one_short_line(made, tmp_path, case):
    """A value of a ZeRO checkpoint's metadata (the ZeRO stage, an AutoEP layer's expert count or its
    parameters' name prefix) quoted in an error: the line names the file and the rule, cut with the
    length, from convert and the Hugging Face export alike."""
    name, pattern, edit, rule = ZERO_EDITS[case]
    root, tag = copy_checkpoint(made[name], tmp_path)
    for path in sorted(tag.glob(pattern)):
        if "expert" not in path.name:
            rewrite(path, edit)
    for module, args in (("pyckpt.convert", [root, tmp_path / "out"]), ("pyckpt.export", [root, tmp_path / "hf"])):
        proc = _run(module, *args)
        assert proc.returncode == 1, proc.stderr[:2000]
        (line, ) = _lines(proc)
        assert len(line) < SHORT and rule in line and "1,000,0" in line, (module, line[:2000])
        assert f"{tag}/" in line  # the file (two, for AutoEP layers that disagree)


def test_a_megabyte_global_in_a_refused_pickle_gives_one_short_line(made, tmp_path):
    """The allowlist reader refuses a global a pickle names; a megabyte-long name is quoted cut, with its
    length."""
    import io
    import zipfile

    root, tag = copy_checkpoint(made["dense"], tmp_path)
    path = tag / "mp_rank_00_model_states.pt"
    out = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                data = b"\x80\x02c" + MEGA.encode() + b"\nName\nq\x00."  # GLOBAL MEGA.Name, then STOP
            dst.writestr(info.filename, data)
    path.write_bytes(out.getvalue())
    proc = _run("pyckpt.describe", root)
    assert proc.returncode == 1
    (line, ) = _lines(proc)
    assert len(line) < SHORT and line.startswith(f"pyckpt: error: {path}: refusing to load global 'hhh"), line[:2000]
    assert "...(1,000,005 characters)" in line
