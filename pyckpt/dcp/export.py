"""Export to torch.distributed.checkpoint: a DeepSpeed checkpoint -> a DCP folder that
``torch.distributed.checkpoint.load`` reads into an FSDP2 model and a torch Adam/AdamW optimizer,
weights and optimizer state together, complete or absent.

The content is what ``get_state_dict(model, optimizer)`` gives for the same model under FSDP2,
nested as ``{model_key: model state dict, optim_key: {"state": ..., "param_groups": ...}}``:
- the model's entries are the consolidated state dict an export writes (buffers, frozen parameters,
  trainable parameters from their fp32 masters; a tied parameter under each of its names, the second
  sharing the first one's chunks), in ``dtype``;
- ``state.<fqn>.{step, exp_avg, exp_avg_sq}`` for every trainable parameter, the fp32 moments of the
  ZeRO partitions (the Universal Checkpoint's own bytes) and torch's float32 step;
- ``param_groups``: DeepSpeed's groups in order, each with its own hyper-parameters and its
  parameters by name.
Nothing is assembled in memory: each chunk is a torch.save archive whose tensor bytes the native
executor gathers from the mapped shards (:mod:`.layout` says how tensors are cut), and the
``.metadata`` is pickled by pyckpt (:mod:`.metadata`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
import os
import struct
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, check_number
from ..execution.executor import series_locations
from ..execution.writer_run import run_writer
from ..execution.report import WrittenReport
from ..huggingface.autoep_names import hf_renames, to_hf_names
from ..huggingface.files import CONFIG_NAME
from ..huggingface.autoep_names import autoep_naming
from ..huggingface.companions import companion_folder, read_model_config, resolve_dtype
from ..planning.collector import pauses_collector
from ..planning.plan import Plan
from ..planning.state import MOMENTS, STEP
from ..tensors import FLOATING, ITEMSIZE, NewTensor, numel
from ..universal.input import optimizer_states, read_consolidated
from ..zero.consolidated import cast
from .layout import (DEFAULT_CHUNK_BYTES, MODEL_KEY, OPTIM_KEY, OPTIM_LAYOUTS, TORCHTITAN_LAYOUT, BytesEntry, Layout,
                     TensorEntry, assign_files, torchtitan_options_problem,
                     chunk_tensor, data_file_name)
from .metadata import metadata_bytes
from .torchtitan import (Heads, fused_members, optimizer_renames, to_torchtitan_model, to_torchtitan_optimizer,
                         torchtitan_name)

METADATA_NAME = ".metadata"
# The export's options beside the DCP files, for verify
EXPORT_RECORD = ".pyckpt-export.json"
EXPORT_RECORD_VERSION = 1
# No file holds more bytes than an off_t counts: a larger chunk is a typo (and would not fit the JSON record).
CHUNK_BYTES_MAX = (1 << 63) - 1
# The keys of a torch Adam/AdamW param group that DeepSpeed's own optimizers (FusedAdam, CPUAdam) do
# not keep, with torch's defaults: a load into torch's optimizer needs every key its groups have.
TORCH_ADAM_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "fused": None}


@dataclass
class DcpReport(WrittenReport):
    input: str
    output: str
    dtype: str
    entries: int
    chunks: int
    files: int
    total_size: int
    bytes_written: int = 0
    seconds: float = 0.0
    plan_text: str = ""

    def summary(self) -> str:
        return (f"exported {self.entries} entries ({self.dtype} model, {self.chunks} chunks) to {self.output} as a "
                f"torch.distributed.checkpoint: {self.files} files, {self.written()}")


def _param_value(value) -> NewTensor:
    """A universal state's tensor: the value itself, or the 'param' of its dict with merge markers."""
    return value["param"] if isinstance(value, dict) else value


def _as_float32_step(name: str, step) -> NewTensor:
    """torch Adam's step: a 0-d float32 tensor (a number DeepSpeed's own Adam keeps becomes one)."""
    if isinstance(step, NewTensor):
        if numel(step.shape) != 1 or step.dtype not in FLOATING:
            raise CheckpointFormatError(f"the Adam step of {name!r} is a {step.dtype} tensor of shape "
                                        f"{list(step.shape)}, not one number")
        step = cast(step, "float32")
        return NewTensor("float32", (), step.pieces, False, step.data)
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise CheckpointFormatError(f"the Adam step of {name!r} is a {type(step).__name__}, not a number")
    return NewTensor("float32", (), [], False, struct.pack("<f", float(step)))


