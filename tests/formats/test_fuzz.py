"""Fuzzing every parser of untrusted bytes, seeded from real DeepSpeed checkpoints.

Targets: the ZIP reader (whole .pt files with damaged structure), the safe unpickler (damaged
data.pkl bytes), tensor-reference resolution (the storage key, element count, offset, sizes and
strides of tensor records rewritten to hostile values), whole conversions of checkpoints with one
damaged file (ZeRO-2, ZeRO-3 with sub-groups, AutoTP, AutoEP; byte damage, ints and strings
replaced by hostile values of the same type or by values of another type), and the same through
``python -m pyckpt.convert`` in a subprocess, the one target that sees a hang or a crash by signal
(plus a damaged ``latest``). The oracle is the one pyckpt promises:

* the run ends in a pyckpt error (a ``PyckptError``) whose message is one line naming the file, or
* it succeeds, and then every output file loads with ``torch.load(weights_only=True)``;

and in both cases nothing appears outside the output folder and the input is byte-for-byte as it
was. Any other exception, a crash, or a hang fails.

The budget is fixed and the inputs are derandomized, so CI runs the same inputs every time:
``PYCKPT_FUZZ_EXAMPLES`` per cheap target (default 1000), a fifth of that for whole conversions
and a fortieth for command-line runs (each starts a Python process).
A longer campaign: ``PYCKPT_FUZZ_EXAMPLES=20000 pytest -m fuzz`` (tests/README.md).
``PYCKPT_FUZZ_REPORT=path.json`` writes how many inputs each target ran and how they ended.
"""

from __future__ import annotations

import collections
import json
import os
import pickletools
import re
import shutil
import struct
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyckpt
import pyckpt.errors
from pyckpt.huggingface.files import COMPANION_FILES
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.errors import PyckptError
from pyckpt.formats.pickle_read import loads_with_storages
from compare import digest

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("PYCKPT_FUZZ_EXAMPLES", "1000"))
E2E_EXAMPLES = max(1, EXAMPLES // 5)
SEED_CONFIGS = ["s2_bf16_dp2", "s3_fp32_dp2_subgroups", "tp_s1_fp32", "ep_s3_fp32"]
# ZeRO-1/2 and ZeRO-3 planners, AutoTP merges and AutoEP expert gathering each read other metadata.
E2E_CONFIGS = ["s2_bf16_dp2", "s3_fp32_dp2_subgroups", "tp_s1_fp32", "ep_s3_fp32"]

TALLY: dict = collections.defaultdict(collections.Counter)


def _settings(n):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("PYCKPT_FUZZ_REPORT")
    if path:
        report = {t: {"inputs": sum(c.values()), "outcomes": dict(sorted(c.items()))}
                  for t, c in TALLY.items() if not t.startswith("rule:")}
        rules = collections.Counter()
        for t, c in TALLY.items():
            if t.startswith("rule:"):
                rules.update(c)
        report["refusals_by_rule"] = dict(rules.most_common(40))
        # One line per target for the closing figures: conversion:* and cli:* summed over mutations.
        totals = collections.defaultdict(collections.Counter)
        for t, c in TALLY.items():
            if not t.startswith("rule:"):
                totals[t.split(":")[0]].update(c)
        report["by_target"] = {t: {"inputs": sum(c.values()), "outcomes": dict(sorted(c.items()))}
                               for t, c in sorted(totals.items())}
        with open(path, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)


# -- seeds -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def seed_files(checkpoints):
    """Real .pt files of several layouts (ZeRO-2, ZeRO-3 with sub-groups, AutoTP, AutoEP)."""
    files = []
    for name in SEED_CONFIGS:
        tag = checkpoints[name].tag_dir
        for pattern in ("*model_states.pt", "*optim_states.pt"):
            files.append(sorted(tag.glob(pattern))[0])
    return [(str(p), p.read_bytes()) for p in files]


def _members(data: bytes, path: str):
    """(local header offset, data offset, size) of each member, from pyckpt's own reader."""
    sf = SourceFile(path)
    return [(off - 30 - len(name.encode()) - _extra_len(data, off, name), off, size)
            for name, (off, size, _) in sf.members.items()], sf


def _extra_len(data, data_off, name):
    # torch pads local headers with an extra field up to the 64-byte record alignment; find the
    # header by its signature just before the name.
    n = len(name.encode())
    for extra in range(0, 128):
        start = data_off - 30 - n - extra
        if start >= 0 and data[start:start + 4] == b"PK\x03\x04":
            return extra
    return 0


# -- the oracle --------------------------------------------------------------------------------------

def _check_error(exc: BaseException, *names: str) -> str:
    """A pyckpt error, one line, naming one of ``names``; returns the outcome class for the tally."""
    if not isinstance(exc, PyckptError):
        raise AssertionError(f"not a pyckpt error: {type(exc).__name__}: {exc}") from exc
    msg = str(exc)
    assert msg and "\n" not in msg and "\r" not in msg, f"not one line: {msg!r}"
    assert any(n in msg for n in names), f"names none of {names}: {msg}"
    TALLY["rule:"][_rule(msg, names)] += 1
    return type(exc).__name__


def _rule(msg: str, names) -> str:
    """The message without the file name and numbers, to count refusals by the rule they cite."""
    import re
    for n in sorted(names, key=len, reverse=True):
        msg = msg.replace(n, "<file>")
    msg = re.sub(r"<file>[^\s:']*", "<file>", msg)
    msg = re.sub(r"'[^']*'", "'…'", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:110]


# -- mutations ---------------------------------------------------------------------------------------

INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 8, 63, 64, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31, -2**31,
                    2**32 - 1, 2**32, 2**62, 2**63 - 1, -2**63, 2**64, 10**30]
