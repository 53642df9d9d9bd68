"""Reading a Universal Checkpoint folder back: pyckpt's converter output or DeepSpeed's ``ds_to_universal.py``'s.

What the folder keeps (DeepSpeed 0.19.8 ``ds_to_universal.main``, and pyckpt's converter, which writes
the same): ``zero/<name>/fp32.pt`` per trainable parameter, its full fp32 master (TP slices merged by
the TP rules, vocabulary rows cut to ``original_vocab_size``, AutoEP experts gathered into ``[E, ...]``;
a ``{'param': tensor, <layout keys>}`` dict, or at ZeRO-3 without TP a raw flat tensor), plus the
optimizer states beside it, ``zero/optimizer_state.pt``, and a copy of every non-expert model-state
file (AutoEP: re-saved with ``universal_checkpoint_info`` added, nothing removed). Those copies still
hold what ``zero_to_fp32`` takes besides the masters: ``module`` (buffers), ``buffer_names``,
``param_shapes``, ``frozen_param_shapes``/``frozen_param_fragments`` and ``shared_params``. So the
consolidated state dict of a universal folder is the one of the ZeRO checkpoint it came from, with
the trainable tensors read from ``fp32.pt`` instead of gathered from the ZeRO shards
(:func:`consolidate_universal`); exporting either gives the same bytes. What the folder does not
keep, and what follows: the ZeRO shards, so a missing or damaged ``fp32.pt`` cannot be rebuilt and is
refused (never replaced by the low-precision ``module`` value); the per-expert ``layer_*_expert_*``
and pipeline ``layer_*-model_*`` files, so native DeepSpeed-MoE experts stay out as under
``dense_only``, and a pipeline checkpoint old enough to lack ``checkpoint_parallel_dimensions`` has
every mp file taken as a tensor-parallel rank (the degrees only steer shape checks and the frozen-parameter
refusal here; the tensors are those of ``fp32.pt`` either way).

The files are read with the safe reader; every tensor becomes a byte range of its ``fp32.pt`` that
the native executor copies directly. :mod:`pyckpt.verify` checks the same files by the same rules
(:mod:`~pyckpt.universal.layout`), collecting problems where this module raises on the first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from ..errors import CheckpointFormatError, quoted
from ..formats.confined import check_links_inside, inside
from ..tensors import NewTensor, numel
from ..formats.pickle_read import TensorRef
from ..formats.torch_zip import SourceFile
from ..planning.plan import Piece
from ..planning.collector import pauses_collector
from ..planning.state import MOMENTS, STEP
from ..zero.consolidated import ConsolidatedState, assemble, trainable_shapes
from ..zero.discovery import follow_pointer, natural_key, parallel_degrees
from ..zero.model_states import ModelStates, read_model_states
from ..zero.names import missing_ranks
from ..zero.optimizer_state import agreed_step
from ..zero.shards import Step
from .layout import (LATEST_UNIVERSAL, OPTIMIZER_STATE, STATES_FOLDER, ZERO3_MODEL_RE, ZERO12_MODEL_RE, fits,
                     param_state_path, read_state)


@dataclass
class UniversalCheckpoint:
    """A universal folder's copied model-state files and the topology they record.

    Field names follow :class:`~pyckpt.zero.discovery.ZeroCheckpoint` where the consolidation reads
    them (``consolidated.assemble``). ``stage`` is 3 or 2: the copied files tell ZeRO-3 apart from
    ZeRO-1/2, not stage 1 from 2, and nothing here depends on that (stage 1 saves no frozen state)."""

    folder: str
    stage: int
    dp: int
    tp: int = 1
    pp: int = 1
    # ZeRO-1/2: the mp_rank_* model states by mp rank; ZeRO-3: those of tp rank 0, by dp rank
    model: List[ModelStates] = field(default_factory=list)
    # ZeRO-3: model_grid[tp][dp]; ZeRO-1/2: [model]
    model_grid: List[List[ModelStates]] = field(default_factory=list)


def find_universal_folder(path) -> Optional[str]:
    """The universal folder ``path`` is, or the one the ``latest_universal`` in it names; None when
    ``path`` is a ZeRO checkpoint (a tag folder, or a folder holding ``latest``) or neither, for ZeRO
    discovery to take or refuse. A save folder holding both pointers is taken as the ZeRO checkpoint:
    both give the same state dict, and that one without the copy's detour."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if "latest" in names or any(n.endswith("_optim_states.pt") for n in names):
        return None
    if STATES_FOLDER in names:
        return path
    if LATEST_UNIVERSAL in names:
        return follow_pointer(path, LATEST_UNIVERSAL)
    return None


