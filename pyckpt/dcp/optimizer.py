"""DeepSpeed's optimizer state as torch's Adam/AdamW holds it, for the DCP export: what
``get_state_dict(model, optimizer)`` gives under FSDP2 for the same training.

Every trainable parameter's fp32 ``exp_avg`` and ``exp_avg_sq`` (the ZeRO partitions' own bytes, or a
Universal Checkpoint's files) and torch's float32 ``step``; DeepSpeed's param groups in order, each with
its hyper-parameters, the keys torch's Adam adds, and its parameters by name. The state can be laid out
nested or flattened (``flatten_optimizer_state_dict``), and renamed with the model: AutoEP layers under
their Hugging Face names, or torchtitan's Llama3 names with q, k and v as its fused ``wqkv``.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Dict, List, Optional

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, quoted
from ..formats.plain_data import PLAIN_RULE, kind, plain_problem
from ..huggingface.autoep_names import hf_renames, to_hf_names
from ..planning.state import MOMENTS, STEP
from ..tensors import FLOATING, NewTensor, numel
from ..universal.input import optimizer_states
from ..zero.consolidated import cast
from .layout import BytesEntry, Layout, TensorEntry, chunk_tensor
from .torchtitan import Heads, fused_members, optimizer_renames, to_torchtitan_optimizer

# The keys of a torch Adam/AdamW param group that DeepSpeed's own optimizers (FusedAdam, CPUAdam) do
# not keep, with torch's defaults: a load into torch's optimizer needs every key its groups have.
TORCH_ADAM_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "fused": None}


def _param_value(value) -> NewTensor:
    """A universal state's tensor: the value itself, or the 'param' of its dict with merge markers."""
    return value["param"] if isinstance(value, dict) else value


def _as_float32_step(name: str, step) -> NewTensor:
    """torch Adam's step: a 0-d float32 tensor (a number DeepSpeed's own Adam keeps becomes one)."""
    if isinstance(step, NewTensor):
        if numel(step.shape) != 1 or step.dtype not in FLOATING:
            raise CheckpointFormatError(f"the Adam step of {quoted(name)} is a {step.dtype} tensor of shape "
                                        f"{list(step.shape)}, not one number")
        step = cast(step, "float32")
        return NewTensor("float32", (), step.pieces, False, step.data)
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise CheckpointFormatError(f"the Adam step of {quoted(name)} is a {type(step).__name__}, not a number")
    return NewTensor("float32", (), [], False, struct.pack("<f", float(step)))


def _param_groups(ck, groups: List[dict], trainable: Dict[str, tuple]) -> List[dict]:
    """DeepSpeed's param groups as torch's optimizer keeps them, each with its parameters by name.

    DeepSpeed's saved groups are its torch optimizer's, whose 'params' are the indices of the flat
    partitions that group holds: one per group under ZeRO-1/2, one per sub-group under ZeRO-3.
    ``param_shapes`` of the model states lists each flat partition's parameters in order (the same
    index, across pipeline stages and tensor ranks)."""
    out, seen = [], set()
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            raise CheckpointFormatError(f"{ck.folder}: param group {i} of the optimizer state is a "
                                        f"{type(group).__name__}, not a dict")
        flats = group.get("params")
        if (not isinstance(flats, list) or any(isinstance(j, bool) or not isinstance(j, int) or j < 0 for j in flats)):
            raise CheckpointFormatError(f"{ck.folder}: param group {i} of the optimizer state has no list of flat "
                                        "partition indices under 'params'")
        names = []
        for ms in ck.model:
            for j in flats:
                if j >= len(ms.groups):
                    raise CheckpointFormatError(f"{ms.path}: param group {i} holds flat partition {j}, but "
                                                f"param_shapes lists {len(ms.groups)}")
                for name in ms.groups[j]:
                    if name in trainable and name not in seen:
                        seen.add(name)
                        names.append(name)
        g = {k: v for k, v in group.items() if k != "params"}
        for k, v in g.items():
            # torch.load(weights_only=False) reads these back in dcp.load: only plain data may go in
            problem = plain_problem(v) if isinstance(k, str) else f"a key that is a {kind(k)}"
            if problem:
                raise CheckpointFormatError(f"{ck.folder}: param group {i} of the optimizer state holds {quoted(k)} = "
                                            f"{problem}; a DCP export writes only plain data ({PLAIN_RULE})")
        if "adam_w_mode" in g and "decoupled_weight_decay" not in g:
            g["decoupled_weight_decay"] = bool(g["adam_w_mode"])  # DeepSpeed's Adam in AdamW mode
        for k, v in TORCH_ADAM_DEFAULTS.items():
            g.setdefault(k, v)
        g.setdefault("decoupled_weight_decay", False)
        g["params"] = names
        out.append(g)
    lost = [name for name in trainable if name not in seen]
    if lost:
        raise CheckpointFormatError(f"{ck.folder}: the trainable parameter {quoted(lost[0])} is in none of the "
                                    "optimizer's param groups")
    return out