INTERESTING_STRS = ["", ".", "..", "../../../../escape", "/abs", "a/b", "a\x00b", "a\nb", "x" * 300, "0", "1",
                    "99", "-1", "cpu", "cuda:0", "storage", "é", "\udcff", "param_groups", "state"]


def _patch_bytes(draw, data: bytes, focus=None) -> bytes:
    """One byte-level change: flips, overwrites, a run of one value, a cut, an insertion, a copy."""
    n = len(data)
    if focus and draw(st.booleans()):
        lo, hi = focus[draw(st.integers(0, len(focus) - 1))]
    else:
        lo, hi = 0, n
    hi = max(lo + 1, min(hi, n))
    pos = draw(st.integers(lo, hi - 1))
    kind = draw(st.sampled_from(["flip", "set", "run", "truncate", "insert", "delete", "copy"]))
    if kind == "flip":
        return data[:pos] + bytes([data[pos] ^ (1 << draw(st.integers(0, 7)))]) + data[pos + 1:]
    if kind == "set":
        return data[:pos] + bytes([draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, 0x01]))]) + data[pos + 1:]
    if kind == "run":
        length = draw(st.integers(1, 16))
        return data[:pos] + bytes([draw(st.sampled_from([0, 0xFF]))]) * length + data[pos + length:]
    if kind == "truncate":
        return data[:pos]
    if kind == "insert":
        return data[:pos] + draw(st.binary(min_size=1, max_size=8)) + data[pos:]
    if kind == "delete":
        return data[:pos] + data[pos + draw(st.integers(1, 8)):]
    src = draw(st.integers(0, n - 1))
    length = draw(st.integers(1, 32))
    return data[:pos] + data[src:src + length] + data[pos + length:]


def _encode_int(value: int) -> bytes:
    if value == 0:
        return b"\x8a\x00"
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1: any int, whatever the opcode it replaces


def _encode_str(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


INT_OPS = {"BININT", "BININT1", "BININT2", "LONG1"}
STR_OPS = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}