@pauses_collector
def discover_universal(folder) -> UniversalCheckpoint:
    """Read and check a universal folder's copied model-state files (the per-parameter files are read
    by :func:`consolidate_universal`, each when its parameter is reached)."""
    folder = os.fspath(folder)
    zero = os.path.join(folder, STATES_FOLDER)
    if not os.path.isdir(zero):
        raise CheckpointFormatError(f"{zero}: not a folder: a Universal Checkpoint keeps every parameter's state in "
                                    "zero/<name>/")
    names = sorted(os.listdir(folder), key=natural_key)
    check_links_inside(folder, names)
    z12 = {int(m.group(1)): n for n in names if (m := ZERO12_MODEL_RE.match(n))}
    z3 = {(int(m.group(2)), int(m.group(1))): n for n in names if (m := ZERO3_MODEL_RE.match(n))}
    if z12 and z3 and set(z12) == {0} and set(z3) == {(0, 0)}:
        # one model-state file under both engines' names: a folder every ZeRO stage resumes from, as
        # pyckpt's conversion of a DCP checkpoint writes it (pyckpt.dcp.to_universal); read as ZeRO-1/2's
        z3 = {}
    if z12 and z3:
        raise CheckpointFormatError(f"{folder}: holds both mp_rank_* (ZeRO-1/2) and zero_pp_rank_* (ZeRO-3) "
                                    "model-state files")
    if not z12 and not z3:
        raise CheckpointFormatError(f"{folder}: no *_model_states.pt file: a Universal Checkpoint keeps a copy of "
                                    "the model states (buffers, parameter shapes, frozen parameters) beside zero/")
    if z12:
        missing, _ = missing_ranks(z12, 1 + max(z12))
        if missing:
            raise CheckpointFormatError(f"{os.path.join(folder, f'mp_rank_{missing[0]:02d}_model_states.pt')}: missing "
                                        f"(found mp ranks {sorted(z12)})")
        model = [read_model_states(SourceFile(os.path.join(folder, z12[m]))) for m in sorted(z12)]
        # The universal folder has no ZeRO shards: one "shard" per model file passes the count check.
        pp, tp = parallel_degrees(folder, model, names, len(model))
        return UniversalCheckpoint(folder, 2, 1, tp, pp, model, [model])
    tp, dp = 1 + max(t for t, _ in z3), 1 + max(d for _, d in z3)
    files = {}
    if len(z3) != tp * dp:
        for t in range(tp):
            missing, _ = missing_ranks({d for (tt, d) in z3 if tt == t}, dp, 1)
            if missing:
                d = missing[0]
                raise CheckpointFormatError(f"{os.path.join(folder, f'zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt')}"
                                            f": missing (found {len(z3)} ZeRO-3 model-state files, up to dp rank "
                                            f"{dp - 1} and tp rank {tp - 1})")
    for t in range(tp):
        for d in range(dp):
            if (t, d) not in z3:
                raise CheckpointFormatError(f"{os.path.join(folder, f'zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt')}"
                                            f": missing (found {len(z3)} ZeRO-3 model-state files, up to dp rank "
                                            f"{dp - 1} and tp rank {tp - 1})")
            files[t, d] = read_model_states(SourceFile(os.path.join(folder, z3[t, d])))
    grid = [[files[t, d] for d in range(dp)] for t in range(tp)]
    # A missing top dp rank leaves no gap in the names; the files say how many there were.
    world = grid[0][0].raw().get("dp_world_size")
    if isinstance(world, int) and not isinstance(world, bool) and world > dp:
        raise CheckpointFormatError(f"{os.path.join(folder, f'zero_pp_rank_{dp}_mp_rank_00_model_states.pt')}: "
                                    f"missing: {os.path.basename(grid[0][0].path)} says dp_world_size is {world}")
    if isinstance(world, int) and not isinstance(world, bool) and world != dp:
        raise CheckpointFormatError(f"{grid[0][0].path}: dp_world_size is {world}, but the folder holds ZeRO-3 "
                                    f"model-state files for {dp} dp ranks")
    return UniversalCheckpoint(folder, 3, dp, tp, 1, grid[0], grid)


def consolidate_universal(uck: UniversalCheckpoint, exclude_frozen: bool = False,
                          dense_only: bool = False) -> ConsolidatedState:
    """The consolidated state dict of the ZeRO checkpoint ``uck`` was converted from (``consolidate``'s).

    ``dense_only`` as for the ZeRO checkpoint: ZeRO-1/2 parameters that the conversion left out
    (native DeepSpeed-MoE experts, which are neither in ``module`` nor written) are left out here too;
    without it a missing ``fp32.pt`` is an error."""
    return assemble(uck, lambda: _trainable(uck, dense_only), exclude_frozen)


