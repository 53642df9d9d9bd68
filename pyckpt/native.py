"""The one boundary to the native module ``pyckpt._core``.

It imports ``_core`` (with an error that says what to do if it is missing), holds the op-table
schema the executor reads (column order and the dtype conversions it can apply), and turns the
executor's typed errors into pyckpt's: a plan the executor refuses is a :class:`PlanCheckError`,
an input that shrank under its mapping an :class:`InputChangedError`, a malformed ZIP a
:class:`CheckpointFormatError`. Everything else in the package reaches native code through here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Optional, Sequence

from array import array

from .errors import CheckpointFormatError, InputChangedError, PlanCheckError

try:
    from . import _core
except ImportError as exc:  # most often: running from the source folder, which has no built module
    raise ImportError("pyckpt's native module pyckpt._core is not built here. Install the package "
                      "(`pip install .`, or scripts/setup.sh) and run from outside the source folder, or use an "
                      "editable install (`pip install --no-build-isolation -e .`).") from exc

# One op row: bytes [src_off, src_off + nbytes) of source `src` (or zeros when src is -1), converted
# by `kind`, land at dst_off of record `rec` of output `out`, `rows` times `stride` bytes apart. The
# column order is defined once, next to the C++ row type (csrc/ops.hpp), and exported from there.
OP_COLUMNS = tuple(_core.OP_COLUMNS)

KIND_COPY = _core.KIND_COPY

# What the executor can do to a source element on its way to a float32 output (Tensor.float()).
CONVERT_TO_F32 = {
    "float32": KIND_COPY,
    "bfloat16": _core.KIND_BF16_TO_F32,
    "float16": _core.KIND_F16_TO_F32,
    "float64": _core.KIND_F64_TO_F32,
    "int64": _core.KIND_I64_TO_F32,
    "int32": _core.KIND_I32_TO_F32,
    "int16": _core.KIND_I16_TO_F32,
    "int8": _core.KIND_I8_TO_F32,
    "uint8": _core.KIND_U8_TO_F32,
    "bool": _core.KIND_BOOL_TO_F32,
}


# What the executor does to a source element on its way to a 16-bit float output (Tensor.to()).
_NARROW = {
    ("float32", "bfloat16"): _core.KIND_F32_TO_BF16, ("float32", "float16"): _core.KIND_F32_TO_F16,
    ("bfloat16", "float16"): _core.KIND_BF16_TO_F16, ("float16", "bfloat16"): _core.KIND_F16_TO_BF16,
    ("float64", "bfloat16"): _core.KIND_F64_TO_BF16, ("float64", "float16"): _core.KIND_F64_TO_F16,
}
# The source dtype each conversion reads.
KIND_SOURCE_DTYPE = {kind: src for src, kind in CONVERT_TO_F32.items() if kind != KIND_COPY}
KIND_SOURCE_DTYPE.update({kind: src for (src, _), kind in _NARROW.items()})


def cast_kind(src: str, dst: str) -> Optional[int]:
    """The op kind that turns ``src`` elements into ``dst`` ones, or None if the executor cannot."""
    if src == dst:
        return KIND_COPY
    if dst == "float32":
        return CONVERT_TO_F32.get(src)
    return _NARROW.get((src, dst))


# The opcodes torch's weights-only unpickler implements (everything torch.save writes); defined in
# the native opcode table (csrc/pickle_scan.cpp) that scan_pickle walks with.
TORCH_SAVE_OPCODES = frozenset(_core.TORCH_SAVE_OPCODES)


def scan_pickle(data) -> "_core.PickleScan":
    """One native opcode walk over pickle bytes, nothing unpickled: memo stores and the largest
    explicit memo index, a length prefix running past the end, and the first opcode outside
    TORCH_SAVE_OPCODES with its byte offset."""
    return _core.scan_pickle(data)


def op_table(rows: Iterable[Sequence[int]]) -> memoryview:
    """The executor's (N, 10) int64 table from rows in OP_COLUMNS order (empty: a flat empty view);
    a row may leave off the last column, ``src_stride`` (0: the op's rows follow each other in the
    source).

    A memoryview of array('q') rather than a numpy array: importing numpy is a large part of a
    short command's wall time, and the executor takes any C-contiguous int64 buffer."""
    flat = array("q")
    width = len(OP_COLUMNS)
    for row in rows:
        if len(row) == width - 1:
            flat.extend(row)
            flat.append(0)
            continue
        if len(row) != width:
            raise ValueError(f"an op row has {len(row)} fields, the table {width}")
        flat.extend(row)
    view = memoryview(flat)
    return view.cast("B").cast("q", [len(flat) // width, width]) if len(flat) else view


@contextmanager
def native_errors(root: Optional[str] = None):
    """Turns the native module's typed errors raised inside the block into pyckpt's."""
    try:
        yield
    except _core.ArchiveError as exc:
        raise CheckpointFormatError(str(exc)) from None
    except _core.SourceChangedError as exc:
        raise InputChangedError(str(exc)) from None
    except _core.PlanError as exc:
        raise PlanCheckError(f"{root}: the copy plan failed the executor's checks: {exc}") from None


def write_archives(sources, outputs, ops, *, root: str, workers: int = 0, fsync: bool = False,
                   progress=None, reuse_outputs: bool = False, file_crcs: bool = False) -> dict:
    """Runs an op table into new torch.save archives below ``root``; pyckpt errors on refusal.
    ``reuse_outputs``: an existing regular file (one link) at an output path is written over in place;
    ``file_crcs``: the result's ``file_crcs`` holds each output's whole-file CRC-32."""
    with native_errors(root):
        return _core.write_archives(sources, outputs, ops, workers or 0, fsync, progress, root=root,
                                    reuse_outputs=reuse_outputs, file_crcs=file_crcs)


def prepare_output_map(dir_fd: int, name: str, size: int, path: str, mapped: bool) -> None:
    """Creates ``name`` (one component) in the open folder ``dir_fd`` with ``size`` bytes allocated
    (written as zeros), never over an entry nor through a link; ``mapped``: its writable mapping is also
    kept, as :func:`write_archives` keeps one of a file it writes over (``path`` names it in errors)."""
    _core.prepare_output_map(dir_fd, name, size, path, mapped)


def map_output(dir_fd: int, name: str, size: int, path: str) -> bool:
    """Maps the existing regular file ``name`` (one component, no link followed) of the open folder
    ``dir_fd`` of exactly ``size`` bytes, writable, kept as :func:`write_archives` keeps the mapping of
    a file it writes over; False (nothing mapped) where it is not such a file (``path`` names it in errors)."""
    return _core.map_output(dir_fd, name, size, path)


def series_layout(archive_name: str, records, starts) -> list:
    """(offset, length) of each archive of a file write_archives writes as a series (an output with
    archive starts): records (name, size) in order, ``starts`` the index of each archive's first."""
    return _core.series_layout(archive_name, records, starts)


def torch_save_size(archive_name: str, records) -> int:
    """The size of the file torch.save writes for ``records`` ((name, size) in write order, the closing
    ones included: ``TorchSaveFile.closed_records``), as :func:`write_archives` writes it."""
    return _core.torch_save_size(archive_name, records)


def execute_into(sources, ops, dst, workers: int = 0, *, root: str = "") -> int:
    """Runs an op table over ``sources`` into the writable buffer ``dst``; pyckpt errors on refusal."""
    with native_errors(root):
        return _core.execute_into(list(sources), ops, dst, workers or 0)


def gather_into(path: str, ops, dst, workers: int = 0) -> int:
    """Runs an op table over one source file into the writable buffer ``dst``."""
    try:
        with native_errors():
            return _core.execute_into([path], ops, dst, workers or 0)
    except PlanCheckError as exc:  # the ranges came from the file's own metadata
        raise CheckpointFormatError(f"{path}: byte ranges outside the file ({exc})") from None