def _pickle_slots(data: bytes):
    """(kind, start, end, inside_tensor) for every int and str argument of the pickle."""
    ops = list(pickletools.genops(data))
    slots = []
    rebuild_memo = set()
    in_tensor = False
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        if op.name in ("GLOBAL", "STACK_GLOBAL") and arg and "_rebuild_tensor" in str(arg):
            in_tensor = True
            if i + 1 < len(ops) and ops[i + 1][0].name in ("BINPUT", "LONG_BINPUT"):
                rebuild_memo.add(ops[i + 1][1])
        elif op.name in ("BINGET", "LONG_BINGET") and arg in rebuild_memo:
            in_tensor = True
        elif op.name == "REDUCE":
            in_tensor = False
        if op.name in INT_OPS:
            slots.append(("int", pos, end, in_tensor))
        elif op.name in STR_OPS:
            slots.append(("str", pos, end, in_tensor))
    return slots


def _splice(data: bytes, slots, start: int, end: int, new: bytes):
    """``data`` with [start, end) replaced by ``new``; the other slots shifted to match, this one gone."""
    delta = len(new) - (end - start)
    moved = [(k, s + delta if s > start else s, e + delta if s > start else e, t) for k, s, e, t in slots
             if s != start]
    return data[:start] + new + data[end:], moved


def _patch_pickle_args(draw, data: bytes, tensors_only: bool) -> bytes:
    slots = [s for s in _pickle_slots(data) if s[3] or not tensors_only]
    if not slots:
        return data
    for _ in range(draw(st.integers(1, 3))):
        kind, start, end, _ = slots[draw(st.integers(0, len(slots) - 1))]
        if kind == "int":
            old = None
            value = draw(st.one_of(st.sampled_from(INTERESTING_INTS), st.integers(-2**40, 2**40)))
            if draw(st.booleans()):  # near the real value: off-by-one and friends
                for op, arg, pos in pickletools.genops(data[start:end] + b"."):
                    old = arg
                    break
                if isinstance(old, int):
                    value = old + draw(st.sampled_from([-1, 1, -8, 8, 64, -64, 4096]))
            new = _encode_int(value)
        else:
            new = _encode_str(draw(st.sampled_from(INTERESTING_STRS)))
        data, slots = _splice(data, slots, start, end, new)
        if not slots:
            break
    return data


# Values of another type where the metadata has an int or a string: the schema checks must catch
# every one before planner arithmetic or string handling meets it.
OTHER_TYPES = [b"N", b"\x88", b"\x89", b"G" + struct.pack(">d", 1.5), b"G" + struct.pack(">d", float("nan")),
               b"G" + struct.pack(">d", float("inf")), b"]", b"}", b")", b"C\x01x", _encode_str("7"),
               _encode_int(2), b"K\x00"]


def _patch_pickle_types(draw, data: bytes, tensors_only: bool = False) -> bytes:
    """One to three int/str arguments replaced by a value of another type (None, bool, float, list,
    dict, tuple, bytes, or an int for a string and a string for an int)."""
    slots = [s for s in _pickle_slots(data) if s[3] or not tensors_only]
    if not slots:
        return data
    for _ in range(draw(st.integers(1, 3))):
        _, start, end, _ = slots[draw(st.integers(0, len(slots) - 1))]
        new = draw(st.sampled_from(OTHER_TYPES))
        data, slots = _splice(data, slots, start, end, new)
        if not slots:
            break
    return data


def _replace_pickle(path: str, data: bytes, pkl: bytes) -> bytes:
    """The archive with its data.pkl replaced (a valid ZIP: pyckpt's reader must get to the pickle)."""
    import io
    import zipfile
    with zipfile.ZipFile(io.BytesIO(data)) as zin:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                body = pkl if info.filename.endswith("/data.pkl") else zin.read(info.filename)
                zout.writestr(info.filename, body)
    return buf.getvalue()


# -- targets -----------------------------------------------------------------------------------------

def _load_like_convert(path: str) -> None:
    SourceFile(path).load()