def _plain(value, depth: int = 0) -> bool:
    """Numbers, strings, bools, None, and tuples or lists of them (a hyper-parameter)."""
    if value is None or isinstance(value, (bool, str)) or type(value) in (int, float):
        return True
    if type(value) in (tuple, list) and depth < 4 and len(value) <= 64:
        return all(_plain(v, depth + 1) for v in value)
    return False


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
            if not isinstance(k, str) or not _plain(v):
                raise CheckpointFormatError(f"{ck.folder}: param group {i} of the optimizer state holds {k!r} = a "
                                            f"{type(v).__name__}; a DCP export writes only numbers, strings, bools, "
                                            "None and tuples or lists of them")
        if "adam_w_mode" in g and "decoupled_weight_decay" not in g:
            g["decoupled_weight_decay"] = bool(g["adam_w_mode"])  # DeepSpeed's Adam in AdamW mode
        for k, v in TORCH_ADAM_DEFAULTS.items():
            g.setdefault(k, v)
        g.setdefault("decoupled_weight_decay", False)
        g["params"] = names
        out.append(g)
    lost = [name for name in trainable if name not in seen]
    if lost:
        raise CheckpointFormatError(f"{ck.folder}: the trainable parameter {lost[0]!r} is in none of the optimizer's "
                                    "param groups")
    return out


