"""The tensor vocabulary every layer shares: dtype names and item sizes, element counts, which dtypes
are floating point, the names a user may give a dtype, and the tensor a plan builds.

Dtypes are torch's names without the ``torch.`` prefix ("float32", "bfloat16", ...); pyckpt never
needs torch to speak of them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Tuple

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


@dataclass(slots=True)
class Piece:
    """Bytes [src_off, src_off+nbytes) of a source file land at dst_off of a new tensor; ``rows`` > 1
    repeats that for rows ``stride`` bytes apart in the tensor (and ``nbytes`` apart in the source);
    ``kind`` converts the dtype on the way (pyckpt.native's KIND_* codes, 0 a plain copy)."""

    src: Any  # pyckpt.formats.torch_zip.SourceFile, or None for zeros
    src_off: int
    nbytes: int
    dst_off: int
    kind: int = 0
    rows: int = 1
    stride: int = 0


class Pieces:
    """A tensor's pieces, packed: six machine integers and a source reference each.

    A plan holds a piece for each rank a parameter spans (a 70B-class dense model at dp 4,096 has
    about 3.6 pieces a rank, three per parameter for the fp32 master and the two Adam moments); as
    ``Piece`` objects with their integers they were ~165 bytes each, here 56. Reading gives ``Piece``
    objects made on the way, so they are values: change a piece before the tensor is made."""

    __slots__ = ("_srcs", "_nums")
    _FIELDS = 6

    def __init__(self, pieces=()):
        srcs, nums = [], array("q")
        for p in pieces:
            srcs.append(p.src)
            nums.extend((p.src_off, p.nbytes, p.dst_off, p.kind, p.rows, p.stride))
        self._srcs = tuple(srcs)
        self._nums = nums

    def __len__(self) -> int:
        return len(self._srcs)

    def _piece(self, i: int) -> Piece:
        j = self._FIELDS * i
        return Piece(self._srcs[i], *self._nums[j:j + self._FIELDS])

    def __iter__(self) -> Iterator[Piece]:
        for i in range(len(self._srcs)):
            yield self._piece(i)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._piece(i) for i in range(*index.indices(len(self._srcs)))]
        n = len(self._srcs)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"piece {index} of {n}")
        return self._piece(i)

    def __eq__(self, other) -> bool:
        if isinstance(other, (Pieces, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Pieces({list(self)!r})"


@dataclass(eq=False, slots=True)
class NewTensor:
    """A contiguous tensor that the plan will assemble from byte pieces of source records."""

    dtype: str
    shape: Tuple[int, ...]
    pieces: Sequence[Piece] = field(default_factory=tuple)  # packed into Pieces when made
    requires_grad: bool = False
    # Bytes computed in memory (the few outputs that are not copies, e.g. TP-averaged parameters);
    # when set, ``pieces`` is empty and these bytes are written as the record.
    data: Optional[bytes] = None

    def __post_init__(self):
        if type(self.pieces) is not Pieces:
            self.pieces = Pieces(self.pieces)

    def numel(self) -> int:
        return numel(self.shape)
