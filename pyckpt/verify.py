"""Checking a Universal Checkpoint folder before the ZeRO checkpoint it came from is deleted.

``python -m pyckpt.verify OUTPUT [--against INPUT]`` (or :func:`verify_universal`) reads every file
of a universal folder with pyckpt's safe reader (nothing is unpickled with code execution), checks
every ZIP member against its CRC-32, and checks that each parameter has what DeepSpeed's
``load_universal`` reads (``universal_checkpoint.load_hp_checkpoint_state`` and the ZeRO-3 loader):
``zero/<name>/fp32.pt`` plus the optimizer-state files the other parameters have, as a
``{'param': tensor, ...}`` dict (ZeRO-3 dense: a raw tensor), float32, equal shapes, shapes that fit
the ``param_shapes`` of the copied model-state files. ``against`` also plans the conversion of the
ZeRO checkpoint with pyckpt's own planner (writing nothing) and compares file list, shapes, dtypes,
byte counts and the CRC-32 of every planned tensor with the files present.

Problems are collected, not raised: a user deciding whether to delete the source wants the whole
list in one run. Only an OUTPUT that is not a universal folder at all, or an INPUT that cannot be
read, raises (:class:`VerifyInputError`).
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .formats.confined import read_small_text
from .formats.torch_zip import SourceFile, open_regular
from .errors import CheckpointFormatError, PyckptError, VerifyInputError
from .deepspeed.names import check_tag, missing_ranks, name_problem
from .deepspeed.universal_layout import LATEST_UNIVERSAL, ZERO3_MODEL_RE, ZERO12_MODEL_RE, fits, read_state
from .tensors import ITEMSIZE, NewTensor, numel
from .formats.pickle_read import Opaque, TensorRef
from .formats.dtype_cast import cast_bytes
from .native import KIND_SOURCE_DTYPE, _core

STATE_FILES = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt")
MOMENTS = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")
# Read in bounded windows so that checking a multi-GiB record does not need its size in memory.
_CHUNK = 64 << 20
# Planned tensors whose bytes need reordering or dtype conversion are assembled in memory to be
# CRC'd; above this size they are checked for shape and size only (counted in the report).
_ASSEMBLE_LIMIT = 512 << 20


@dataclass
class Problem:
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


@dataclass
class VerifyReport:
    output: str
    against: Optional[str] = None
    stage: Optional[int] = None
    params: int = 0
    files: int = 0
    bytes_checked: int = 0
    content_checked: int = 0  # tensors whose bytes were compared with the input (``against``)
    content_skipped: int = 0  # planned tensors too large to assemble or not comparable
    problems: List[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, path, problem: str) -> None:
        self.problems.append(Problem(os.fspath(path), " ".join(str(problem).split())))

    def summary(self) -> str:
        if self.ok:
            text = (f"OK: {self.params} parameters, {self.files} files, {self.bytes_checked / 2**30:.3f} GiB checked")
            if self.against:
                text += f", matches {self.against}"
                if self.content_checked:
                    text += f" ({self.content_checked} tensors compared by CRC-32)"
            return text
        return f"FAILED: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"

    def to_dict(self) -> dict:
        return {"ok": self.ok, "output": self.output, "against": self.against, "stage": self.stage,
                "params": self.params, "files": self.files, "bytes_checked": self.bytes_checked,
                "content_checked": self.content_checked, "content_skipped": self.content_skipped,
                "problems": [{"path": p.path, "problem": p.problem} for p in self.problems],
                "summary": self.summary()}


def resolve_universal_folder(path, report: Optional[VerifyReport] = None) -> Optional[str]:
    """The universal folder itself, or the one the ``latest_universal`` inside ``path`` names.

    A pointer that names nothing is a problem of the output (the resume would fail), so it goes
    into ``report`` and None comes back; a path that is neither raises VerifyInputError."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise VerifyInputError(f"{path}: not a folder")
    names = os.listdir(path)
    if "zero" in names or any(n.endswith("_model_states.pt") for n in names):
        return path
    latest = os.path.join(path, LATEST_UNIVERSAL)
    if not os.path.lexists(latest):
        raise VerifyInputError(f"{path}: neither a universal checkpoint folder (no zero/ folder, no "
                               "*_model_states.pt) nor a folder holding latest_universal")
    try:
        tag = check_tag(read_small_text(path, LATEST_UNIVERSAL).strip(), latest)
    except CheckpointFormatError as exc:
        if report is None:
            raise
        report.add(latest, str(exc).replace(f"{latest}: ", "", 1))
        return None
    folder = os.path.join(path, tag)
    if not os.path.isdir(folder):
        if report is None:
            raise VerifyInputError(f"{latest} names {tag!r}, but {folder} does not exist")
        report.add(latest, f"names {tag!r}, but {folder} is not a folder: DeepSpeed's load_universal would fail")
        return None
    return folder


