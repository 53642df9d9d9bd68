"""The safetensors-backed DCP layout: what torch's ``HuggingFaceStorageWriter(save_distributed=True)``
leaves (torch 2.13, ``torch/distributed/checkpoint/hf_storage.py``, ``_hf_utils.py``): no ``.metadata``
pickle, one safetensors file per rank (``shard-<rank>-model-<k>-of-<n>.safetensors``) holding that rank's
chunk of each tensor under the tensor's name, the chunk's place in the whole tensor in the header's
``DCP_SHARDING_INFO`` metadata (``{name: {"saved_offsets": [...]}}``). Each tensor's size is where its
chunks end, as torch's reader computes it. Read into the same records as the pickled layout, every
header parsed by the strict JSON reader and every range checked against its file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import List, Tuple

from ..errors import CheckpointFormatError, quoted
from ..formats.confined import check_links_inside, open_inside
from ..formats.json_file import parse_json_object
from ..formats.pickle_read import MAX_INDEX
from ..formats.safetensors import DTYPES, RESERVED_NAME
from ..tensors import ITEMSIZE, numel

SUFFIX = ".safetensors"
SHARDING_KEY = "DCP_SHARDING_INFO"
OFFSETS_KEY = "saved_offsets"
# safetensors' own reader caps its header at 100 MB
MAX_HEADER_BYTES = 100_000_000
_DTYPE_OF_TAG = {tag: name for name, (tag, _) in DTYPES.items()}


def _safetensors_names(folder: str) -> List[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(SUFFIX) and not n.startswith("."))


def _header(folder: str, name: str):
    path = os.path.join(folder, name)
    fd = open_inside(folder, name)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointFormatError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointFormatError(f"{path}: safetensors header of {n} bytes does not fit the {size}-byte file")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise CheckpointFormatError(f"{path}: the file shrank while its header was read")
    return path, size, 8 + n, parse_json_object(raw, path, "safetensors header", CheckpointFormatError)


def _sharding(path: str, header: dict):
    meta = header.get(RESERVED_NAME)
    if not isinstance(meta, dict) or SHARDING_KEY not in meta:
        return None
    text = meta[SHARDING_KEY]
    if not isinstance(text, str):
        raise CheckpointFormatError(f"{path}: {SHARDING_KEY} is not a JSON string")
    info = parse_json_object(text.encode("utf-8"), path, SHARDING_KEY, CheckpointFormatError)
    return info


def is_sharded_safetensors_folder(folder: str) -> bool:
    """A folder of safetensors files of which one carries DCP's sharding metadata."""
    try:
        names = _safetensors_names(folder)
    except OSError:
        return False
    for name in names:
        try:
            path, _, _, header = _header(folder, name)
            if _sharding(path, header) is not None:
                return True
        except (CheckpointFormatError, OSError):
            continue  # a damaged shard among DCP shards: the reader names it
    return False


@dataclass(frozen=True)
class SavedChunk:
    """One tensor chunk of a file: its whole tensor's name and dtype, its place and sizes there, and its
    bytes ([offset, offset + nbytes) of the file ``path`` of ``file_size`` bytes)."""

    path: str
    file_size: int
    key: str
    dtype: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    offset: int
    nbytes: int


def sharded_chunks(folder: str) -> List[SavedChunk]:
    """Every chunk of every safetensors file of ``folder``, checked against its header and file."""
    names = _safetensors_names(folder)
    if not names:
        raise CheckpointFormatError(f"{folder}: no .metadata and no safetensors files: not a DCP checkpoint")
    check_links_inside(folder, names)
    out: List[SavedChunk] = []
    for name in names:
        path, size, data_start, header = _header(folder, name)
        sharding = _sharding(path, header)
        if sharding is None:
            raise CheckpointFormatError(f"{path}: no {SHARDING_KEY} metadata; a folder of DCP's sharded "
                                        "safetensors has it in every file")
        for key, entry in header.items():
            if key == RESERVED_NAME:
                continue
            if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPE_OF_TAG:
                raise CheckpointFormatError(f"{path}: {quoted(key)} has no dtype pyckpt reads")
            dtype = _DTYPE_OF_TAG[entry["dtype"]]
            shape, offsets = entry.get("shape"), entry.get("data_offsets")
            where = sharding.get(key)
            saved = where.get(OFFSETS_KEY) if isinstance(where, dict) else None
            for value, what in ((shape, "shape"), (offsets, "data_offsets"), (saved, OFFSETS_KEY)):
                if (not isinstance(value, list) or len(value) > 64
                        or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_INDEX for v in value)):
                    raise CheckpointFormatError(f"{path}: {what} of {quoted(key)} is not a list of sizes")
            if len(offsets) != 2 or len(saved) != len(shape):
                raise CheckpointFormatError(f"{path}: {quoted(key)} has {len(saved)} saved offsets for a "
                                            f"{len(shape)}-dimensional chunk, or malformed data_offsets")
            begin, end = offsets
            nbytes = numel(shape) * ITEMSIZE[dtype]
            if end < begin or end - begin != nbytes or data_start + end > size:
                raise CheckpointFormatError(f"{path}: the bytes of {quoted(key)} ([{begin}, {end}) after the header) "
                                            f"do not hold its {dtype}{shape} or lie past the end of the file")
            out.append(SavedChunk(path, size, key, dtype, tuple(saved), tuple(shape), data_start + begin, nbytes))
    return out