@pauses_collector
def plan_dcp(input, *, tag: Optional[str] = None, dtype: str = "fp32", optimizer: bool = True,
             model_key: str = MODEL_KEY, optim_key: str = OPTIM_KEY, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
             exclude_frozen: bool = False, hf_names: bool = False, optim_layout: str = "nested",
             min_files: int = 1, save_id: str = "", torchtitan: bool = False, initial_lr: Optional[float] = None):
    """(checkpoint, plan, layout, dtype) of a DCP export, nothing written."""
    problem = torchtitan_options_problem(torchtitan, hf_names, model_key, optim_key, optim_layout)
    if problem:
        raise ValueError(problem)
    if torchtitan:
        model_key, optim_key, optim_layout = TORCHTITAN_LAYOUT
    if initial_lr is not None:  # written into every param group: inf or nan would be trained from
        check_number("initial_lr", initial_lr, low=0)
    if optim_layout not in OPTIM_LAYOUTS:
        raise ValueError(f"optim_layout must be one of {', '.join(OPTIM_LAYOUTS)}, not {optim_layout!r}")
    if optimizer and not optim_key:
        raise ValueError("the optimizer state needs a key of its own (optim_key)")
    if optimizer and model_key == optim_key:
        raise ValueError(f"model_key and optim_key must differ (both {model_key!r})")
    check_number("chunk_bytes", chunk_bytes, integer=True, low=1, high=CHUNK_BYTES_MAX)
    ck, cstate = read_consolidated(input, tag, exclude_frozen, optimizer=optimizer)
    target = resolve_dtype(dtype)
    save_id = save_id or str(uuid.uuid4())
    plan = Plan()
    naming = _hf_naming(ck, cstate, plan.notes) if hf_names else None
    companions = companion_folder(ck.folder)
    if hf_names or torchtitan:  # both name tensors by the config beside the checkpoint
        plan.input_files.append(os.path.join(companions, CONFIG_NAME))
    heads = (Heads(read_model_config(companions)[0], ck.folder, os.path.join(companions, CONFIG_NAME))
             if torchtitan else None)
    model = cstate.tensors if naming is None else to_hf_names(cstate.tensors, *naming, ck.folder)
    if heads is not None:
        model = to_torchtitan_model(model, heads)
    layout = Layout()
    prefix = (model_key,) if model_key else ()
    holders: Dict[str, TensorEntry] = {}
    for name, t in model.items():
        t = cast(t, target) if t.dtype in FLOATING else t
        entry = TensorEntry(prefix + (name,), t.dtype, tuple(t.shape), chunk_tensor(t, chunk_bytes))
        holders[name] = entry
        layout.tensors.append(entry)
    for alias, holder in cstate.aliases.items():
        if heads is not None:
            alias, holder = torchtitan_name(alias, ck.folder), torchtitan_name(holder, ck.folder)
        h = holders[holder]
        layout.tensors.append(TensorEntry(prefix + (alias,), h.dtype, h.shape, [], same_as=h))
    if optimizer:
        _add_optimizer(ck, cstate, layout, (optim_key,), chunk_bytes, naming, optim_layout == "flat", heads,
                       initial_lr)
    elif initial_lr is not None:
        raise ValueError("initial_lr is a value of the optimizer's param groups, which optimizer=False leaves out")
    if not model_key and optimizer and (optim_key in model or optim_key in cstate.aliases):
        raise CheckpointFormatError(f"{ck.folder}: the model has an entry named {optim_key!r}, the optimizer state's "
                                    "top-level key; choose another --optim-key")
    keys = [e.key for e in layout.tensors] + [o.key for o in layout.objects]
    if len(set(keys)) != len(keys):
        seen = set()
        clash = next(k for k in keys if k in seen or seen.add(k))
        raise CheckpointFormatError(f"{ck.folder}: two entries flatten to the DCP key {clash!r} (a parameter named "
                                    "like another entry's path); choose other --model-key/--optim-key")
    assign_files(layout, min_files)
    names = [data_file_name(i) for i in range(len(layout.files))]
    locations = []
    for fname, items in zip(names, layout.files):
        members = [i.tensor if hasattr(i, "tensor") else i.value for i in items]
        plan.add_archive_series(fname, members)
        locations.append(series_locations(members))
    plan.add_raw_file(METADATA_NAME, metadata_bytes(layout, locations, names, save_id))
    # what `pyckpt verify --against` needs to plan this export again (DCP's own reader ignores it)
    options = {"format": "torch.distributed.checkpoint", "written_by": "pyckpt", "version": EXPORT_RECORD_VERSION,
               "dtype": target, "optimizer": optimizer, "model_key": model_key, "optim_key": optim_key,
               "chunk_bytes": chunk_bytes, "exclude_frozen": exclude_frozen, "hf_names": hf_names,
               "optim_layout": optim_layout, "data_files": len(names),
               "save_id": save_id, "torchtitan": torchtitan, "initial_lr": initial_lr}
    plan.add_raw_file(EXPORT_RECORD, (json.dumps(options, indent=1, sort_keys=True) + "\n").encode())
    plan.notes.append(f"  torch.distributed.checkpoint: {len(layout.tensors)} tensors, {len(layout.objects)} other "
                      f"values, {sum(len(f) for f in layout.files)} archives in {len(names)} data files")
    return ck, plan, layout, target


def _hf_naming(ck, cstate, notes: list) -> tuple:
    """(AutoEP layers, preset) for ``hf_names``: the checkpoint must hold AutoEP layers of a model type
    whose Hugging Face names are known (the config beside it says which)."""
    config, _ = read_model_config(companion_folder(ck.folder))
    return autoep_naming(ck, cstate, config, notes, required=True)


def _add_optimizer(ck, cstate, layout: Layout, prefix: tuple, chunk_bytes: int, naming: Optional[tuple],
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
                                             f"{name!r}: only Adam/AdamW optimizer state exports to DCP")
        for s in MOMENTS:
            t = _param_value(held[s])
            if numel(t.shape) != numel(shape) or t.dtype != "float32":
                raise UnsupportedCheckpointError(f"{ck.folder}: the {s} of {name!r} is {t.dtype} {list(t.shape)}, "
                                                 f"not the parameter's float32 {list(shape)}")
            moments[s][name] = NewTensor(t.dtype, shape, t.pieces, False, t.data)
        steps[name] = _as_float32_step(name, held[STEP])
    extra = sorted(set(states) - set(trainable))
    if extra:
        raise CheckpointFormatError(f"{ck.folder}: optimizer state for {extra[0]!r}, which the model states do not "
                                    "list as a trainable parameter")
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


