"""Opening torch.save files: the native reader maps the ZIP, the safe unpickler reads data.pkl.

Only the small pickle is read here; tensors come back as references whose bytes stay on disk until
the executor copies them.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

from . import _core
from .errors import CheckpointFormatError
from .safe_pickle import StorageRef, TensorRef, loads


class SourceFile:
    """One input torch.save archive: its member table and its parsed pickle."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        try:
            with _core.Archive(self.path) as ar:
                self.size = ar.size
                self.prefix = ar.prefix
                self.members: Dict[str, Tuple[int, int, int]] = {
                    name: (off, size, crc) for name, off, size, crc in ar.members()
                }
                pkl = self.prefix + "/data.pkl"
                if pkl not in self.members:
                    raise CheckpointFormatError(f"{self.path}: not a torch.save archive (no {pkl} member)")
                self._pickle_bytes = ar.read(pkl)
        except _core.ArchiveError as exc:
            raise CheckpointFormatError(str(exc)) from None
        except FileNotFoundError:
            raise CheckpointFormatError(f"{self.path}: file not found") from None
        self._obj = None
        self._loaded = False

    def load(self) -> Any:
        """The unpickled top-level object (parsed once, tensors as TensorRef)."""
        if not self._loaded:
            self._obj = loads(self._pickle_bytes, source=self, where=self.path)
            self._loaded = True
        return self._obj

    def storage_offset(self, storage: StorageRef) -> int:
        """Absolute byte offset of a storage record's data, checked against the record's size."""
        name = f"{self.prefix}/data/{storage.key}"
        entry = self.members.get(name)
        if entry is None:
            raise CheckpointFormatError(f"{self.path}: the pickle names storage record {name}, which is missing "
                                        "(truncated or corrupt file)")
        off, size, _ = entry
        if size < storage.nbytes:
            raise CheckpointFormatError(f"{self.path}: record {name} holds {size} bytes but its tensor needs "
                                        f"{storage.nbytes}")
        return off

    def tensor_byte_range(self, t: TensorRef, start: int = 0, numel: int = None) -> Tuple[int, int]:
        """(absolute offset, nbytes) of elements [start, start+numel) of a contiguous tensor."""
        if numel is None:
            numel = t.numel() - start
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{self.path}: expected a contiguous tensor, got {t!r}")
        if start < 0 or numel < 0 or start + numel > t.numel():
            raise CheckpointFormatError(f"{self.path}: slice [{start}, {start + numel}) is outside tensor {t!r} "
                                        f"of {t.numel()} elements")
        if (t.offset + t.numel()) > t.storage.numel:
            raise CheckpointFormatError(f"{self.path}: tensor {t!r} reaches past its storage of "
                                        f"{t.storage.numel} elements")
        base = self.storage_offset(t.storage)
        return base + (t.offset + start) * t.itemsize, numel * t.itemsize

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(nbytes)

    def __repr__(self):
        return f"SourceFile({self.path!r})"


def open_checkpoint_file(path) -> SourceFile:
    return SourceFile(path)
