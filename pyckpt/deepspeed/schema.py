"""The shape of DeepSpeed's pickled metadata, checked once when a file is opened.

Planners index these structures freely; every file passes through here first, so a malformed or
hostile value is refused with one line naming the file and the key path instead of surfacing later
as a bare ``KeyError``, ``ZeroDivisionError`` or ``AttributeError``. Only what pyckpt reads is
checked; keys DeepSpeed writes but pyckpt never reads are left alone (they are copied as they are).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointFormatError
from .names import check_param_name
from ..formats.pickle_read import MAX_INDEX, Opaque, TensorRef


class Schema:
    """Checks for one file; every message starts with the file's path and the key path."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, where: str, problem: str):
        raise CheckpointFormatError(f"{self.path}: {where} {problem}")

    def dict(self, value, where: str, optional: bool = False) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            self.fail(where, f"must be a dict, got {type(value).__name__}")
        return value

    def list(self, value, where: str, optional: bool = False) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, (list, tuple)):
            self.fail(where, f"must be a list, got {type(value).__name__}")
        return value

    def int(self, value, where: str, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, f"must be an integer, got {type(value).__name__}")
        if not low <= value < MAX_INDEX:
            self.fail(where, f"is {value}, outside [{low}, 2**62)")
        return value

    def tensor(self, value, where: str) -> TensorRef:
        if not isinstance(value, TensorRef):
            self.fail(where, f"must be a tensor, got {type(value).__name__}")
        return value

    def shape(self, value, where: str) -> tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            self.fail(where, f"must be a shape (a tuple of sizes), got {type(value).__name__}")
        if len(value) > 64:
            self.fail(where, f"has {len(value)} dimensions")
        return tuple(self.int(d, f"{where}[{i}]") for i, d in enumerate(value))

    def shapes(self, mapping, where: str) -> None:
        """A {parameter name: shape} dict."""
        self.dict(mapping, where)
        for name, shape in mapping.items():
            check_param_name(name, self.path, f"{where} key")
            self.shape(shape, f"{where}[{name!r}]")

    def names(self, mapping, where: str) -> None:
        for name in mapping:
            check_param_name(name, self.path, f"{where} key")


def check_model_state(path: str, obj) -> None:
    """A ``*_model_states.pt``: param_shapes, frozen_param_shapes, module keys, info dicts."""
    s = Schema(path)
    s.dict(obj, "the top-level object")
    groups = obj.get("param_shapes")
    if groups is not None:
        s.list(groups, "param_shapes")
        seen = {}
        for g, shapes in enumerate(groups):
            s.shapes(shapes, f"param_shapes[{g}]")
            for name in shapes:
                if name in seen:
                    # its universal file would be written twice, the second replacing the first
                    s.fail(f"param_shapes[{g}]", f"lists {name!r} more than once (also in param_shapes[{seen[name]}])")
                seen[name] = g
    frozen = s.dict(obj.get("frozen_param_shapes"), "frozen_param_shapes", optional=True)
    if frozen:
        s.shapes(frozen, "frozen_param_shapes")
    module = s.dict(obj.get("module"), "module", optional=True)
    if module:
        s.names(module, "module")
    for key in ("universal_checkpoint_info", "ds_config", "checkpoint_parallel_dimensions"):
        s.dict(obj.get(key), key, optional=True)


def zero_stage(path: str, value) -> int:
    """ZeroStageEnum comes back as an inert record; DeepSpeed's BF16_Optimizer writes none (stage 1)."""
    if value is None:
        return 1
    if isinstance(value, Opaque):
        args = value._args
        value = args[0] if len(args) == 1 else None
    if isinstance(value, bool) or value not in (1, 2, 3):
        raise CheckpointFormatError(f"{path}: optimizer_state_dict['zero_stage'] is {value!r}, not a ZeRO stage")
    return int(value)


def optimizer_state(path: str, obj) -> dict:
    s = Schema(path)
    if not isinstance(obj, dict) or "optimizer_state_dict" not in obj:
        raise CheckpointFormatError(f"{path}: no 'optimizer_state_dict' key: not a DeepSpeed ZeRO optimizer shard")
    return s.dict(obj["optimizer_state_dict"], "optimizer_state_dict")


def _torch_optimizer(s: Schema, value, where: str) -> None:
    """A torch optimizer state_dict: {'state': {int: {...}}, 'param_groups': [dict, ...]}."""
    s.dict(value, where)
    state = s.dict(value.get("state"), f"{where}['state']")
    for key, entry in state.items():
        s.int(key, f"{where}['state'] key")
        s.dict(entry, f"{where}['state'][{key}]")
    groups = s.list(value.get("param_groups"), f"{where}['param_groups']")
    for i, group in enumerate(groups):
        s.dict(group, f"{where}['param_groups'][{i}]")


def check_zero12_shard(path: str, osd: dict) -> None:
    s = Schema(path)
    counts = osd.get("partition_count")
    if counts is not None:
        for i, c in enumerate(s.list(counts, "partition_count")):
            s.int(c, f"partition_count[{i}]", low=1)
    base = osd.get("base_optimizer_state")
    if not isinstance(base, dict):
        raise CheckpointFormatError(f"{path}: base_optimizer_state is not a dict: elastic checkpoints "
                                    "(zero_optimization.elastic_checkpoint=true) cannot be converted")
    _torch_optimizer(s, base, "base_optimizer_state")
    for key in ("param_slice_mappings", "single_partition_of_fp32_groups"):
        if key not in osd:
            s.fail(key, "is missing: not a ZeRO-1/2 optimizer shard")
    for g, mapping in enumerate(s.list(osd["param_slice_mappings"], "param_slice_mappings")):
        where = f"param_slice_mappings[{g}]"
        s.dict(mapping, where)
        for name, frag in mapping.items():
            check_param_name(name, path, f"{where} key")
            state = getattr(frag, "_state", None) if isinstance(frag, Opaque) else frag
            if not isinstance(state, dict):
                s.fail(f"{where}[{name!r}]", "must be a fragment_address with start and numel")
            for field in ("start", "numel"):
                s.int(state.get(field), f"{where}[{name!r}].{field}")
    for g, t in enumerate(s.list(osd["single_partition_of_fp32_groups"], "single_partition_of_fp32_groups")):
        s.tensor(t, f"single_partition_of_fp32_groups[{g}]")
    paddings = osd.get("group_paddings")
    if paddings is not None:
        for i, p in enumerate(s.list(paddings, "group_paddings")):
            s.int(p, f"group_paddings[{i}]")


def check_zero3_shard(path: str, osd: dict) -> None:
    s = Schema(path)
    count = osd.get("partition_count")
    if count is not None and not isinstance(count, (list, tuple)):
        s.int(count, "partition_count", low=1)
    for g, t in enumerate(s.list(osd.get("fp32_flat_groups"), "fp32_flat_groups")):
        s.tensor(t, f"fp32_flat_groups[{g}]")
    _torch_optimizer(s, osd.get("optimizer_state_dict"), "optimizer_state_dict['optimizer_state_dict']")
    groups = s.list(osd.get("ds_zero_partition_groups"), "ds_zero_partition_groups", optional=True) or []
    for i, part in enumerate(groups):
        where = f"ds_zero_partition_groups[{i}]"
        s.dict(part, where)
        if "partition_count" in part:
            n = s.int(part["partition_count"], f"{where}['partition_count']", low=1)
            if "partition_rank" in part and s.int(part["partition_rank"], f"{where}['partition_rank']") >= n:
                s.fail(f"{where}['partition_rank']", f"is {part['partition_rank']}, not below partition_count {n}")