# -- reading files -----------------------------------------------------------------------------

def _crc32(data, init: int = 0) -> int:
    return _core.crc32(data, init)


def _check_members(sf: SourceFile, report: VerifyReport, progress) -> bool:
    """Every member's bytes against its CRC-32 (what torch.load would only notice as garbage later)."""
    fd = open_regular(sf.path)
    try:
        size = os.fstat(fd).st_size
        if size != sf.size:
            report.add(sf.path, f"changed size while being checked ({sf.size} -> {size} bytes)")
            return False
        if size == 0:
            return True
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    ok = True
    try:
        view = memoryview(mm)
        try:
            for name, (off, n, crc) in sf.members.items():
                got = 0
                for start in range(off, off + n, _CHUNK):
                    got = _crc32(view[start:min(off + n, start + _CHUNK)], got)
                if progress:
                    progress(n)
                if got != crc:
                    report.add(sf.path, f"member {name} fails its CRC-32 check (stored {crc:08x}, bytes give "
                               f"{got:08x}): the file is corrupt")
                    ok = False
        finally:
            view.release()
    finally:
        mm.close()
    return ok


class _Files:
    """Each .pt file opened, loaded and CRC-checked once; failures become problems."""

    def __init__(self, report: VerifyReport, progress):
        self.report = report
        self.progress = progress
        self.cache: Dict[str, Tuple[Optional[SourceFile], Any]] = {}

    def open(self, path: str) -> Tuple[Optional[SourceFile], Any]:
        if path in self.cache:
            return self.cache[path]
        sf, obj = None, None
        try:
            sf = SourceFile(path)
            self.report.files += 1
            self.report.bytes_checked += sf.size
            # CRCs first: a corrupt data.pkl is then reported as corruption, not as a strange pickle.
            if _check_members(sf, self.report, self.progress):
                obj = sf.load()
        except (PyckptError, OSError) as exc:
            text = str(exc)
            self.report.add(path, text[len(path) + 2:] if text.startswith(f"{path}: ") else text)
            sf, obj = None, None
        self.cache[path] = (sf, obj)
        return sf, obj


# -- the checks --------------------------------------------------------------------------------

def _shape(t) -> Tuple[int, ...]:
    return tuple(int(d) for d in t)


