"""Checks of pickled DeepSpeed metadata, each failing with one line naming the file and the key path.

The record readers (``model_states``, ``zero_shards``) use these so that a malformed or hostile
value is refused where the file is read instead of surfacing later as a bare ``KeyError``,
``ZeroDivisionError`` or ``AttributeError``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..errors import CheckpointFormatError, quoted
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

    def shapes(self, mapping, where: str) -> "OrderedDict[str, tuple]":
        """A {parameter name: shape} dict, as names checked to be paths and tuples of ints."""
        self.dict(mapping, where)
        out = OrderedDict()
        for name, shape in mapping.items():
            check_param_name(name, self.path, f"{where} key")
            out[name] = self.shape(shape, f"{where}[{quoted(name)}]")
        return out

    def names(self, mapping, where: str) -> None:
        for name in mapping:
            check_param_name(name, self.path, f"{where} key")


def zero_stage(path: str, value) -> int:
    """ZeroStageEnum comes back as an inert record; DeepSpeed's BF16_Optimizer writes none (stage 1)."""
    if value is None:
        return 1
    if isinstance(value, Opaque):
        args = value._args
        value = args[0] if len(args) == 1 else None
    if isinstance(value, bool) or value not in (1, 2, 3):
        raise CheckpointFormatError(f"{path}: optimizer_state_dict['zero_stage'] is {quoted(value)}, not a ZeRO stage")
    return int(value)
