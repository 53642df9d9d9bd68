"""A Universal Checkpoint's files as a loading rank sees them, read with the safe reader.

DeepSpeed 0.19.8 ``torch.load(weights_only=False)``s each ``zero/<name>/<key>.pt`` whole and
``zero/optimizer_state.pt`` whole. Here only their pickles are parsed (tensors stay byte ranges of the
files, checked against their records), and the few scalars a load needs (``step``) are read on their
own; the tensors' bytes are read later, by the native executor, and only the ranks' own ranges.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List

from ...zero.names import check_param_name
from ...planning.state import STEP
from ...universal.layout import (OPTIMIZER_STATE, OPTIMIZER_STATE_FILE, STATE_SUFFIX, STATES_FOLDER, param_folder,
                                 read_state, state_file)
from ...errors import CheckpointFormatError, quoted
from ...formats.confined import inside
from ...tensors import ITEMSIZE
from ...formats.pickle_read import Opaque, TensorRef
from ...formats.torch_zip import SourceFile

# DeepSpeed picks up every "<key>.pt" of a parameter's folder as a state (an unanchored search for
# "(.+).pt" in each name); the anchored form takes the same files for every name DeepSpeed writes.
_STATE_FILE = re.compile(r"^(.+)" + re.escape(STATE_SUFFIX) + r"\Z")
_SCALAR_DTYPES = {"float32": "f", "float64": "d", "int64": "q", "int32": "i"}


@dataclass
class StateFile:
    """``zero/<name>/<key>.pt``: its tensor (a byte range of ``source``) and its layout keys."""

    source: SourceFile
    tensor: TensorRef
    meta: dict
    is_dict: bool


@dataclass
class ParamStates:
    """One parameter's folder: its state files by key, and its ``step`` when it has one."""

    folder: str
    states: Dict[str, StateFile] = field(default_factory=dict)
    step: Any = None
    # the name a state file has in messages (the ZeRO view's files are planned, not on disk)
    label: Any = None

    def path_of(self, key: str) -> str:
        return self.label(key) if self.label else os.path.join(self.folder, state_file(key))


def scalar_tensor(dtype: str, shape, numel: int, read, where: str):
    """A 0-d or 1-element tensor's value as a new torch tensor of its dtype (what torch.load gives);
    ``read(nbytes)`` returns its bytes."""
    import struct

    import torch

    code = _SCALAR_DTYPES.get(dtype)
    if code is None or numel != 1:
        raise CheckpointFormatError(f"{where}: step is {dtype}{list(shape)}; expected one float or integer element")
    (value, ) = struct.unpack("<" + code, read(ITEMSIZE[dtype]))
    return torch.tensor(value, dtype=getattr(torch, dtype)).reshape(tuple(shape))


def read_scalar(source: SourceFile, t: TensorRef):
    def read(nbytes: int) -> bytes:
        off, n = source.tensor_byte_range(t, 0, 1)
        return source.read_bytes(off, n)

    return scalar_tensor(t.dtype, t.shape, t.numel(), read, source.path)


def read_step(source: SourceFile, obj):
    if isinstance(obj, TensorRef):
        return read_scalar(source, obj)
    if type(obj) in (int, float):
        return obj
    raise CheckpointFormatError(f"{source.path}: step is a {type(obj).__name__}; expected a tensor or a number")