def export_dcp(input, output, *, tag: Optional[str] = None, dtype: str = "fp32", optimizer: bool = True,
               model_key: str = MODEL_KEY, optim_key: str = OPTIM_KEY, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               exclude_frozen_parameters: bool = False, hf_names: bool = False, optim_layout: str = "nested",
               torchtitan: bool = False, initial_lr: Optional[float] = None,
               overwrite: bool = False, dry_run: bool = False, workers: Optional[int] = None,
               progress: bool = False, fsync: bool = False, notify: Optional[Callable[[str], None]] = None,
               ranks=None) -> DcpReport:
    """Export a DeepSpeed checkpoint (ZeRO tag folder, the folder holding ``latest`` such as the Hugging
    Face Trainer's ``checkpoint-N/``, or a Universal Checkpoint folder) as a torch.distributed.checkpoint
    folder ``output`` that ``dcp.load`` reads into an FSDP2 model and torch Adam/AdamW optimizer.

    ``dtype`` (fp32, bf16, fp16) is the model entries' (the optimizer state stays fp32);
    ``optimizer=False`` writes the model alone. ``hf_names``: AutoEP layers (router, experts) and their
    optimizer state under the Hugging Face names of the model type in the config.json beside the
    checkpoint, as the Hugging Face export writes them (a Mixtral's ``gate``, ``experts.gate_up_proj``,
    ``experts.down_proj``), for an FSDP2 job that builds the transformers model. ``optim_layout="flat"``
    writes the optimizer state as ``get_state_dict(..., options=StateDictOptions(
    flatten_optimizer_state_dict=True))`` gives it (``param_groups.<fqn>.<key>``), the layout
    torchtitan's checkpointer uses (with ``model_key=""``, ``optim_key="optimizer"``).
    ``torchtitan=True`` writes what torchtitan's checkpointer holds for its own Llama3 module trained
    from the same state (a Hugging Face Llama, as config.json beside the checkpoint says): its layout
    above, its parameter names, q and k rows in its rotary order, and the optimizer state of q, k and
    v as the one fused ``wqkv`` parameter it trains (:mod:`pyckpt.dcp.torchtitan`). ``initial_lr``
    is added to every param group (torchtitan's LR scheduler puts it there and its load asks for
    it; required with ``torchtitan`` unless DeepSpeed's groups have it).
    ``model_key``/``optim_key`` name the top-level entries (``{"model": ..., "optim": ...}`` by
    default; ``model_key=""`` puts the model's entries at the top level). ``chunk_bytes``: tensors are
    cut along dimension 0 into chunks of about this size, so a load at any world size reads little
    beyond its own rows. ``ranks`` shares the data files among the
    processes of a torch launch. The output is complete or absent; an existing ``output`` is replaced
    only with ``overwrite=True``."""
    def make_plan(output, ranks):
        # one save id for every rank's plan: the .metadata is the same file wherever it is planned
        save_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"pyckpt-dcp:{output}:{os.fspath(input)}"))
        return plan_dcp(input, tag=tag, dtype=dtype, optimizer=optimizer, model_key=model_key, optim_key=optim_key,
                        chunk_bytes=chunk_bytes, exclude_frozen=exclude_frozen_parameters, hf_names=hf_names,
                        optim_layout=optim_layout, min_files=ranks.size if ranks else 1, save_id=save_id,
                        torchtitan=torchtitan, initial_lr=initial_lr)

    def make_report(planned, output):
        ck, plan, layout, target = planned
        chunks = sum(len(f) for f in layout.files)
        total = sum(numel(c.sizes) * ITEMSIZE[c.tensor.dtype] for f in layout.files for c in f
                    if hasattr(c, "tensor"))
        return DcpReport(ck.folder, output, target, len(layout.tensors) + len(layout.objects), chunks,
                         len(plan.series) + len(plan.raw_files), total)

    return run_writer("DCP export", input, output, make_plan, make_report, pointer=None, overwrite=overwrite,
                      dry_run=dry_run, workers=workers, progress=progress, fsync=fsync, notify=notify, ranks=ranks)