def add_optimizer(ck, cstate, layout: Layout, prefix: tuple, chunk_bytes: int, naming: Optional[tuple],
                   flat: bool, heads: Optional[Heads] = None, initial_lr: Optional[float] = None) -> None:
    skip = set(cstate.buffers) | set(cstate.frozen)
    trainable = {name: tuple(t.shape) for name, t in cstate.tensors.items() if name not in skip}
    states, groups = optimizer_states(ck, cstate, trainable)
    moments: Dict[str, "OrderedDict[str, NewTensor]"] = {s: OrderedDict() for s in MOMENTS}
    steps: "OrderedDict[str, NewTensor]" = OrderedDict()
    for name, shape in trainable.items():
        held = states.get(name)
        if held is None or any(s not in held for s in MOMENTS + (STEP,)):
            missing = [s for s in MOMENTS + (STEP,) if not held or s not in held]
            raise UnsupportedCheckpointError(f"{ck.folder}: no {'/'.join(missing)} state for the trainable parameter "
                                             f"{quoted(name)}: only Adam/AdamW optimizer state exports to DCP")
        for s in MOMENTS:
            t = _param_value(held[s])
            if numel(t.shape) != numel(shape) or t.dtype != "float32":
                raise UnsupportedCheckpointError(f"{ck.folder}: the {s} of {quoted(name)} is {t.dtype} "
                                                 f"{list(t.shape)}, not the parameter's float32 {list(shape)}")
            moments[s][name] = NewTensor(t.dtype, shape, t.pieces, False, t.data)
        steps[name] = _as_float32_step(name, held[STEP])
    extra = sorted(set(states) - set(trainable))
    if extra:
        raise CheckpointFormatError(f"{ck.folder}: optimizer state for {quoted(extra[0])}, which the model states do "
                                    "not list as a trainable parameter")
    param_groups = _param_groups(ck, groups, trainable)
    if naming is not None:
        moments = {s: to_hf_names(m, *naming, ck.folder) for s, m in moments.items()}
        renames = hf_renames(*naming)
        folded = {n: n[:-len("w3")] + "w1" for n, hf in renames.items() if hf is None}
        param_groups, steps = _renamed_groups(ck, param_groups, steps, renames, folded)
    if heads is not None:
        moments = {s: to_torchtitan_optimizer(m, heads) for s, m in moments.items()}
        renames = optimizer_renames(steps, ck.folder)
        folded = {member: q for q, k, v in fused_members(steps, ck.folder) for member in (k, v)}
        param_groups, steps = _renamed_groups(ck, param_groups, steps, renames, folded)
        if initial_lr is None and any("initial_lr" not in g for g in param_groups):
            raise UnsupportedCheckpointError(
                f"{ck.folder}: torchtitan's LR scheduler puts initial_lr in every param group before it loads a "
                "checkpoint, and its load asks the checkpoint for it, which this one's groups lack: pass "
                "initial_lr (--initial-lr), the learning rate the torchtitan job's schedule starts from")
    if initial_lr is not None:
        param_groups = [dict(g, initial_lr=float(initial_lr)) for g in param_groups]
    for name in moments[MOMENTS[0]]:
        for s in MOMENTS:
            t = moments[s][name]
            layout.tensors.append(TensorEntry(prefix + ("state", name, s), "float32", tuple(t.shape),
                                              chunk_tensor(t, chunk_bytes)))
        layout.tensors.append(TensorEntry(prefix + ("state", name, "step"), "float32", (), chunk_tensor(steps[name])))
    for i, group in enumerate(param_groups):
        if flat:
            # torch's flatten_optimizer_state_dict: each parameter's group values under its own name,
            # the members implied (torchtitan's checkpointer keeps its optimizer so)
            for name in group["params"]:
                for key, value in group.items():
                    if key != "params":
                        layout.objects.append(BytesEntry(prefix + ("param_groups", name, key), value))
            continue
        for key, value in group.items():
            layout.objects.append(BytesEntry(prefix + ("param_groups", i, key), value))


def _step_key(step: NewTensor) -> tuple:
    """What a step tensor holds: its dtype and bytes (a 0-d tensor: a few bytes read)."""
    data = step.data if step.data is not None else b"".join(p.src.read_bytes(p.src_off, p.nbytes) for p in step.pieces)
    return step.dtype, tuple((p.kind, p.nbytes) for p in step.pieces), data


def _renamed_groups(ck, groups: List[dict], steps: "OrderedDict[str, NewTensor]", renames: Dict[str, Optional[str]],
                    folded: Dict[str, str]):
    """The param groups' members and the steps under other names (Hugging Face's, torchtitan's). A
    parameter renamed to None is folded into another (``folded``: w3 into w1's gate_up_proj, k and v
    into q's fused wqkv), which takes its step and group, so the two must share both (DeepSpeed keeps
    one step per group)."""
    group_of = {name: i for i, g in enumerate(groups) for name in g["params"]}
    for name, kept in folded.items():
        if name in group_of:
            what = renames.get(kept) or kept
            if group_of.get(kept) != group_of[name]:
                raise UnsupportedCheckpointError(f"{ck.folder}: {kept} and {name} are in different param groups, so "
                                                 f"they cannot become one {what}")
            if _step_key(steps[kept]) != _step_key(steps[name]):
                raise UnsupportedCheckpointError(f"{ck.folder}: {kept} and {name} do not share one Adam step, so "
                                                 f"they cannot become one {what}")
    out = []
    for g in groups:
        g = dict(g)
        g["params"] = [renames.get(n, n) for n in g["params"] if renames.get(n, n) is not None]
        out.append(g)
    renamed = OrderedDict((renames.get(n, n), t) for n, t in steps.items() if renames.get(n, n) is not None)
    return out, renamed