def _trainable(uck: UniversalCheckpoint, dense_only: bool, state: str = "fp32") -> Iterator[Tuple[str, NewTensor]]:
    """Every trainable parameter's ``state`` (fp32, exp_avg, exp_avg_sq) from its zero/<name>/ file."""
    local = local_shapes(uck)
    in_module = {name for ms in uck.model for name in ms.module}
    for name, shape in trainable_shapes(uck).items():
        # read_model_states checked every param_shapes key to be one legal folder name
        path = os.path.join(uck.folder, param_state_path(name, state))
        if not os.path.lexists(path):
            if dense_only and uck.stage != 3 and name not in in_module:
                continue  # what the ZeRO export leaves out with dense_only; the conversion wrote nothing
            lister = next(ms for ms in uck.model if name in ms.shapes)
            raise CheckpointFormatError(f"{path}: missing: {os.path.basename(lister.path)} lists {quoted(name)} as "
                                        f"trainable (param_shapes), and its {state} state is this file")
        sf = SourceFile(inside(uck.folder, param_state_path(name, state)))
        obj = sf.load()
        tensor, meta, problems = read_state(obj, uck.stage)
        raw = not isinstance(obj, dict)
        if raw and uck.tp != 1 and not problems:
            problems = ["holds a raw tensor; under tensor parallelism the converters write a dict with a 'param' "
                        "tensor"]
        if problems:
            raise CheckpointFormatError(f"{path}: {problems[0]}")
        full = tuple(tensor.shape)
        # param_shapes is the full shape unless TP-merged or an expert; ZeRO-3 writes dense parameters flat
        whole = uck.tp == 1 and meta.get("is_expert_param") is not True
        if not fits(full, local[name], uck.tp, meta, raw) or (whole and numel(full) != numel(shape)):
            shown = ", ".join(f"tp{t}: {list(s)}" for t, s in sorted(local[name].items()))
            raise CheckpointFormatError(f"{path}: shape {list(full)} does not agree with param_shapes of the model "
                                        f"states ({shown})")
        off, nbytes = sf.tensor_byte_range(tensor)
        yield name, NewTensor("float32", shape if whole else full, [Piece(sf, off, nbytes, 0)] if nbytes else [],
                              tensor.requires_grad)


def universal_optimizer_states(uck: UniversalCheckpoint, trainable) -> Tuple[Dict[str, Dict[str, object]], list]:
    """(name -> {exp_avg, exp_avg_sq, step}, param groups) of the parameters in ``trainable``: the
    moments as their fp32 masters are read (``_trainable``), the step as ``step.pt`` holds it (a 0-d
    tensor, or a number), the groups from ``zero/optimizer_state.pt``."""
    out: Dict[str, Dict[str, object]] = {name: {} for name in trainable}
    for state in MOMENTS:
        for name, t in _trainable(uck, False, state):
            if name in out:
                out[name][state] = t
    opt_file = SourceFile(inside(uck.folder, OPTIMIZER_STATE))
    opt = opt_file.load()
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not isinstance(groups, list):
        raise CheckpointFormatError(f"{opt_file.path}: holds no list of param_groups")
    shared = None
    for name in out:
        if uck.stage == 3 and not os.path.lexists(os.path.join(uck.folder, param_state_path(name, STEP))):
            # DeepSpeed writes no step.pt from ZeRO-3; the step is in rank 0's optimizer state it keeps
            shared = shared if shared is not None else _zero3_step(opt_file, opt)
            out[name][STEP] = shared
            continue
        sf = SourceFile(inside(uck.folder, param_state_path(name, STEP)))
        out[name][STEP] = _step_value(sf, sf.load())
    return out, groups


def _step_value(sf: SourceFile, step):
    """A step as saved (a 0-d tensor, or a number) as a state value: the tensor as byte pieces."""
    if isinstance(step, TensorRef):
        off, nbytes = sf.tensor_byte_range(step)
        return NewTensor(step.dtype, tuple(step.shape), [Piece(sf, off, nbytes, 0)] if nbytes else [])
    return step


def _zero3_step(sf: SourceFile, opt) -> object:
    """The one Adam step of a ZeRO-3 universal folder's optimizer_state.pt (rank 0's torch optimizer
    state, one entry per sub-group, which must agree)."""
    state = opt.get("optimizer_state_dict", {}).get("state") if isinstance(opt.get("optimizer_state_dict"), dict) \
        else None
    steps = [v.get("step") for v in state.values() if isinstance(v, dict) and "step" in v] \
        if isinstance(state, dict) else []
    if not steps:
        raise CheckpointFormatError(f"{sf.path}: no Adam step in its optimizer_state_dict, and the parameters have no "
                                    "step.pt")
    step = agreed_step([Step(sf, s) for s in steps],
                       lambda _: CheckpointFormatError(f"{sf.path}: its sub-groups disagree on the Adam step"))
    return _step_value(sf, step.value)


def local_shapes(uck: UniversalCheckpoint) -> Dict[str, Dict[int, tuple]]:
    """name -> {tp rank: shape in that rank's param_shapes} (the first pipeline stage or dp rank holding it)."""
    if uck.stage == 3:
        holders = [(t, ms) for t, row in enumerate(uck.model_grid) for ms in row]
    else:
        holders = [(m % uck.tp, ms) for m, ms in enumerate(uck.model)]  # mp rank = pp * tp_degree + tp rank
    out: Dict[str, Dict[int, tuple]] = {}
    for rank, ms in holders:
        for name, shape in ms.shapes.items():
            out.setdefault(name, {}).setdefault(rank, shape)
    return out
