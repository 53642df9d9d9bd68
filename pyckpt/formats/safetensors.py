"""The safetensors file format: an 8-byte little-endian header length, a JSON header, then the data.

pyckpt writes the header itself and lets the native executor gather the tensor bytes after it, so
a file is written in one pass with no tensor in Python memory. The header is laid out exactly as
the reference serializer (``safetensors.torch.save_file``) lays it out: tensors ordered by dtype,
widest kind first, then by name, data back to back in that order, compact JSON with
``__metadata__`` first, padded with spaces to a multiple of 8 bytes. A file pyckpt writes is
therefore byte-identical to one written from the same tensors by the reference.

Reading parses only the header, with limits, and checks every tensor's range against the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import CheckpointFormatError
from ..tensors import numel

# torch dtype name -> safetensors dtype tag, and its item size.
DTYPES = {
    "float64": ("F64", 8), "float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}
TAG_TO_DTYPE = {tag: name for name, (tag, _) in DTYPES.items()}

# The reference serializer sorts by its dtype enum, descending; these are the enum's relative
# positions for the dtypes above.
_DTYPE_RANK = {"BOOL": 0, "U8": 1, "I8": 2, "I16": 3, "F16": 4, "BF16": 5, "I32": 6, "F32": 7, "F64": 8, "I64": 9}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference reader's own cap
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


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: str  # torch dtype name
    shape: Tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


def read_header(path: str, data: bytes, file_size: int) -> Tuple[Dict[str, str], List[StoredTensor]]:
    """The metadata and tensors of a safetensors file whose first bytes are ``data`` (at least the
    header). Every range is checked to lie in the file, and ranges may not overlap."""
    if len(data) < 8:
        raise CheckpointFormatError(f"{path}: too short for a safetensors header")
    (n, ) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size or 8 + n > len(data):
        raise CheckpointFormatError(f"{path}: safetensors header of {n} bytes does not fit the file")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{path}: safetensors __metadata__ must map names to strings")
    tensors, data_start = [], 8 + n
    for name, info in header.items():
        try:
            dtype = TAG_TO_DTYPE[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: safetensors entry {name!r} is malformed") from None
        nbytes = numel(shape) * DTYPES[dtype][1]
        if end - begin != nbytes or data_start + end > file_size:
            raise CheckpointFormatError(f"{path}: safetensors entry {name!r} has data_offsets [{begin}, {end}) that do "
                                        f"not hold its {dtype}{list(shape)} inside the file")
        tensors.append(StoredTensor(name, dtype, shape, data_start + begin, nbytes))
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointFormatError(f"{path}: safetensors entries {a!r} and {b!r} overlap")
    return metadata, tensors