def _model_files(folder: str, names: List[str], report: VerifyReport, files: _Files):
    """(stage, tp degree, [(tp rank, path, obj)]) of the copied model-state files, problems noted."""
    z12 = sorted((int(m.group(1)), n) for n in names if (m := ZERO12_MODEL_RE.match(n)))
    z3 = sorted((int(m.group(2)), int(m.group(1)), n) for n in names if (m := ZERO3_MODEL_RE.match(n)))
    if z12 and z3:
        report.add(folder, "holds both mp_rank_* (ZeRO-1/2) and zero_pp_rank_* (ZeRO-3) model-state files")
    if not z12 and not z3:
        report.add(folder, "no *_model_states.pt file: DeepSpeed's load_checkpoint reads the model states from here")
        return None, 1, []
    loaded = []
    if z3 and not z12:
        stage = 3
        for mp, dp, n in z3:
            _, obj = files.open(os.path.join(folder, n))
            loaded.append((mp, dp, n, obj))
        ref = next((o for *_, o in loaded if isinstance(o, dict)), None)
        dp_world = ref.get("dp_world_size") if ref else None
        mp_world = ref.get("mp_world_size") if ref else None
        dps = 1 + max(dp for _, dp, _, _ in loaded)
        mps = 1 + max(mp for mp, _, _, _ in loaded)
        dp_world = dp_world if isinstance(dp_world, int) and dp_world > 0 else dps
        mp_world = mp_world if isinstance(mp_world, int) and mp_world > 0 else mps
        have = {(mp, dp) for mp, dp, _, _ in loaded}
        # World sizes come from a pickle and ranks from names: list a few missing files, never loop
        # over a huge grid (missing_ranks looks at most len(have) + 5 cells).
        width = max(dp_world, dps)
        cells = {mp * width + dp for mp, dp in have}
        listed, count = missing_ranks(cells, max(mp_world, mps) * width)
        for cell in listed:
            mp, dp = divmod(cell, width)
            report.add(os.path.join(folder, f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"),
                       f"missing: the model states name dp_world_size={dp_world}, mp_world_size={mp_world}"
                       + (f" ({count} files missing in all)" if count > len(listed) else ""))
        tp = max(mp_world, mps)
        return stage, tp, [(mp, os.path.join(folder, n), obj) for mp, _, n, obj in loaded]
    stage = None
    for mp, n in z12:
        _, obj = files.open(os.path.join(folder, n))
        loaded.append((mp, n, obj))
    ref = next((o for *_, o in loaded if isinstance(o, dict)), None)
    dims = ref.get("checkpoint_parallel_dimensions") if ref else None
    count = 1 + max(mp for mp, _, _ in loaded)
    tp = count
    if isinstance(dims, dict) and all(isinstance(dims.get(k), int) for k in ("pp_degree", "tp_degree")):
        tp = max(1, dims["tp_degree"])
        count = max(count, dims["pp_degree"] * dims["tp_degree"])
    have = {mp for mp, _, _ in loaded}
    for mp in range(count):
        if mp not in have:
            report.add(os.path.join(folder, f"mp_rank_{mp:02d}_model_states.pt"),
                       f"missing: the model states say {count} model-parallel rank(s)"
                       + (f" (checkpoint_parallel_dimensions {dict(dims)})" if isinstance(dims, dict) else ""))
    return stage, tp, [(mp % tp, os.path.join(folder, n), obj) for mp, n, obj in loaded]


def _collect_shapes(models, stage):
    """name -> {tp rank: shape} from param_shapes; name -> {tp rank: shape} of module tensors; where."""
    trainable: Dict[str, Dict[int, tuple]] = {}
    module: Dict[str, Dict[int, tuple]] = {}
    where: Dict[str, str] = {}
    for t, path, obj in models:
        if not isinstance(obj, dict):
            continue
        groups = obj.get("param_shapes")
        for g in groups if isinstance(groups, (list, tuple)) else ():
            if not isinstance(g, dict):
                continue
            for name, shape in g.items():
                if isinstance(name, str) and isinstance(shape, (tuple, list)):
                    trainable.setdefault(name, {}).setdefault(t, _shape(shape))
                    where.setdefault(name, path)
        mod = obj.get("module")
        if stage != 3 and isinstance(mod, dict):
            for name, value in mod.items():
                if isinstance(name, str) and isinstance(value, TensorRef):
                    module.setdefault(name, {}).setdefault(t, _shape(value.shape))
                    where.setdefault(name, path)
    return trainable, module, where


def _check_param(folder: str, name: str, report: VerifyReport, files: _Files, stage, expected_states,
                 local: Dict[int, tuple], tp: int, where: Optional[str]):
    pdir = os.path.join(folder, "zero", name)
    present = sorted(os.listdir(pdir))
    for f in present:
        if f not in STATE_FILES:
            # load_hp_checkpoint_state torch.loads every *.pt in the folder and indexes ['param'].
            report.add(os.path.join(pdir, f), "unexpected file in a parameter folder (DeepSpeed's loader reads every "
                       "*.pt here)")
    if "fp32.pt" not in present:
        report.add(os.path.join(pdir, "fp32.pt"), "missing: every parameter needs its fp32 master weights")
    for f in expected_states:
        if f != "fp32.pt" and f not in present:
            report.add(os.path.join(pdir, f), "missing, although the other trainable parameters have it")
    shapes: Dict[str, tuple] = {}
    metas: Dict[str, dict] = {}
    for f in MOMENTS:
        if f not in present:
            continue
        path = os.path.join(pdir, f)
        sf, obj = files.open(path)
        if sf is None or obj is None:
            continue
        tensor, meta, problems = read_state(obj, stage)
        for problem in problems:
            report.add(path, problem)
        if tensor is None:
            continue
        shapes[f] = _shape(tensor.shape)
        metas[f] = meta
    if shapes:
        ref_file = "fp32.pt" if "fp32.pt" in shapes else next(iter(shapes))
        ref = shapes[ref_file]
        for f, s in shapes.items():
            if s != ref:
                report.add(os.path.join(pdir, f), f"shape {list(s)} differs from {ref_file}'s {list(ref)}")
        meta = metas[ref_file]
        raw = stage == 3 and not isinstance(files.cache[os.path.join(pdir, ref_file)][1], dict)
        for f, s in shapes.items():
            if (s == ref or f == ref_file) and not fits(s, local, tp, meta, raw):
                shown = ", ".join(f"tp{t}: {list(v)}" for t, v in sorted(local.items()))
                report.add(os.path.join(pdir, f), f"shape {list(s)} does not agree with the shape recorded in "
                           f"{os.path.basename(where) if where else 'the model states'} ({shown})")
    if "step.pt" in present:
        path = os.path.join(pdir, "step.pt")
        sf, obj = files.open(path)
        if sf is not None and obj is not None:
            if isinstance(obj, TensorRef):
                if numel(obj.shape) != 1:
                    report.add(path, f"step is a tensor of shape {list(obj.shape)}, expected one value")
            elif isinstance(obj, bool) or not isinstance(obj, (int, float)):
                report.add(path, f"step is a {type(obj).__name__}, expected a number or a 0-d tensor")


def verify_universal(output, against=None, *, inject_missing_state: bool = True, dense_only: bool = False,
                     content: bool = True, progress: bool = False) -> VerifyReport:
    """Check a Universal Checkpoint folder (or the folder holding ``latest_universal``).

    Returns a :class:`VerifyReport`; ``report.ok`` is False with one :class:`Problem` per defect.
    With ``against`` (the ZeRO checkpoint it was converted from) the conversion is planned again and
    the output compared with the plan: same files, shapes, dtypes and byte counts, and (``content``)
    the CRC-32 of every planned tensor. Raises VerifyInputError when OUTPUT is not a universal folder
    or INPUT cannot be read; nothing is written, nothing is unpickled with code execution.
    """
    report = VerifyReport(os.path.abspath(os.fspath(output)))
    folder = resolve_universal_folder(output, report)
    if folder is None:
        return report
    folder = os.path.abspath(folder)
    report.output = folder
    bar = _Progress(folder) if progress else None
    files = _Files(report, bar.update if bar else None)
    try:
        _verify_folder(folder, report, files)
        if against is not None:
            report.against = os.path.abspath(os.fspath(against))
            _verify_against(folder, against, report, files, inject_missing_state, dense_only, content)
    finally:
        if bar:
            bar.close()
    return report


def _verify_folder(folder: str, report: VerifyReport, files: _Files) -> None:
    names = sorted(os.listdir(folder))
    stage, tp, models = _model_files(folder, names, report, files)
    zero = os.path.join(folder, "zero")
    if not os.path.isdir(zero):
        report.add(zero, "missing: the per-parameter states and optimizer_state.pt live here")
        return
    opt_path = os.path.join(zero, "optimizer_state.pt")
    if not os.path.lexists(opt_path):
        report.add(opt_path, "missing: DeepSpeed's universal loader asserts it exists")
    else:
        _, osd = files.open(opt_path)
        if osd is not None and not isinstance(osd, dict):
            report.add(opt_path, f"holds a {type(osd).__name__}, expected the optimizer's common state dict")
        elif osd is not None:
            if stage is None:
                from .deepspeed.schema import zero_stage
                try:
                    stage = zero_stage(opt_path, osd.get("zero_stage"))
                except CheckpointFormatError as exc:
                    report.add(opt_path, str(exc).split(": ", 1)[-1])
            if stage == 3:
                # stage3's loader reads the step and hyper-parameters from the nested optimizer dict
                inner = osd.get("optimizer_state_dict")
                if not isinstance(inner, dict) or "param_groups" not in inner or not inner.get("state"):
                    report.add(opt_path, "has no optimizer_state_dict with state and param_groups, which the "
                               "ZeRO-3 universal loader reads the step and hyper-parameters from")
            else:
                if not osd.get("ds_version"):
                    report.add(opt_path, "has no ds_version, which DeepSpeed's universal loader asserts")
                if "param_groups" not in osd:
                    report.add(opt_path, "has no param_groups: the loader takes the hyper-parameters from it")
    report.stage = stage
    trainable, module, where = _collect_shapes(models, stage)
    expected = set(trainable) | (set(module) if stage != 3 else set())
    # The parameter set comes from the model states; with one unreadable (already reported) every
    # parameter it names would be reported again as extra.
    models_ok = bool(models) and all(isinstance(obj, dict) for _, _, obj in models)
    entries = sorted(os.listdir(zero))
    params = []
    for entry in entries:
        path = os.path.join(zero, entry)
        if entry == "optimizer_state.pt":
            continue
        if not os.path.isdir(path):
            report.add(path, "unexpected file in zero/ (only parameter folders and optimizer_state.pt belong here)")
            continue
        problem = name_problem(entry)
        if problem:
            report.add(path, f"folder name {problem}: not a parameter name")
            continue
        params.append(entry)
        if models_ok and entry not in expected:
            report.add(path, "extra parameter: no copied model-state file names it in param_shapes"
                       + ("" if stage == 3 else " or module"))
    for name in sorted(expected - set(params) if models_ok else ()):
        report.add(os.path.join(zero, name), f"missing parameter folder: {os.path.basename(where[name])} names "
                   f"{name!r}")
    # Which state files a trainable parameter must have: those its peers have (Adam: exp_avg,
    # exp_avg_sq; ZeRO-1/2 also step). Zero-sized parameters have no optimizer fragments.
    peers = set()
    for name in params:
        if name in trainable:
            peers |= {f for f in os.listdir(os.path.join(zero, name)) if f in STATE_FILES}
    for name in params:
        local = trainable.get(name) or module.get(name) or {}
        needs = peers if name in trainable and any(numel(s) for s in local.values()) else {"fp32.pt"}
        _check_param(folder, name, report, files, stage, sorted(needs), local, tp, where.get(name))
    report.params = len(params)
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            if f.endswith(".pt") and path not in files.cache:
                files.open(path)  # every file parses and passes its CRCs, even ones no check names


# -- against the ZeRO checkpoint ---------------------------------------------------------------

def _verify_against(folder, against, report, files: _Files, inject_missing_state, dense_only, content):
    from .deepspeed.universal_plan import read_zero_state
    from .deepspeed.universal_write import param_of_path, universal_plan
    from .errors import metadata_errors
    from .deepspeed.discovery import discover
    try:
        with metadata_errors(against):
            ck = discover(against)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # unused-pattern warnings are the converter's business
                state, _ = read_zero_state(ck, inject_missing_state, dense_only, strict=False)
                plan = universal_plan(state)
    except (PyckptError, OSError) as exc:
        raise VerifyInputError(f"cannot plan the conversion of {os.fspath(against)}: {exc}") from None
    planned = {}
    for arc in plan.archives:
        planned[arc.relpath] = ("archive", arc.obj)
    for c in plan.copies:
        planned[c.relpath] = ("copy", c.src)
    present = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        for f in filenames:
            present.add(os.path.relpath(os.path.join(dirpath, f), folder).replace(os.sep, "/"))
    planned_params = set(state.params)
    present_params = {param_of_path(rel) for rel in present} - {None}
    missing_params = set()
    for rel in sorted(set(planned) - present):
        param = param_of_path(rel)
        if param is not None and param not in present_params:
            if param not in missing_params:  # one line for the whole folder, not one per state file
                missing_params.add(param)
                report.add(os.path.join(folder, "zero", param), f"missing parameter folder: converting "
                           f"{ck.folder} writes it")
            continue
        report.add(os.path.join(folder, rel), f"missing: converting {ck.folder} writes it")
    reported_dirs = set()
    for rel in sorted(present - set(planned)):
        param = param_of_path(rel)
        if param is not None and param not in planned_params:
            if param not in reported_dirs:
                reported_dirs.add(param)
                report.add(os.path.join(folder, "zero", param), f"extra parameter: converting {ck.folder} "
                           "writes no such folder")
            continue
        report.add(os.path.join(folder, rel), f"extra file: converting {ck.folder} does not write it")
    reader = _Reader()
    try:
        _compare_files(folder, planned, present, report, files, reader, content)
    finally:
        reader.close()


def _compare_files(folder, planned, present, report, files, reader, content) -> None:
    for rel in sorted(set(planned) & present):
        path = os.path.join(folder, rel)
        kind, what = planned[rel]
        if kind == "copy":
            size = os.path.getsize(path)
            if size != what.size:
                report.add(path, f"is {size} bytes; the copy of {what.path} should be {what.size}")
            elif content and not _same_file_bytes(what.path, path):
                report.add(path, f"differs from {what.path}, of which it should be a copy")
            continue
        sf, obj = files.open(path)
        if sf is None or obj is None:
            continue
        _compare(what, obj, sf, "", path, report, reader if content else None)


def _same_file_bytes(a: str, b: str) -> bool:
    fa, fb = open_regular(a), open_regular(b)
    try:
        while True:
            x, y = os.read(fa, _CHUNK), os.read(fb, _CHUNK)
            if x != y:
                return False
            if not x:
                return True
    finally:
        os.close(fa)
        os.close(fb)


def _compare(expected, actual, sf: SourceFile, where: str, path: str, report: VerifyReport, reader) -> None:
    """Walk the planned object and the file's object together; tensors by dtype, shape and (with a
    ``reader``) the CRC-32 of their bytes."""
    if isinstance(expected, (NewTensor, TensorRef)):
        if not isinstance(actual, TensorRef):
            report.add(path, f"{_at(where)}expected a tensor, found a {type(actual).__name__}")
            return
        shape = _shape(expected.shape)
        if (expected.dtype, shape) != (actual.dtype, _shape(actual.shape)):
            report.add(path, f"{_at(where)}{actual.dtype}{list(actual.shape)}, but converting the input gives "
                       f"{expected.dtype}{shape} ({numel(shape) * ITEMSIZE[expected.dtype]} bytes)")
            return
        if reader is not None:
            want = _planned_crc(expected, reader)
            if want is None:
                report.content_skipped += 1
                return
            got = _file_tensor_crc(sf, actual, reader)
            if got is None:
                report.content_skipped += 1
            elif got != want:
                report.add(path, f"{_at(where)}tensor bytes differ from the input's (CRC-32 {got:08x}, expected "
                           f"{want:08x})")
            else:
                report.content_checked += 1
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            report.add(path, f"{_at(where)}expected a dict, found a {type(actual).__name__}")
            return
        if list(expected) != list(actual):
            report.add(path, f"{_at(where)}keys {list(actual)[:12]}, but converting the input gives "
                       f"{list(expected)[:12]}")
            return
        for key in expected:
            _compare(expected[key], actual[key], sf, f"{where}[{key!r}]", path, report, reader)
        return
    if isinstance(expected, (list, tuple)) and not isinstance(expected, str):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            report.add(path, f"{_at(where)}expected a sequence of {len(expected)}, found {_short(actual)}")
            return
        for i, (e, a) in enumerate(zip(expected, actual)):
            _compare(e, a, sf, f"{where}[{i}]", path, report, reader)
        return
    if isinstance(expected, Opaque):
        return  # inert records (loss scaler, enums) are written back as read; nothing to compare by value
    if isinstance(expected, (bool, int, float, str, type(None))):
        same = expected == actual and type(expected) is type(actual)
        if isinstance(expected, float) and isinstance(actual, float) and math.isnan(expected) and math.isnan(actual):
            same = True
        if not same:
            report.add(path, f"{_at(where)}{_short(actual)}, but converting the input gives {_short(expected)}")


def _at(where: str) -> str:
    """Where in the file's object a difference is: '' for the whole object, else a key path."""
    return f"at {where}: " if where else ""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _planned_crc(t, reader: "_Reader") -> Optional[int]:
    """CRC-32 of the bytes the plan would write for ``t``, or None when not worth computing."""
    if isinstance(t, TensorRef):
        sf = t.storage.source
        if not t.is_contiguous():
            return None
        off, n = sf.tensor_byte_range(t)
        return reader.crc(sf, off, n)
    if not isinstance(t, NewTensor):
        return None
    nbytes = numel(t.shape) * ITEMSIZE[t.dtype]
    if t.data is not None:
        return _crc32(t.data)
    pieces = sorted(t.pieces, key=lambda p: p.dst_off)
    if all(p.kind == 0 and p.rows <= 1 for p in pieces):
        pos, crc = 0, 0
        for p in pieces:
            if p.dst_off != pos:
                return None  # not a plain concatenation: would need assembling
            crc = reader.crc(p.src, p.src_off, p.nbytes, crc)
            pos += p.nbytes
        return crc if pos == nbytes else None
    if nbytes > _ASSEMBLE_LIMIT:
        return None
    return _crc32(_assemble(t, nbytes, reader))


class _Reader:
    """Reads byte ranges of checked files through one descriptor per file: a ZeRO plan has a piece
    per parameter per rank, and opening the shard for each would dominate the comparison."""

    def __init__(self):
        self._fds: Dict[str, Tuple[int, int]] = {}

    def read(self, sf, off: int, n: int) -> bytes:
        entry = self._fds.get(sf.path)
        if entry is None:
            fd = open_regular(sf.path)
            entry = self._fds[sf.path] = (fd, os.fstat(fd).st_size)
        fd, size = entry
        if off < 0 or n < 0 or off + n > size:
            raise CheckpointFormatError(f"{sf.path}: byte range [{off}, {off + n}) is outside the {size}-byte file")
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise CheckpointFormatError(f"{sf.path}: the file shrank while being read")
        return data

    def crc(self, sf, off: int, n: int, crc: int = 0) -> int:
        for start in range(off, off + n, _CHUNK):
            crc = _crc32(self.read(sf, start, min(off + n, start + _CHUNK) - start), crc)
        return crc

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _assemble(t, nbytes: int, reader: "_Reader") -> bytes:
    """The planned bytes of a strided or converting NewTensor, as the executor would write them,
    computed apart from it (numpy casts, Python copies)."""
    out = bytearray(nbytes)
    for p in t.pieces:
        for i in range(max(1, p.rows)):
            data = reader.read(p.src, p.src_off + i * p.nbytes, p.nbytes)
            if p.kind:
                data = cast_bytes(data, KIND_SOURCE_DTYPE[p.kind], t.dtype)
            dst = p.dst_off + i * p.stride
            out[dst:dst + len(data)] = data
    return bytes(out)


def _file_tensor_crc(sf: SourceFile, t: TensorRef, reader: "_Reader") -> Optional[int]:
    if not t.is_contiguous():
        return None
    off, n = sf.tensor_byte_range(t)
    name = f"{sf.prefix}/data/{t.storage.key}"
    member = sf.members.get(name)
    if member is not None and member[0] == off and member[1] == n:
        return member[2]  # the whole record: its stored CRC, already checked against the bytes
    return reader.crc(sf, off, n)


class _Progress:
    """A byte counter on stderr, shown only on a terminal (as the converter's bar)."""

    def __init__(self, folder: str):
        total = 0
        for dirpath, _, filenames in os.walk(folder):
            for f in filenames:
                try:
                    total += os.path.getsize(os.path.join(dirpath, f))
                except OSError:
                    pass
        from tqdm import tqdm
        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                         desc="pyckpt verify", leave=False, disable=None)

    def update(self, n: int) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


# -- command line ------------------------------------------------------------------------------

if __name__ == "__main__":
    # The command line lives in cli_verify, which the pyckpt console script imports without numpy.
    from .cli_verify import main
    sys.exit(main())