@_settings(EXAMPLES)
@given(data=st.data())
def test_fuzz_zip_reader(seed_files, data):
    path, original = seed_files[data.draw(st.integers(0, len(seed_files) - 1))]
    members, _ = _members(original, path)
    # ZIP structure lives in the local headers and the central directory at the end: aim there.
    focus = [(h, h + 96) for h, _, _ in members] + [(min(o + s for _, o, s in members), len(original))]
    mutated = _patch_bytes(data.draw, original, focus)
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, os.path.basename(path))
        with open(target, "wb") as f:
            f.write(mutated)
        try:
            _load_like_convert(target)
            outcome = "ok"
        except Exception as exc:  # the oracle decides what is allowed
            outcome = _check_error(exc, target)
    TALLY["zip"][outcome] += 1


@_settings(EXAMPLES)
@given(data=st.data())
def test_fuzz_safe_unpickler(seed_files, data):
    path, original = seed_files[data.draw(st.integers(0, len(seed_files) - 1))]
    sf = SourceFile(path)
    pkl = sf._pickle_bytes
    how = data.draw(st.sampled_from(["bytes", "args", "types"]))
    if how == "bytes":
        mutated = _patch_bytes(data.draw, pkl)
    elif how == "types":
        mutated = _patch_pickle_types(data.draw, pkl)
    else:
        mutated = _patch_pickle_args(data.draw, pkl, tensors_only=False)
    where = "fuzz/archive/data.pkl"
    try:
        _, storages = loads_with_storages(mutated, source=sf, where=where)
        for storage in storages.values():
            sf.storage_offset(storage)
        outcome = "ok"
    except Exception as exc:
        outcome = _check_error(exc, where, path)
    TALLY["unpickler"][outcome] += 1


@_settings(EXAMPLES)
@given(data=st.data())
def test_fuzz_tensor_references(seed_files, data):
    path, original = seed_files[data.draw(st.integers(0, len(seed_files) - 1))]
    pkl = SourceFile(path)._pickle_bytes
    patch = _patch_pickle_types if data.draw(st.integers(0, 3)) == 0 else _patch_pickle_args
    mutated = _replace_pickle(path, original, patch(data.draw, pkl, tensors_only=True))
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, os.path.basename(path))
        with open(target, "wb") as f:
            f.write(mutated)
        try:
            sf = SourceFile(target)
            obj = sf.load()
            outcome = "ok"
            # Accepted references must be ones torch itself would resolve to the same bytes.
            _check_refs_within_records(sf, obj)
        except AssertionError:
            raise
        except Exception as exc:
            outcome = _check_error(exc, target)
    TALLY["tensor-refs"][outcome] += 1


