# Type stub of the native module built from csrc/ (csrc/bindings/module.cpp is the authority).
from os import PathLike
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

_Path = Union[str, PathLike[str]]
_Buffer = Union[bytes, bytearray, memoryview, np.ndarray]
_Progress = Optional[Callable[[int, int], object]]

class ArchiveError(ValueError):
    """Input that is not a well-formed, uncompressed ZIP / torch.save archive (names the file)."""

class PlanError(ValueError):
    """The executor refused an op table or output list (names the output and record)."""

class SourceChangedError(OSError):
    """A memory-mapped input became shorter while it was being read."""

KIND_COPY: int
KIND_BF16_TO_F32: int
KIND_F16_TO_F32: int
KIND_F64_TO_F32: int
KIND_I64_TO_F32: int
KIND_I32_TO_F32: int
KIND_I16_TO_F32: int
KIND_I8_TO_F32: int
KIND_U8_TO_F32: int
KIND_BOOL_TO_F32: int
KIND_F32_TO_BF16: int
KIND_F32_TO_F16: int
KIND_BF16_TO_F16: int
KIND_F16_TO_BF16: int
KIND_F64_TO_BF16: int
KIND_F64_TO_F16: int
DEFAULT_WINDOW_BYTES: int
OP_COLUMNS: Tuple[str, ...]
"""Column names of the int64 (N, 9) op table, in order."""

class Archive:
    """Read-only, memory-mapped view of a torch.save ZIP file (stored members only)."""

    def __init__(self, path: _Path, offset: Optional[int] = None, length: Optional[int] = None) -> None:
        """The archive of the whole file, or the one in bytes [offset, offset + length) (member offsets stay absolute)."""
    @property
    def base(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def prefix(self) -> str: ...
    def members(self) -> List[Tuple[str, int, int, int]]:
        """[(name, absolute data offset, size, crc32)] in central-directory order."""
    def read(self, name: str) -> bytes: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Archive": ...
    def __exit__(self, *args: object) -> None: ...

def read_archive_heads(paths: Iterable[_Path], member: str, max_bytes: int, workers: int = 0,
                       windows: Optional[Sequence[Tuple[int, int]]] = None
                       ) -> List[Optional[Tuple[int, str, Dict[str, Tuple[int, int, int]], Optional[bytes]]]]:
    """Per path: (size, prefix, {name: (data offset, size, crc32)}, <prefix>/<member> bytes or None if absent
    or over max_bytes), or None if the archive could not be opened or indexed. Read on `workers` threads
    (0: one per core), at most that many open at once."""

def crc32(data: _Buffer, init: int = 0) -> int: ...
def crc32_combine(crc1: int, crc2: int, len2: int) -> int: ...
def crc32_implementations() -> List[str]: ...
def crc32_active_implementation() -> str: ...
def crc32_using(impl: str, data: _Buffer, init: int = 0) -> int: ...
TORCH_SAVE_OPCODES: Tuple[str, ...]
"""pickletools names of the opcodes torch's weights-only unpickler implements (all torch.save writes), sorted."""

class PickleScan:
    """What one opcode walk over a pickle found; nothing is unpickled."""

    @property
    def stores(self) -> int: ...
    @property
    def max_index(self) -> int: ...
    @property
    def max_index_at(self) -> int: ...
    @property
    def overlong_at(self) -> int: ...
    @property
    def disallowed_at(self) -> int: ...
    @property
    def disallowed_opcode(self) -> Optional[str]: ...

def scan_pickle(data: _Buffer) -> PickleScan: ...

# ops: a C-contiguous int64 buffer of shape (N, 10) or (N, 9) (a 2-D memoryview or numpy array; an empty 1-D
# one for no rows; other integer numpy arrays are converted), columns [src, src_off, out, rec, dst_off, nbytes,
# kind, rows, stride, src_stride]; without the last, every op's rows follow each other in the source.
# outputs: [(path, archive_name, [(record_name, size, inline_bytes_or_None), ...][, archive_starts]), ...]; with
# archive_starts (the record index each archive begins at) the output is several archives back to back; with the
# string "torch_save" instead, the output is the exact file torch.save writes for those records (the last one
# .data/serialization_id, 40 inline bytes the executor computes). sources: paths, or buffers (memory sources the
# caller keeps unchanged during the call).
def write_archives(sources: Sequence[Union[_Path, _Buffer]], outputs: Iterable[Tuple[Any, ...]],
                   ops: _Buffer, workers: Optional[int] = 0, fsync: bool = False, progress: _Progress = None, *,
                   force_zip64: bool = False, window_bytes: int = 0, root: Optional[_Path] = None,
                   copy_in_kernel: bool = True, reuse_outputs: bool = False, file_crcs: bool = False) -> dict: ...
def release_output_maps() -> None: ...
def prepare_output_map(dir_fd: int, name: str, size: int, path: str, map: bool = ...) -> None: ...
def map_output(dir_fd: int, name: str, size: int, path: str) -> bool: ...
def output_maps_info() -> dict: ...
def series_layout(archive_name: str, records: Sequence[Tuple[str, int]], starts: Sequence[int]) -> List[Tuple[int, int]]: ...
def torch_save_size(archive_name: str, records: Sequence[Tuple[str, int]]) -> int: ...
def execute_into(sources: Sequence[_Path], ops: _Buffer, dst: _Buffer, workers: Optional[int] = 0,
                 progress: _Progress = None, *, window_bytes: int = 0) -> int: ...
def rename_exchange(a: _Path, b: _Path) -> None: ...
def rename_noreplace(src: _Path, dst: _Path) -> None: ...
def filesystem_type(fd: int) -> int: ...

# Test hooks: only in the test build (the CMake option PYCKPT_TESTING; a plain `pip install .` has none).
class testing:  # the submodule pyckpt._core.testing: test hooks, not part of pyckpt's interface
    @staticmethod
    def inject_fault(call: str, errno: int, after: int = 0) -> None: ...
    @staticmethod
    def clear_faults() -> None: ...
    @staticmethod
    def f16_to_f32_portable(data: _Buffer) -> bytes: ...
    @staticmethod
    def f32_to_f16_portable(data: _Buffer) -> bytes: ...
