"""The tensor vocabulary every layer shares: dtype names and item sizes, element counts, which dtypes
are floating point, the names a user may give a dtype, and the tensor a plan builds.

Dtypes are torch's names without the ``torch.`` prefix ("float32", "bfloat16", ...); pyckpt never
needs torch to speak of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

ITEMSIZE = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}
# What DeepSpeed's .float() (and a cast of the whole model) applies to; integer and boolean buffers
# keep their dtype.
FLOATING = ("float64", "float32", "bfloat16", "float16")
# A dtype as a user may name it (export's --dtype, state_dict(dtype=...)): short or torch names.
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16"}


def dtype_named(name) -> Optional[str]:
    """The floating dtype ``name`` stands for ("bf16", "torch.bfloat16", a torch.dtype), or None."""
    return DTYPE_ALIASES.get(str(name).replace("torch.", ""))


def numel(shape) -> int:
    """Element count of a shape (a tuple, list, TorchSize or torch.Size)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(eq=False, slots=True)
class NewTensor:
    """A contiguous tensor that the plan will assemble from byte pieces of source records."""

    dtype: str
    shape: Tuple[int, ...]
    pieces: list = field(default_factory=list)  # pyckpt.planning.plan.Piece
    requires_grad: bool = False
    # Bytes computed in memory (the few outputs that are not copies, e.g. TP-averaged parameters);
    # when set, ``pieces`` is empty and these bytes are written as the record.
    data: Optional[bytes] = None

    def numel(self) -> int:
        return numel(self.shape)