def _check_refs_within_records(sf, obj, depth=0):
    from pyckpt.formats.pickle_read import TensorRef
    if depth > 50:
        return
    if isinstance(obj, TensorRef):
        if obj.numel() == 0:
            return
        off, size, _ = sf.members[f"{sf.prefix}/data/{obj.storage.key}"]
        assert obj.offset >= 0
        last = obj.offset + sum((d - 1) * s for d, s in zip(obj.shape, obj.stride))
        assert (last + 1) * obj.itemsize <= size, (obj, size)
    elif isinstance(obj, dict):
        for v in obj.values():
            _check_refs_within_records(sf, v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _check_refs_within_records(sf, v, depth + 1)


def _passed_through():
    """The classes pyckpt writes back by name because DeepSpeed's own files hold them (loss scalers,
    fragment addresses, ZeroStageEnum, ...): torch's weights-only loader must allow exactly these,
    as DeepSpeed's outputs need them too; anything else in an output fails the oracle."""
    import importlib
    from pyckpt.formats.pickle_read import OPAQUE_CLASSES, OPAQUE_ENUMS
    found = []
    for module, name in sorted(OPAQUE_CLASSES | OPAQUE_ENUMS):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # e.g. numpy.core vs numpy._core spellings
            continue
    return found


def _mutate_file(draw, path: str, original: bytes, how: str) -> bytes:
    if how == "bytes":
        members, _ = _members(original, path)
        focus = [(h, h + 96) for h, _, _ in members] + [(min(o + s for _, o, s in members), len(original))]
        return _patch_bytes(draw, original, focus)
    pkl = SourceFile(path)._pickle_bytes
    if how == "pickle-types":
        return _replace_pickle(path, original, _patch_pickle_types(draw, pkl))
    return _replace_pickle(path, original, _patch_pickle_args(draw, pkl, how == "tensor-refs"))


RANK_NUMBERS = ["0", "1", "2", "3", "4", "00", "01", "007", "99", "4294967296", "99999999999999999999999"]


def _mutate_folder(draw, tag_dir: str, victim: str) -> None:
    """The set of files damaged instead of their bytes: one removed, or copied or moved under another
    rank number (a missing, duplicated or absurdly numbered rank is what discovery must refuse)."""
    src = os.path.join(tag_dir, victim)
    kind = draw(st.sampled_from(["remove", "copy", "move"]))
    if kind == "remove":
        os.remove(src)
        return
    numbers = re.findall(r"\d+", victim)
    if not numbers:
        return
    which = draw(st.integers(0, len(numbers) - 1))
    parts = re.split(r"(\d+)", victim)
    parts[2 * which + 1] = draw(st.sampled_from(RANK_NUMBERS))
    dst = os.path.join(tag_dir, "".join(parts))
    if dst != src:
        (shutil.copyfile if kind == "copy" else os.replace)(src, dst)


@pytest.fixture(scope="module")
def e2e_seeds(checkpoints):
    return {name: checkpoints[name] for name in E2E_CONFIGS}


@_settings(E2E_EXAMPLES)
@given(data=st.data())
def test_fuzz_whole_conversion(e2e_seeds, data):
    name = data.draw(st.sampled_from(E2E_CONFIGS))
    ck = e2e_seeds[name]
    files = sorted(p.name for p in ck.tag_dir.iterdir() if p.suffix == ".pt")
    victim = data.draw(st.sampled_from(files))
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ckpt")
        shutil.copytree(ck.root, root)
        path = os.path.join(root, ck.tag, victim)
        with open(path, "rb") as f:
            original = f.read()
        how = data.draw(st.sampled_from(["bytes", "pickle-args", "pickle-types", "tensor-refs", "files"]))
        if how == "files":
            _mutate_folder(data.draw, os.path.join(root, ck.tag), victim)
        else:
            mutated = _mutate_file(data.draw, path, original, how)  # reads the file: mutate before truncating it
            with open(path, "wb") as f:
                f.write(mutated)
        before = digest(root)
        out_parent = os.path.join(tmp, "out")
        out = os.path.join(out_parent, "u")
        try:
            pyckpt.convert_to_universal(root, out, workers=1, progress=False,
                                        inject_missing_state=True)
            outcome = "ok"
            with torch.serialization.safe_globals(_passed_through()):
                for d, _, fs in os.walk(out):
                    for f in fs:
                        torch.load(os.path.join(d, f), weights_only=True, map_location="cpu")
        except Exception as exc:
            outcome = _check_error(exc, root, out)
            assert not os.path.exists(out), "a failed run left an output"
        assert digest(root) == before, "the input changed"
        outside = sorted(os.listdir(tmp))
        assert outside == (["ckpt", "out"] if os.path.exists(out_parent) else ["ckpt"]), outside
        if os.path.exists(out_parent):
            left = sorted(n for n in os.listdir(out_parent) if n not in ("u", "latest_universal", ".u.pyckpt-lock"))
            assert left == [], left
    TALLY[f"conversion:{how}"][outcome] += 1


# -- the command line, in a subprocess ---------------------------------------------------------------
# In-process targets cannot see a hang or a crash by signal (the latter kills pytest without a
# verdict). Here each run is `python -m pyckpt.convert` under a timeout; --debug makes the CLI let the
# exception through, so its class is visible as the traceback's last line.

CLI_EXAMPLES = max(1, EXAMPLES // 40)
CLI_TIMEOUT_S = 60
_DEBUG_TAIL = re.compile(r"^(?:pyckpt\.errors\.)?(\w+): (.*)$")


def _latest_mutation(draw) -> bytes:
    return draw(st.one_of(st.sampled_from([s.encode("utf-8", "surrogatepass") for s in INTERESTING_STRS]),
                          st.binary(max_size=40)))


@_settings(CLI_EXAMPLES)
@given(data=st.data())
def test_fuzz_cli(e2e_seeds, data):
    name = data.draw(st.sampled_from(E2E_CONFIGS))
    ck = e2e_seeds[name]
    how = data.draw(st.sampled_from(["bytes", "pickle-args", "pickle-types", "tensor-refs", "latest"]))
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ckpt")
        shutil.copytree(ck.root, root)
        if how == "latest":
            victim = os.path.join(root, "latest")
            mutated = _latest_mutation(data.draw)
        else:
            files = sorted(p.name for p in ck.tag_dir.iterdir() if p.suffix == ".pt")
            victim = os.path.join(root, ck.tag, data.draw(st.sampled_from(files)))
            with open(victim, "rb") as f:
                mutated = _mutate_file(data.draw, victim, f.read(), how)
        with open(victim, "wb") as f:
            f.write(mutated)
        before = digest(root)
        out = os.path.join(tmp, "out", "u")
        try:
            proc = subprocess.run([sys.executable, "-m", "pyckpt.convert", "--debug", "--quiet", "--workers", "2",
                                   "--inject_missing_state", root, out],
                                  capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"hang: no exit within {CLI_TIMEOUT_S} s ({how} on {victim})") from None
        assert proc.returncode in (0, 1), f"exit status {proc.returncode} (a signal if negative):\n{proc.stderr[-3000:]}"
        if proc.returncode == 0:
            outcome = "ok"
            with torch.serialization.safe_globals(_passed_through()):
                for d, _, fs in os.walk(out):
                    for f in fs:
                        torch.load(os.path.join(d, f), weights_only=True, map_location="cpu")
        else:
            # --debug prints the traceback; its last line is "<class>: <message>", so a message that
            # is one line leaves the exception's line last.
            lines = proc.stderr.rstrip("\n").split("\n")
            found = _DEBUG_TAIL.match(lines[-1])
            assert found and "Traceback" in proc.stderr, f"no exception at the end of stderr:\n{proc.stderr[-3000:]}"
            cls = getattr(pyckpt.errors, found.group(1), None)
            assert isinstance(cls, type) and issubclass(cls, PyckptError), f"not a pyckpt error: {lines[-1]}"
            assert not any(ln.startswith(found.group(1) + ":") or ln.startswith("pyckpt.errors.")
                           for ln in lines[:-1][-5:]), f"message spans lines:\n{proc.stderr[-3000:]}"
            outcome = _check_error(cls(found.group(2)), root, out)
            assert not os.path.exists(out), "a failed run left an output"
        assert digest(root) == before, "the input changed"
        assert sorted(os.listdir(tmp)) in (["ckpt"], ["ckpt", "out"]), os.listdir(tmp)
        if os.path.exists(os.path.dirname(out)):
            left = sorted(n for n in os.listdir(os.path.dirname(out))
                          if n not in ("u", "latest_universal", ".u.pyckpt-lock"))
            assert left == [], left
    TALLY[f"cli:{how}"][outcome] += 1


# -- the export's companion files ----------------------------------------------------------------------
# The files export copies beside the weights (config, tokenizer, vocab, ...) are named by the folder, not
# parsed from the shards: each is replaced by something hostile (a link out of the checkpoint, to
# /proc, through a folder link, in a loop, dangling; a FIFO, a folder, an oversized file, damaged bytes)
# or harmless (a link that stays inside). The oracle adds to the one above: a copied companion holds
# exactly the bytes of a file inside the checkpoint, and no byte of the file outside reaches the output.

COMPANION_EXAMPLES = max(1, EXAMPLES // 10)
SECRET = b"PYCKPT-FUZZ-SECRET-TOKEN"


def _plant_companion(draw, folder: str, name: str, outside: str) -> bytes:
    """Put a hostile or harmless ``name`` in ``folder``; returns the bytes a copy may hold (b"" when
    none is acceptable)."""
    path = os.path.join(folder, name)
    if os.path.lexists(path):
        os.remove(path)
    kind = draw(st.sampled_from(["outside-abs", "outside-rel", "proc", "via-folder-link", "climb", "inside-rel",
                                 "inside-abs", "loop", "dangling", "fifo", "folder", "oversized", "bytes"]))
    inside_file = os.path.join(folder, "real_" + name)
    good = draw(st.binary(max_size=64))
    with open(inside_file, "wb") as f:
        f.write(good)
    if kind == "outside-abs":
        os.symlink(outside, path)
    elif kind == "outside-rel":
        os.symlink(os.path.relpath(outside, folder), path)
    elif kind == "proc":
        os.symlink(draw(st.sampled_from(["/proc/self/environ", "/proc/self/cmdline", "/proc/self/maps"])), path)
    elif kind == "via-folder-link":
        os.symlink(os.path.dirname(outside), os.path.join(folder, "up"))
        os.symlink(os.path.join("up", os.path.basename(outside)), path)
    elif kind == "climb":
        os.symlink("/".join([".."] * draw(st.integers(1, 4)) + [os.path.basename(outside)]), path)
    elif kind == "inside-rel":
        os.symlink("real_" + name, path)
        return good
    elif kind == "inside-abs":
        os.symlink(inside_file, path)
        return good
    elif kind == "loop":
        os.symlink(name, path)
    elif kind == "dangling":
        os.symlink("no_such_file", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(4097)  # over the cap the target sets
    else:
        with open(path, "wb") as f:
            f.write(good)
        return good
    return b""


@_settings(COMPANION_EXAMPLES)
@given(data=st.data())
def test_fuzz_export_companions(e2e_seeds, data):
    from unittest import mock

    import pyckpt.huggingface.companions as companions
    import pyckpt.huggingface.export as export

    with mock.patch.object(companions, "COMPANION_MAX_BYTES", 4096):
        _export_with_companion(e2e_seeds["s2_bf16_dp2"], data, export)


def _export_with_companion(ck, data, export) -> None:
    name = data.draw(st.sampled_from(list(COMPANION_FILES)))
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ckpt")
        shutil.copytree(ck.root, root)
        outside = os.path.join(tmp, "secret.json")
        with open(outside, "wb") as f:
            f.write(SECRET)
        folder = root if data.draw(st.booleans()) else os.path.join(root, ck.tag)  # the Trainer's place or the tag's
        expected = _plant_companion(data.draw, folder, name, outside)
        before = digest(root)
        out = os.path.join(tmp, "out")
        try:
            export_report = pyckpt.export_hf(root, out, workers=1)
            outcome = "ok"
            assert export_report.files >= 1
            for f in os.listdir(out):
                with open(os.path.join(out, f), "rb") as fh:
                    assert SECRET not in fh.read(), f"{f} holds bytes of a file outside the checkpoint"
            copied = os.path.join(out, name)
            if os.path.exists(copied) and name != "config.json":
                with open(copied, "rb") as fh:
                    assert fh.read() == expected, f"{name} is not the checkpoint's own file"
        except Exception as exc:
            outcome = _check_error(exc, root)
            assert SECRET.decode() not in str(exc)
            assert not os.path.exists(out), "a failed run left an output"
        assert digest(root) == before, "the input changed"
        assert sorted(n for n in os.listdir(tmp) if not n.startswith(".out")) in (
            ["ckpt", "secret.json"], ["ckpt", "out", "secret.json"]), os.listdir(tmp)
    TALLY["export-companions"][outcome] += 1
