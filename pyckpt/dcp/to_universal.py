"""A torch.distributed.checkpoint (DCP) folder of an FSDP2 job -> a DeepSpeed Universal Checkpoint, so the
job moves to DeepSpeed with its weights and its Adam state.

DeepSpeed 0.19.8's ``load_universal`` (``checkpoint/universal_checkpoint.py``, ``runtime/base_optimizer.py``,
``zero/stage3.py``) takes, per parameter its engine names, ``zero/<name>/fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt`` (``{"cat_dim": 0, "param": tensor}`` of the whole parameter) and ``step.pt``; the
hyper-parameters of each param group, by position, from ``zero/optimizer_state.pt``: ZeRO-1/2 read its
``param_groups`` (and require ``ds_version``), ZeRO-3 its ``optimizer_state_dict`` (the first group's
hyper-parameters and the first state's step), so the file written here carries both and a ZeRO-1, 2 or
3 job resumes from it; and from the model-state file ``mp_rank_00_model_states.pt`` the counters
(``global_steps``, ``skipped_steps``, ``dp_world_size``, ``mp_world_size``), the module's tensors being
kept for readers that consolidate from it; a ZeRO-3 engine globs ``zero_pp_rank_0_mp_rank_00_model_states.pt``
instead, so that name holds the same counters too.

torch's Adam and AdamW keep exactly DeepSpeed Adam's state per parameter (``exp_avg``, ``exp_avg_sq``,
``step``): the fp32 master is the FSDP2 parameter itself (FSDP2 keeps fp32 shards under mixed precision),
cast to fp32 where it was saved in another dtype. An optimizer state with any other per-parameter
entry (SGD's ``momentum_buffer``, AMSGrad's ``max_exp_avg_sq``, Adafactor's factors) is refused: DeepSpeed's
Adam cannot take it over. Everything is byte pieces of the ``.distcp`` files; the few values read are the
param groups' hyper-parameters and one step.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, clipped, metadata_errors, quoted
from ..execution.executor import gather_tensor
from ..execution.report import WrittenReport
from ..execution.writer_run import run_writer
from ..formats.pickle_read import TorchSize
from ..formats.plain_data import PLAIN_RULE, plain_problem
from ..planning.collector import pauses_collector
from ..planning.state import FP32, MOMENTS, STEP, CheckpointState
from ..tensors import FLOATING, NewTensor
from ..universal.write import universal_plan
from ..zero.consolidated import cast
from .read import DcpCheckpoint, read_dcp
from .to_hf import AUTO, model_entries

# What get_state_dict nests a torch optimizer's state under (FSDP2 scripts), then torchtitan's name.
OPTIM_KEYS = ("optim", "optimizer")
ADAM_STATES = MOMENTS + (STEP, )
MODEL_STATES_NAME = "mp_rank_00_model_states.pt"
# what a ZeRO-3 engine's universal load globs for (engine.py _get_all_ckpt_names, the pp rank forced to 0)
ZERO3_MODEL_STATES_NAME = "zero_pp_rank_0_mp_rank_00_model_states.pt"
DS_VERSION = "0.19.8"


def _optim_key(ck: DcpCheckpoint, optim_key: str) -> str:
    tops = {e.path[0] for e in list(ck.tensors.values()) + list(ck.objects.values()) if len(e.path) > 2}
    if optim_key != AUTO:
        if optim_key not in tops:
            raise CheckpointFormatError(f"{ck.folder}: no optimizer state under {quoted(optim_key)} (top-level keys: "
                                        f"{clipped(', '.join(sorted(map(str, tops))))})")
        return optim_key
    for key in OPTIM_KEYS:
        if key in tops:
            return key
    raise UnsupportedCheckpointError(f"{ck.folder}: no optimizer state found (looked for {' and '.join(OPTIM_KEYS)}; "
                                     "name it with --optim-key): a Universal Checkpoint needs the Adam state")


def _adam_state(ck: DcpCheckpoint, key: str) -> "OrderedDict[str, Dict[str, str]]":
    """name -> {exp_avg, exp_avg_sq, step: the DCP key}, refusing any state torch Adam/AdamW does not keep."""
    held: "OrderedDict[str, Dict[str, str]]" = OrderedDict()
    for dk, t in ck.tensors.items():
        if len(t.path) == 4 and t.path[0] == key and t.path[1] == "state":
            held.setdefault(str(t.path[2]), {})[str(t.path[3])] = dk
    for dk, obj in ck.objects.items():
        if len(obj.path) == 4 and obj.path[0] == key and obj.path[1] == "state":
            held.setdefault(str(obj.path[2]), {})[str(obj.path[3])] = dk
    if not held:
        raise UnsupportedCheckpointError(f"{ck.folder}: the optimizer under {quoted(key)} holds no per-parameter state "
                                         "(state.<name>.exp_avg ...): nothing for DeepSpeed's Adam to take over")
    for name, states in held.items():
        other = sorted(set(states) - set(ADAM_STATES))
        missing = [s for s in ADAM_STATES if s not in states]
        if other or missing:
            what = f"also keeps {clipped(', '.join(other))}" if other else f"lacks {', '.join(missing)}"
            raise UnsupportedCheckpointError(f"{ck.folder}: the optimizer state of {quoted(name)} {what}: only torch "
                                             "Adam/AdamW state (exp_avg, exp_avg_sq, step; no AMSGrad) maps onto "
                                             "DeepSpeed's Adam")
        if states[STEP] in ck.objects:
            raise UnsupportedCheckpointError(f"{ck.folder}: the Adam step of {quoted(name)} is a Python number, not a "
                                             "tensor")
    return held


def _param_groups(ck: DcpCheckpoint, key: str, names: List[str]) -> List[dict]:
    """The param groups with their hyper-parameters and member names: get_state_dict's list
    (``param_groups.<i>.<hp>``), or the flattened form (``param_groups.<name>.<hp>``), whose groups are the
    runs of parameters sharing all their values, in the order their first member appears."""
    values: Dict[Tuple, Dict[str, object]] = OrderedDict()
    for dk, obj in ck.objects.items():
        if len(obj.path) == 4 and obj.path[0] == key and obj.path[1] == "param_groups":
            value = ck.value(dk)
            # zero/optimizer_state.pt is read back by torch.load(weights_only=False) in DeepSpeed's universal
            # load: what goes in is the DCP export's plain data, refused otherwise as the export refuses it
            problem = plain_problem(value)
            if problem:
                raise CheckpointFormatError(f"{obj.record.where()}: param group value {quoted(dk)} is {problem}; "
                                            "DeepSpeed loads the param groups with torch.load(weights_only=False), "
                                            f"so a conversion writes only plain data ({PLAIN_RULE})")
            values.setdefault(obj.path[2], {})[str(obj.path[3])] = value
    for dk, entry in list(ck.objects.items()) + list(ck.tensors.items()):
        # dcp.save flattens a dict-valued hyper-parameter into deeper keys; left out, the conversion would
        # resume without it and without a word
        if len(entry.path) > 4 and entry.path[0] == key and entry.path[1] == "param_groups":
            raise UnsupportedCheckpointError(f"{ck.folder}: param group value {quoted(dk)} is part of a nested "
                                             "hyper-parameter (a dict inside a param group), which a conversion "
                                             "does not carry into DeepSpeed's param groups")
    for dk, t in ck.tensors.items():
        if len(t.path) == 4 and t.path[0] == key and t.path[1] == "param_groups":
            raise UnsupportedCheckpointError(f"{ck.folder}: param group value {quoted(dk)} is a tensor (a capturable "
                                             "or scheduled learning rate), which DeepSpeed's param groups do not take")
    if not values:
        raise CheckpointFormatError(f"{ck.folder}: the optimizer under {quoted(key)} has no param_groups")
    if all(isinstance(i, int) for i in values):
        groups = [dict(values[i]) for i in sorted(values)]
        for i, g in enumerate(groups):
            if not isinstance(g.get("params"), list) or not all(isinstance(n, str) for n in g["params"]):
                raise CheckpointFormatError(f"{ck.folder}: param group {i} has no list of parameter names")
        return groups
    groups: List[dict] = []
    index: Dict[Tuple, int] = {}
    for name in names:
        hp = values.get(name)
        if hp is None:
            raise CheckpointFormatError(f"{ck.folder}: no param group values for {quoted(name)}")
        sig = tuple(sorted((k, repr(v)) for k, v in hp.items()))
        if sig not in index:
            index[sig] = len(groups)
            groups.append(dict(hp, params=[]))
        groups[index[sig]]["params"].append(name)
    return groups


def _step_number(t: NewTensor) -> float:
    out = bytearray(4)
    gather_tensor(cast(t, "float32"), out)
    return struct.unpack("<f", bytes(out))[0]


def dcp_universal_state(ck: DcpCheckpoint, model_key: str = AUTO, optim_key: str = AUTO) -> Tuple[CheckpointState,
                                                                                                   dict]:
    """The logical state a Universal Checkpoint holds, from an FSDP2 job's DCP checkpoint."""
    model = model_entries(ck, model_key)
    key = _optim_key(ck, optim_key)
    adam = _adam_state(ck, key)
    unknown = [n for n in adam if n not in model.names]
    if unknown:
        raise CheckpointFormatError(f"{ck.folder}: optimizer state for {quoted(unknown[0])}, which the model entries "
                                    "do not hold")
    groups = _param_groups(ck, key, list(adam))
    grouped = [n for g in groups for n in g["params"]]
    if sorted(grouped) != sorted(adam) or len(set(grouped)) != len(grouped):
        raise CheckpointFormatError(f"{ck.folder}: the param groups' members are not exactly the parameters with "
                                    "Adam state (each once)")
    tensors = ck.assemble(list(model.names.values()) + [k for s in adam.values() for k in s.values()])
    state = CheckpointState()
    steps = []
    for name, dk in model.names.items():
        t = tensors[dk]
        if t.dtype not in FLOATING:
            raise UnsupportedCheckpointError(f"{ck.folder}: {quoted(name)} is {t.dtype}; a Universal Checkpoint keeps "
                                             "floating parameters")
        fp32 = cast(t, "float32")
        if name not in adam:
            # a parameter without optimizer state (frozen, a tied alias, a buffer): fp32.pt alone, as
            # ds_to_universal writes it from the module
            state.put(name, FP32, {"param": fp32})
            continue
        state.put(name, FP32, {"cat_dim": 0, "param": fp32})
        for s in MOMENTS:
            m = tensors[adam[name][s]]
            if tuple(m.shape) != tuple(t.shape) or m.dtype not in FLOATING:
                raise UnsupportedCheckpointError(f"{ck.folder}: the {s} of {quoted(name)} is {m.dtype}"
                                                 f"{list(m.shape)}, not a floating tensor of the parameter's shape "
                                                 f"{list(t.shape)}")
            state.put(name, s, {"cat_dim": 0, "param": cast(m, "float32")})
        step = tensors[adam[name][STEP]]
        if step.numel() != 1 or step.dtype not in FLOATING:
            raise UnsupportedCheckpointError(f"{ck.folder}: the Adam step of {quoted(name)} is {step.dtype}"
                                             f"{list(step.shape)}, not one number")
        step = cast(step, "float32")
        state.put(name, STEP, NewTensor("float32", (), step.pieces))
        steps.append((name, step))
    numbers = {n: _step_number(s) for n, s in steps}
    by_group = [{numbers[n] for n in g["params"]} for g in groups]
    for i, found in enumerate(by_group):
        if len(found) > 1:
            raise UnsupportedCheckpointError(f"{ck.folder}: the parameters of param group {i} are at different Adam "
                                             f"steps {sorted(found)}; DeepSpeed keeps one step per group")
    first_step = steps[0][1] if steps else None
    ds_groups = [dict({k: v for k, v in g.items() if k != "params"}, params=list(range(len(g["params"]))))
                 for g in groups]
    state.put_optimizer({
        "dynamic_loss_scale": False,
        "overflow": False,
        "partition_count": [1] * len(groups),
        "group_paddings": [0] * len(groups),
        "ds_version": DS_VERSION,
        "param_groups": ds_groups,
        # ZeRO-3's universal load reads the first state's step and the first group's values from here
        "optimizer_state_dict": {"state": {0: {STEP: first_step}}, "param_groups": ds_groups},
    })
    files = {r.file.path for t in ck.tensors.values() for c in t.chunks for r in (c.record, )}
    global_steps = int(max(numbers.values())) if numbers else 0
    model_states = OrderedDict([
        ("module", OrderedDict((name, tensors[dk]) for name, dk in model.names.items())),
        ("buffer_names", []),
        ("optimizer", None),
        ("param_shapes", [OrderedDict((n, TorchSize(tensors[model.names[n]].shape)) for n in g["params"])
                          for g in groups]),
        ("frozen_param_shapes", None),
        ("shared_params", {}),
        ("frozen_param_fragments", None),
        ("lr_scheduler", None),
        ("data_sampler", None),
        ("random_ltd", None),
        ("sparse_tensor_module_names", set()),
        ("skipped_steps", 0),
        ("global_steps", global_steps),
        ("global_samples", 0),
        ("dp_world_size", max(1, len(files))),
        ("mp_world_size", 1),
        ("ds_config", {}),
        ("ds_version", DS_VERSION),
    ])
    state.put_model_file(MODEL_STATES_NAME, model_states)
    # A ZeRO-3 engine reads the counters from its own file name; its module is not applied under a universal
    # load, so that copy leaves the tensors out.
    state.put_model_file(ZERO3_MODEL_STATES_NAME, OrderedDict(model_states, module=OrderedDict()))
    state.notes.append(f"  from DCP: {len(model.names)} model tensors"
                       + (f" under {quoted(model.key)}" if model.key else "")
                       + f", Adam state of {len(adam)} under {quoted(key)}, {len(groups)} param groups, "
                       f"step {global_steps}")
    return state, {"params": len(adam), "groups": len(groups), "files": len(files), "step": global_steps}


