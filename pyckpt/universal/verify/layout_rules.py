"""The Universal Checkpoint layout's rules, checked on a folder as it is: every .pt file parses and
passes its CRCs, the model-state files DeepSpeed resumes from are all there, each parameter has what
``load_universal`` reads, in shapes that fit the recorded ``param_shapes``."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from ...errors import CheckpointFormatError, PyckptError, quoted
from ...formats.pickle_read import TensorRef
from ...formats.torch_zip import SourceFile
from ...formats.zip_integrity import member_crc_problems
from ...planning.state import ALL_STATES, FP32, STEP, TENSOR_STATES
from ...tensors import numel
from ...zero.names import missing_ranks, name_problem
from ..layout import (OPTIMIZER_STATE_FILE, STATES_FOLDER, ZERO3_MODEL_RE, ZERO12_MODEL_RE, fits, param_folder,
                      read_state, state_file)
from .report import VerifyReport

STATE_FILES = tuple(state_file(s) for s in ALL_STATES)
TENSOR_FILES = tuple(state_file(s) for s in TENSOR_STATES)
MASTER_FILE = state_file(FP32)
STEP_FILE = state_file(STEP)


class CheckedFiles:
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
            problems = member_crc_problems(sf, self.progress)
            for problem in problems:
                self.report.add(sf.path, problem)
            if not problems:
                obj = sf.load()
        except (PyckptError, OSError) as exc:
            text = str(exc)
            self.report.add(path, text[len(path) + 2:] if text.startswith(f"{path}: ") else text)
            sf, obj = None, None
        self.cache[path] = (sf, obj)
        return sf, obj


def shape_tuple(t) -> Tuple[int, ...]:
    return tuple(int(d) for d in t)


def _model_files(folder: str, names: List[str], report: VerifyReport, files: CheckedFiles):
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
                    trainable.setdefault(name, {}).setdefault(t, shape_tuple(shape))
                    where.setdefault(name, path)
        mod = obj.get("module")
        if stage != 3 and isinstance(mod, dict):
            for name, value in mod.items():
                if isinstance(name, str) and isinstance(value, TensorRef):
                    module.setdefault(name, {}).setdefault(t, shape_tuple(value.shape))
                    where.setdefault(name, path)
    return trainable, module, where


def _check_param(folder: str, name: str, report: VerifyReport, files: CheckedFiles, stage, expected_states,
                 local: Dict[int, tuple], tp: int, where: Optional[str]):
    pdir = os.path.join(folder, param_folder(name))
    present = sorted(os.listdir(pdir))
    for f in present:
        if f not in STATE_FILES:
            # load_hp_checkpoint_state torch.loads every *.pt in the folder and indexes ['param'].
            report.add(os.path.join(pdir, f), "unexpected file in a parameter folder (DeepSpeed's loader reads every "
                       "*.pt here)")
    if MASTER_FILE not in present:
        report.add(os.path.join(pdir, MASTER_FILE), "missing: every parameter needs its fp32 master weights")
    for f in expected_states:
        if f != MASTER_FILE and f not in present:
            report.add(os.path.join(pdir, f), "missing, although the other trainable parameters have it")
    shapes: Dict[str, tuple] = {}
    metas: Dict[str, dict] = {}
    for f in TENSOR_FILES:
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
        shapes[f] = shape_tuple(tensor.shape)
        metas[f] = meta
    if shapes:
        ref_file = MASTER_FILE if MASTER_FILE in shapes else next(iter(shapes))
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
    if STEP_FILE in present:
        path = os.path.join(pdir, STEP_FILE)
        sf, obj = files.open(path)
        if sf is not None and obj is not None:
            if isinstance(obj, TensorRef):
                if numel(obj.shape) != 1:
                    report.add(path, f"step is a tensor of shape {list(obj.shape)}, expected one value")
            elif isinstance(obj, bool) or not isinstance(obj, (int, float)):
                report.add(path, f"step is a {type(obj).__name__}, expected a number or a 0-d tensor")


def verify_folder(folder: str, report: VerifyReport, files: CheckedFiles) -> None:
    """Every rule DeepSpeed's universal loader relies on, checked on the files present."""
    names = sorted(os.listdir(folder))
    stage, tp, models = _model_files(folder, names, report, files)
    zero = os.path.join(folder, STATES_FOLDER)
    if not os.path.isdir(zero):
        report.add(zero, "missing: the per-parameter states and optimizer_state.pt live here")
        return
    opt_path = os.path.join(zero, OPTIMIZER_STATE_FILE)
    if not os.path.lexists(opt_path):
        report.add(opt_path, "missing: DeepSpeed's universal loader asserts it exists")
    else:
        _, osd = files.open(opt_path)
        if osd is not None and not isinstance(osd, dict):
            report.add(opt_path, f"holds a {type(osd).__name__}, expected the optimizer's common state dict")
        elif osd is not None:
            if stage is None:
                from ...zero.schema import zero_stage
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
        if entry == OPTIMIZER_STATE_FILE:
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
                   f"{quoted(name)}")
    # Which state files a trainable parameter must have: those its peers have (Adam: exp_avg,
    # exp_avg_sq; ZeRO-1/2 also step). Zero-sized parameters have no optimizer fragments.
    peers = set()
    for name in params:
        if name in trainable:
            peers |= {f for f in os.listdir(os.path.join(zero, name)) if f in STATE_FILES}
    for name in params:
        local = trainable.get(name) or module.get(name) or {}
        needs = peers if name in trainable and any(numel(s) for s in local.values()) else {MASTER_FILE}
        _check_param(folder, name, report, files, stage, sorted(needs), local, tp, where.get(name))
    report.params = len(params)
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            if f.endswith(".pt") and path not in files.cache:
                files.open(path)  # every file parses and passes its CRCs, even ones no check names
