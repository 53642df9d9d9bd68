"""The ``.metadata`` file of a torch.distributed.checkpoint folder, written without torch.

DCP's FileSystemReader unpickles it into ``torch.distributed.checkpoint.metadata.Metadata``: for
every flattened key its storage metadata (a tensor's dtype, size and chunks, or "bytes" for any other
value), the nesting of the keys (``planner_data``, key -> path), and where each chunk's archive lies
(``storage_data``, ``MetadataIndex`` -> ``_StorageInfo(relative_path, offset, length)``). It is
written here with pyckpt's own pickle writer, naming only the classes those fields hold (DCP's
metadata dataclasses, torch.Size, a dtype and layout, DCP's memory-format enum), built the way
pickle builds them: dataclasses by NEWOBJ then BUILD with their fields, TensorProperties by its own
``__setstate__``. Field order follows torch 2.13's writer, format version "1.0.0".
"""

from __future__ import annotations

import uuid
from typing import Dict, List, Tuple

from ..formats.pickle_write import Constructed, dumps
from ..formats.pickle_read import GlobalName
from .layout import Layout

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION in torch 2.13


def _size(dims) -> Constructed:
    return Constructed("torch", "Size", (tuple(int(d) for d in dims),), how="reduce")


def _properties(dtype: str) -> Constructed:
    # (dtype, layout, requires_grad, memory-format encoding, pin_memory): TensorProperties.__getstate__
    return Constructed(_MD, "TensorProperties", state=(
        GlobalName("torch", dtype),
        Constructed("torch.serialization", "_get_layout", ("torch.strided",), how="reduce"),
        False,
        Constructed(_MD, "_MEM_FORMAT_ENCODING", (0,), how="reduce"),  # TORCH_CONTIGUOUS_FORMAT
        False))


def _index(key: str, offsets, index) -> Constructed:
    return Constructed(_MD, "MetadataIndex", state={
        "fqn": key, "offset": None if offsets is None else _size(offsets), "index": index})


def metadata_bytes(layout: Layout, locations: List[List[Tuple[int, int]]], file_names: List[str],
                   save_id: str = "") -> bytes:
    """The pickled Metadata of ``layout``, whose data file ``f`` is ``file_names[f]`` with its k-th
    archive at ``locations[f][k]`` = (offset, length)."""
    state_md: Dict[str, Constructed] = {}
    planner: Dict[str, tuple] = {}
    storage: List[Tuple[Constructed, Constructed]] = []

    def where(item) -> Constructed:
        offset, length = locations[item.file][item.position]
        return Constructed(_FS, "_StorageInfo", state={"relative_path": file_names[item.file], "offset": offset,
                                                      "length": length})

    for entry in layout.tensors:
        chunks = (entry.same_as or entry).chunks
        state_md[entry.key] = Constructed(_MD, "TensorStorageMetadata", state={
            "properties": _properties(entry.dtype), "size": _size(entry.shape),
            "chunks": [Constructed(_MD, "ChunkStorageMetadata", state={"offsets": _size(c.offsets),
                                                                        "sizes": _size(c.sizes)}) for c in chunks]})
        planner[entry.key] = tuple(entry.path)
        for i, c in enumerate(chunks):
            storage.append((_index(entry.key, c.offsets, i), where(c)))
    for obj in layout.objects:
        state_md[obj.key] = Constructed(_MD, "BytesStorageMetadata")
        planner[obj.key] = tuple(obj.path)
        storage.append((_index(obj.key, None, None), where(obj)))
    meta = Constructed(_MD, "Metadata", state={
        "state_dict_metadata": state_md,
        "planner_data": planner,
        "storage_data": dict(storage),
        "storage_meta": Constructed(_MD, "StorageMeta", state={
            "checkpoint_id": None, "save_id": save_id or str(uuid.uuid4()), "load_id": None, "modules": []}),
        "version": VERSION,
    })
    data, storages = dumps(meta)
    assert not storages
    return data