def read_param_states(zero_dir: str, name: str, stage: int) -> ParamStates:
    """Parse every state file of parameter ``name``'s folder (tensors not read)."""
    folder = os.path.join(zero_dir, check_param_name(name, zero_dir))  # a live model's name, checked all the same
    try:
        entries = sorted(os.listdir(folder))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{folder}: missing: the Universal Checkpoint has no state for parameter "
                                    f"{name!r} of the model being loaded") from None
    except NotADirectoryError:
        raise CheckpointFormatError(f"{folder}: not a folder") from None
    out = ParamStates(folder)
    for entry in entries:
        m = _STATE_FILE.match(entry)
        if not m:
            continue
        key = m.group(1)
        # a state file that links out of the checkpoint is refused, whatever DeepSpeed would follow
        source = SourceFile(inside(os.path.dirname(zero_dir), f"{param_folder(name)}/{entry}"))
        obj = source.load()
        if key == STEP:
            out.step = read_step(source, obj)
            continue
        tensor, meta, problems = read_state(obj, stage)
        if problems:
            raise CheckpointFormatError(f"{source.path}: {problems[0]}")
        if tensor.dtype not in ITEMSIZE or not tensor.is_contiguous():
            raise CheckpointFormatError(f"{source.path}: expected a contiguous tensor, got {tensor!r}")
        out.states[key] = StateFile(source, tensor, meta, isinstance(obj, dict))
    if not out.states:
        raise CheckpointFormatError(f"{folder}: no state file (fp32.pt, exp_avg.pt, ...) in the parameter's folder")
    return out


@dataclass
class GlobalState:
    """``zero/optimizer_state.pt``: what a load restores besides the per-parameter states."""

    path: str
    raw: Dict[str, Any]
    param_groups: List[dict]
    step: Any = None  # ZeRO-3: optimizer_state_dict['state'][0]['step']


_LOSS_SCALERS = {"LossScaler", "DynamicLossScaler"}


def loss_scaler(record, current, where: str):
    """The checkpoint's loss scaler as a live object, built the way unpickling builds it (the class's
    ``__new__``, then its saved ``__dict__``), for DeepSpeed's own two classes and scalar fields only."""
    if not isinstance(record, Opaque):
        return record if record is None or type(record) in (int, float, bool) else _bad(where, record)
    module, name = record._global
    state = record._state
    if (module != "deepspeed.runtime.fp16.loss_scaler" or name not in _LOSS_SCALERS or not isinstance(state, dict)
            or not all(isinstance(k, str) and (v is None or type(v) in (int, float, bool)) for k, v in state.items())):
        _bad(where, record)
    from deepspeed.runtime.fp16 import loss_scaler as classes

    cls = getattr(classes, name)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _bad(where: str, record):
    raise CheckpointFormatError(f"{where}: loss_scaler is {quoted(record)}; expected DeepSpeed's LossScaler or "
                                "DynamicLossScaler with scalar fields")


def read_global_state(zero_dir: str, stage: int) -> GlobalState:
    path = os.path.join(zero_dir, OPTIMIZER_STATE_FILE)
    # DeepSpeed's own message, so that a load fails the same way with pyckpt enabled.
    assert os.path.isfile(path), f'{path} containing optimizer global state is missing! Cannot proceed.'
    source = SourceFile(inside(os.path.dirname(zero_dir), OPTIMIZER_STATE))
    return global_state_of(source.load(), path, stage, source)


def global_state_of(raw, path: str, stage: int, source) -> GlobalState:
    """``optimizer_state.pt``'s object (``source`` holds its tensors) as a :class:`GlobalState`."""
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(raw).__name__}; expected a dict")
    osd = raw.get("optimizer_state_dict") if stage == 3 else None
    groups = (osd or {}).get("param_groups") if stage == 3 else raw.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        key = "optimizer_state_dict.param_groups" if stage == 3 else "param_groups"
        raise CheckpointFormatError(f"{path}: {key} is not a list of dicts")
    out = GlobalState(path, raw, groups)
    if stage == 3:
        try:
            step = osd["state"][0]["step"]
        except (KeyError, IndexError, TypeError):
            raise CheckpointFormatError(f"{path}: no optimizer_state_dict.state[0].step") from None
        out.step = read_step(source, step)
    return out


class FolderStates:
    """The ``zero/`` folder of a Universal Checkpoint on disk: what the planners read."""

    def __init__(self, checkpoint_dir: str):
        self.zero_dir = os.path.join(checkpoint_dir, STATES_FOLDER)

    def global_state(self, stage: int) -> GlobalState:
        return read_global_state(self.zero_dir, stage)

    def param_states(self, name: str, stage: int) -> ParamStates:
        return read_param_states(self.zero_dir, name, stage)