@dataclass
class DcpConversionReport(WrittenReport):
    input: str
    output: str
    params: int
    groups: int
    files: int
    bytes_written: int = 0
    seconds: float = 0.0
    plan_text: str = ""

    def summary(self) -> str:
        return (f"converted the DCP checkpoint {self.input} ({self.params} parameters with Adam state, {self.groups} "
                f"param groups) to the Universal Checkpoint {self.output}: {self.files} files, {self.written()}")


@pauses_collector
def plan_dcp_universal(input, model_key: str = AUTO, optim_key: str = AUTO):
    folder = os.path.abspath(os.fspath(input))
    with metadata_errors(folder):
        ck = read_dcp(folder)
        state, counts = dcp_universal_state(ck, model_key, optim_key)
        return ck, universal_plan(state), counts


def convert_dcp_to_universal(input, output, *, model_key: str = AUTO, optim_key: str = AUTO, overwrite: bool = False,
                             dry_run: bool = False, workers: Optional[int] = None, progress: bool = False,
                             fsync: bool = False, notify: Optional[Callable[[str], None]] = None,
                             ranks=None) -> DcpConversionReport:
    """Convert an FSDP2 job's DCP checkpoint (``dcp.save`` of ``get_state_dict(model, optimizer)`` with torch
    Adam/AdamW) into a DeepSpeed Universal Checkpoint in the new folder ``output`` (``latest_universal`` written
    beside it, as for a ZeRO conversion): a DeepSpeed job of the same model, its param groups built in the same
    order, resumes it with ``"checkpoint": {"load_universal": true}`` at any world size and ZeRO stage.
    ``model_key``/``optim_key`` name the two entries (auto: "model", and "optim" or "optimizer")."""
    def make_report(planned, output):
        ck, plan, counts = planned
        return DcpConversionReport(ck.folder, output, counts["params"], counts["groups"],
                                   len(plan.archives) + len(plan.copies))

    return run_writer("conversion", input, output,
                      lambda output, ranks: plan_dcp_universal(input, model_key, optim_key), make_report,
                      pointer="latest_universal", overwrite=overwrite, dry_run=dry_run, workers=workers,
                      progress=progress, fsync=fsync, notify=notify, ranks=ranks)
