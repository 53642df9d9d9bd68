"""The safetensors file format: an 8-byte little-endian header length, a JSON header, then the data.

pyckpt writes the header itself and lets the native executor gather the tensor bytes after it, so
a file is written in one pass with no tensor in Python memory. The header is laid out exactly as
the reference serializer (``safetensors.torch.save_file``) lays it out: tensors ordered by dtype,
widest kind first, then by name, data back to back in that order, compact JSON with
``__metadata__`` first, padded with spaces to a multiple of 8 bytes. A file pyckpt writes is
therefore byte-identical to one written from the same tensors by the reference.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from ..tensors import numel

# torch dtype name -> safetensors dtype tag, and its item size.
DTYPES = {
    "float64": ("F64", 8), "float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}

# The reference serializer sorts by its dtype enum, descending; these are the enum's relative
# positions for the dtypes above.
_DTYPE_RANK = {"BOOL": 0, "U8": 1, "I8": 2, "I16": 3, "F16": 4, "BF16": 5, "I32": 6, "F32": 7, "F64": 8, "I64": 9}

# The header key the format keeps for the file's string metadata: a tensor of that name would be
# read back as metadata, and the reference reader refuses the file.
RESERVED_NAME = "__metadata__"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPES[self.dtype][1]


@dataclass(frozen=True)
class Layout:
    """One file: the header bytes (length prefix included) and each tensor's data offset in the file."""

    header: bytes
    order: Tuple[TensorEntry, ...]
    offsets: Dict[str, int]
    file_size: int


def layout(tensors: Sequence[TensorEntry], metadata: Optional[Dict[str, str]] = None) -> Layout:
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("safetensors: tensor names must be unique within a file")
    if any(t.name == RESERVED_NAME for t in tensors):
        raise ValueError(f"safetensors: {RESERVED_NAME!r} is the format's metadata key, not a tensor name")
    order = sorted(tensors, key=lambda t: (-_DTYPE_RANK[DTYPES[t.dtype][0]], t.name))
    entries, pos = {}, 0
    if metadata is not None:
        entries[RESERVED_NAME] = metadata
    for t in order:
        entries[t.name] = {"dtype": DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    offsets, at = {}, start
    for t in order:
        offsets[t.name] = at
        at += t.nbytes
    return Layout(struct.pack("<Q", len(text)) + text, tuple(order), offsets, at)
