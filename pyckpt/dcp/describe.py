"""What a torch.distributed.checkpoint (DCP) folder holds (``pyckpt inspect DCP_DIR``), from its
metadata and each chunk's archive head: its layout, data files, top-level keys, the model part, the
optimizer state and the value entries. Every chunk's archive is read and checked as an export would
read it; nothing of the tensors is read and nothing is unpickled with code execution.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from typing import Any, Dict, Optional

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, metadata_errors
from ..planning.collector import pauses_collector
from .read import METADATA_NAME, DcpCheckpoint, read_dcp
from .to_hf import model_entries

# Values shown one by one; a torchtitan optimizer flattened per parameter has thousands of them.
MAX_VALUES_SHOWN = 100
# A value is shown as it is when it is a scalar, a short string or a short list of those.
_SHORT = 80
_SHORT_ITEMS = 16
# The states torch's Adam/AdamW keep per parameter, counted by name; any other state is counted too.
ADAM_STATES = ("exp_avg", "exp_avg_sq", "step")


@pauses_collector
def describe_dcp(path) -> dict:
    """A dict of what the DCP folder ``path`` holds (see the module's docstring)."""
    folder = os.path.abspath(os.fspath(path))
    with metadata_errors(folder):
        ck = read_dcp(folder)
        ck.assemble(ck.tensors)  # every chunk's archive read and checked against its entry
        sizes = data_file_sizes(ck)
        return {
            "folder": folder,
            "format": "torch.distributed.checkpoint",
            "layout": ck.layout,
            "entries": len(ck.tensors) + len(ck.objects),
            "tensors": len(ck.tensors),
            "values": len(ck.objects),
            "numel": sum(t.numel() for t in ck.tensors.values()),
            "dtypes": dict(Counter(t.dtype for t in ck.tensors.values())),
            "top_level": top_level(ck),
            "model": model_summary(ck),
            "optimizer": optimizer_summary(ck),
            "value_entries": values_shown(ck),
            "files": len(sizes),
            "bytes": sum(sizes.values()),
            "file_sizes": sizes,
        }


def data_file_sizes(ck: DcpCheckpoint) -> "OrderedDict[str, int]":
    """The files the checkpoint is made of (the metadata and every data file a record lies in), by name."""
    sizes: Dict[str, int] = {}
    meta = os.path.join(ck.folder, METADATA_NAME)
    if ck.layout == "torch_save":
        sizes[METADATA_NAME] = os.stat(meta).st_size
    files = {id(r.file): r.file for t in ck.tensors.values() for c in t.chunks for r in (c.record, ) if r is not None}
    files.update((id(o.record.file), o.record.file) for o in ck.objects.values() if o.record is not None)
    for f in files.values():  # a few files under many records: each named once
        sizes.setdefault(os.path.relpath(f.path, ck.folder), f.size)
    return OrderedDict(sorted(sizes.items()))


def top_level(ck: DcpCheckpoint) -> "OrderedDict[str, dict]":
    """Each top-level key: how many tensors (and their elements) and values lie under it."""
    out: "OrderedDict[str, dict]" = OrderedDict()
    for t in ck.tensors.values():
        row = out.setdefault(str(t.path[0]), {"tensors": 0, "numel": 0, "values": 0})
        row["tensors"] += 1
        row["numel"] += t.numel()
    for o in ck.objects.values():
        out.setdefault(str(o.path[0]), {"tensors": 0, "numel": 0, "values": 0})["values"] += 1
    return out


def model_summary(ck: DcpCheckpoint) -> Optional[dict]:
    """The model part an export takes ("model", else the top-level tensors): its key, tensor count,
    parameters (elements) and dtypes; None where the checkpoint has none."""
    try:
        model = model_entries(ck)
    except CheckpointFormatError:
        return None
    tensors = [ck.tensors[k] for k in model.names.values()]
    return {"key": model.key, "tensors": len(tensors), "parameters": sum(t.numel() for t in tensors),
            "dtypes": dict(Counter(t.dtype for t in tensors))}


def _optimizer_state_path(path) -> Optional[tuple]:
    """(optimizer key, layout, parameter, state) of an optimizer state entry's path, else None:
    get_state_dict's nested ``(key, "state", fqn, state)`` or the flattened ``(key, "state.<fqn>.<state>")``
    (StateDictOptions(flatten_optimizer_state_dict=True), torchtitan's "optimizer")."""
    if len(path) == 4 and path[1] == "state" and isinstance(path[3], str):
        return str(path[0]), "nested", str(path[2]), path[3]
    if len(path) == 2 and isinstance(path[1], str) and path[1].startswith("state."):
        fqn, _, state = path[1][len("state."):].rpartition(".")
        if fqn and state:
            return str(path[0]), "flat", fqn, state
    return None


def optimizer_summary(ck: DcpCheckpoint) -> Optional[dict]:
    """The optimizer state present: under which key and layout, how many parameters have state, and
    how many have each state (exp_avg, exp_avg_sq, step first); None where there is none."""
    found: Dict[tuple, Dict[str, set]] = {}
    dtypes: Dict[tuple, Counter] = {}
    entries = [(t.path, t.dtype) for t in ck.tensors.values()] + [(o.path, None) for o in ck.objects.values()]
    for path, dtype in entries:
        where = _optimizer_state_path(path)
        if where is None:
            continue
        key, layout, fqn, state = where
        found.setdefault((key, layout), {}).setdefault(state, set()).add(fqn)
        if dtype is not None and state != "step":
            dtypes.setdefault((key, layout), Counter())[dtype] += 1
    if not found:
        return None
    # the key holding the most state (one optimizer in every layout pyckpt knows)
    (key, layout), states = max(found.items(), key=lambda kv: sum(len(v) for v in kv[1].values()))
    names = [s for s in ADAM_STATES if s in states] + sorted(s for s in states if s not in ADAM_STATES)
    groups = {o.path[2] for o in ck.objects.values()
              if len(o.path) >= 3 and o.path[0] == key and o.path[1] == "param_groups"} if layout == "nested" else set()
    params = set().union(*states.values())
    return {"key": key, "layout": layout, "params": len(params),
            "states": OrderedDict((s, len(states[s])) for s in names),
            "state_dtypes": dict(dtypes.get((key, layout), {})),
            "param_groups": len(groups) if layout == "nested" else None}


def _shown(value) -> Dict[str, Any]:
    """A value as inspect shows it: ``{"value": value}`` when small and plain (a tuple as a list), else
    ``{"type": its type's name, "items": its length or None}``."""
    plain = (bool, int, float, type(None))
    if isinstance(value, plain) or (isinstance(value, str) and len(value) <= _SHORT):
        return {"value": value}
    if isinstance(value, (list, tuple)) and len(value) <= _SHORT_ITEMS and all(
            isinstance(v, plain) or (isinstance(v, str) and len(v) <= _SHORT) for v in value):
        return {"value": list(value)}
    return {"type": type(value).__name__, "items": len(value) if hasattr(value, "__len__") else None}


def values_shown(ck: DcpCheckpoint) -> "OrderedDict[str, Dict[str, Any]]":
    """The first :data:`MAX_VALUES_SHOWN` value entries and their values (:func:`_shown`); one that holds
    tensors inside a Python object is named as such."""
    out: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
    for key in list(ck.objects)[:MAX_VALUES_SHOWN]:
        try:
            out[key] = _shown(ck.value(key))
        except UnsupportedCheckpointError:
            out[key] = {"type": "object holding tensors", "items": None}
    return out
