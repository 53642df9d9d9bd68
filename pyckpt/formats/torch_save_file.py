"""A torch.save file as records, written by the native executor byte for byte as torch writes it.

torch.save's own writer produces a ZIP archive whose framing (headers, data descriptors, ZIP64
records, the serialization id) is fixed by its records alone; the native executor reproduces it
(Container ``torch_save``, csrc/torch_save_format.hpp). A file is described here by its records in
the order torch writes them, each either small bytes held inline or a byte range of a memory
source (a snapshot buffer the caller keeps unchanged until the write returns). No torch import.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence, Tuple, Union

from ..native import KIND_COPY

SERIALIZATION_ID = ".data/serialization_id"
ID_PLACEHOLDER = b"0" * 40

# What torch's writer adds when it closes a file whose records lack them (its writeEndOfFile):
# the version record (file format 3, as text) and the byte order.
VERSION_RECORDS = ("version", ".data/version")
DEFAULT_VERSION = b"3\n"


class MemoryRange:
    """Bytes [offset, offset + nbytes) of memory source ``source`` (an index into the sources list)."""

    __slots__ = ("source", "offset", "nbytes")

    def __init__(self, source: int, offset: int, nbytes: int):
        self.source, self.offset, self.nbytes = source, offset, nbytes


Payload = Union[bytes, MemoryRange]


class TorchSaveFile:
    """One file to write: ``path`` and its records in torch's write order (``archive_name``: the
    file's base name without its extension, as torch.save names the archive folder)."""

    def __init__(self, path: str, records: Optional[List[Tuple[str, Payload]]] = None):
        self.path = os.fspath(path)
        self.records: List[Tuple[str, Payload]] = list(records or [])

    @property
    def archive_name(self) -> str:
        return archive_name(self.path)

    def add(self, name: str, payload: Payload) -> None:
        self.records.append((name, payload))

    def closed_records(self) -> List[Tuple[str, Payload]]:
        """The records as the file holds them once torch's writer closed it: a version and a byte
        order record appended where missing, then the serialization id (computed natively)."""
        names = {n for n, _ in self.records}
        out = list(self.records)
        if not names.intersection(VERSION_RECORDS):
            out.append(("version", DEFAULT_VERSION))
        if "byteorder" not in names:
            out.append(("byteorder", sys.byteorder.encode("ascii")))
        out.append((SERIALIZATION_ID, ID_PLACEHOLDER))
        return out

    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, MemoryRange) else len(p) for _, p in self.records)


def archive_name(path: str) -> str:
    """torch.save's archive folder name for ``path``: the file name without its last extension
    (everything before its last '.'), or "archive" for a name that is not ASCII, which torch writes
    through a Python stream. '' where torch's writer refuses the name (one starting with its only
    '.')."""
    path = os.fspath(path)
    if not path.isascii():
        return "archive"
    base = path[path.rfind("/") + 1:]
    dot = base.rfind(".")
    return base[:dot] if dot >= 0 else base


def plan_files(files: Sequence[TorchSaveFile]):
    """(outputs, op rows) for ``_core.write_archives`` over the callers' memory sources."""
    outputs, rows = [], []
    for o, f in enumerate(files):
        records = []
        for r, (name, payload) in enumerate(f.closed_records()):
            if isinstance(payload, MemoryRange):
                records.append((name, payload.nbytes, None))
                if payload.nbytes:
                    rows.append((payload.source, payload.offset, o, r, 0, payload.nbytes, KIND_COPY, 1,
                                 payload.nbytes))
            else:
                records.append((name, len(payload), bytes(payload)))
        outputs.append((f.path, f.archive_name, records, "torch_save"))
    return outputs, rows
