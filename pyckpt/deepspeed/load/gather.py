"""Gathering a rank's element runs from state files straight into live tensors (the executor maps the
files; a plain run of a file in memory, a memory tier's slot, it reads with ``pread``).

One :class:`TensorFill` per destination tensor (a flat fp32 partition, a new optimizer-state
buffer): Python lists where each run of each state file lands; the native executor then copies (or
casts) them with the GIL released, in parallel windows, into the tensor's own memory. CPU tensors
are written in place. A device tensor is filled through two host staging buffers of
``STAGING_BYTES`` (pinned for CUDA) in turn: while the device copies one window's covered bytes
asynchronously, the executor gathers the next window into the other buffer, so host memory stays two
windows whatever the tensor's size. Elements no run covers keep their values either way. The few
elements a plan computed in memory rather than mapped (:mod:`.zero_view`) are copied by torch.
"""

from __future__ import annotations

import collections
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ...universal.slice import Run
from ...errors import CheckpointFormatError
from ...tensors import ITEMSIZE
from ...formats.pickle_read import TensorRef
from ...formats.torch_zip import SourceFile
from ...native import cast_kind, execute_into, op_table

# Bytes per staging buffer for device destinations (two are used in turn).
STAGING_BYTES = 64 << 20

_TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.float64": "float64"}


def dtype_name(tensor) -> str:
    name = _TORCH_DTYPES.get(str(tensor.dtype))
    if name is None:
        raise CheckpointFormatError(f"pyckpt cannot load into a {tensor.dtype} tensor")
    return name


def state_buffer(state: dict, key: str, like):
    """The tensor to load optimizer state ``key`` into: the optimizer's current one when it is shaped,
    typed and placed like ``like`` (the flat fp32 partition), else a new one. Stock DeepSpeed makes a
    new buffer and drops the old; refilling the old one gives the same values without allocating and
    first touching a partition's worth of fresh pages per state (zeroed by the kernel, page by page),
    and without holding both at once."""
    import torch

    old = state.get(key)
    if (torch.is_tensor(old) and old.shape == like.shape and old.dtype == like.dtype and old.device == like.device
            and old.is_contiguous() and old.data_ptr() != like.data_ptr() and not old.requires_grad):
        return old.detach()
    return torch.empty_like(like)


class TensorFill:
    """The runs that fill one destination tensor (1-D, contiguous)."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.dtype = dtype_name(tensor)
        self.itemsize = tensor.element_size()
        self.numel = tensor.numel()
        self._sources: List[str] = []
        self._index: Dict[str, int] = {}
        self._rows: List[tuple] = []
        self._in_sizes: List[int] = []  # source bytes per element, per row
        # (dst element, bytes, offset, count, dtype): elements a plan computed in memory (zero_view)
        self._memory: List[tuple] = []
        self.bytes_read = 0

    def add(self, source: Optional[SourceFile], tensor: Optional[TensorRef], runs: Sequence[Run], dst: int) -> int:
        """Runs of ``tensor``'s elements (None: zeros) land at element ``dst`` onward; returns the
        element count written."""
        n_total = sum(n for _, n in runs)
        if dst < 0 or dst + n_total > self.numel:
            raise CheckpointFormatError(f"{source.path if source else 'zero fill'}: {n_total} elements at {dst} do not "
                                        f"fit the {self.numel}-element destination")
        if source is not None and not hasattr(source, "byte_runs"):
            self._fold(self._file_pieces(source, tensor, runs, dst))
        else:
            self._fold(self._planned_pieces(source, tensor, runs, dst))
        return n_total

    def _file_pieces(self, source: SourceFile, tensor: TensorRef, runs: Sequence[Run], dst: int):
        """(source index, offset, destination byte, bytes, kind, source item size) per run of a tensor
        of one file, one byte range: checked whole once, then each run by its element bounds (a cut
        along dim 1 is a run per matrix row, so this is the plan's hot loop)."""
        base, _ = source.tensor_byte_range(tensor, 0, tensor.numel())
        total, size, out_size = tensor.numel(), ITEMSIZE[tensor.dtype], self.itemsize
        kind = self._kind(tensor.dtype, tensor.dtype, source.path)
        s = self._source_index(source.path)
        for src, n in runs:
            if src is None:
                yield self._zero_piece(dst, n)
            elif 0 <= src and 0 <= n and src + n <= total:
                self.bytes_read += n * size
                yield s, base + src * size, dst * out_size, n * size, kind, size
            else:
                raise CheckpointFormatError(f"{source.path}: slice [{src}, {src + n}) is outside tensor {tensor!r} of "
                                            f"{total} elements")
            dst += n

    def _planned_pieces(self, source, tensor, runs: Sequence[Run], dst: int):
        """The same for a planned tensor (zero_view), which may span several shards, be cast on the
        way or have been computed in memory (those elements are set aside for ``Tensor.copy_``)."""
        out_size = self.itemsize
        for src, n in runs:
            pieces = [(None, 0, n, None)] if src is None else source.byte_runs(tensor, src, n)
            for where, off, count, dtype in pieces:
                if where is None:
                    yield self._zero_piece(dst, count)
                elif isinstance(where, bytes):
                    self._memory.append((dst, where, off, count, dtype))
                else:
                    size = ITEMSIZE[dtype]
                    self.bytes_read += count * size
                    yield (self._source_index(where), off, dst * out_size, count * size,
                           self._kind(dtype, tensor.dtype, where), size)
                dst += count

    def _zero_piece(self, dst: int, n: int) -> tuple:
        """A piece of ``n`` zero elements at element ``dst`` (source -1, in destination-sized items)."""
        return -1, 0, dst * self.itemsize, n * self.itemsize, 0, self.itemsize

    def _source_index(self, path: str) -> int:
        s = self._index.setdefault(path, len(self._sources))
        if s == len(self._sources):
            self._sources.append(path)
        return s

    def _fold(self, pieces) -> None:
        """Pieces (source index or -1 for zeros, source offset, destination byte, source bytes, kind,
        source item size), in destination order, into ops. A piece that starts where the current op
        ends in the destination extends it: as a longer run where it also continues it in the
        source, or as one more row where it lies at the op's row distance in the source, so a column
        block of a matrix (a cut along dim 1: one run per matrix row) is one strided op. The last op
        already planned is the first current one."""
        rows, sizes, out_size = self._rows, self._in_sizes, self.itemsize

        def emit():
            rows.append((c_s, c_off, 0, 0, c_dst, c_nb, c_kind, c_rows, c_nb // c_size * out_size if c_rows > 1 else 0,
                         c_step if c_rows > 1 else 0))
            sizes.append(c_size)

        have = False
        if rows:
            c_s, c_off, _, _, c_dst, c_nb, c_kind, c_rows, _, c_step = rows.pop()
            c_size = sizes.pop()
            have = True
        try:
            for s, off, d, nb, kind, size in pieces:
                if have:
                    if s == c_s >= 0 and kind == c_kind and size == c_size and c_dst + c_rows * (c_nb // size * out_size) == d:
                        if c_rows == 1 and off == c_off + c_nb:
                            c_nb += nb
                            continue
                        if nb == c_nb and (off - c_off > c_nb if c_rows == 1 else off == c_off + c_rows * c_step):
                            if c_rows == 1:
                                c_step = off - c_off
                            c_rows += 1
                            continue
                    emit()
                c_s, c_off, c_dst, c_nb, c_kind, c_size, c_rows, c_step, have = s, off, d, nb, kind, size, 1, 0, True
        finally:  # the current op, also when a piece was refused
            if have:
                emit()

    def _kind(self, src: str, planned: str, path: str) -> int:
        """The op that brings ``src`` elements, planned as ``planned`` ones, into this tensor's dtype.
        One cast straight to it gives the elements the two steps give when one of them is a copy or
        the first widens a 16-bit float to float32 exactly."""
        kind = None
        if src == planned or planned == self.dtype or (planned == "float32" and src in ("bfloat16", "float16")):
            kind = cast_kind(src, self.dtype)
        if kind is None:
            raise CheckpointFormatError(f"{path}: cannot load {src} (as {planned}) into a {self.dtype} tensor")
        return kind

    def run(self, workers: int = 0, staging: Optional[int] = None) -> None:
        """Gather every run into the tensor. ``staging``: the staging window in bytes, to take the
        device path for a CPU tensor too (tests); device tensors always take it."""
        if not self._rows and not self._memory:
            return
        t = self.tensor.detach()
        if not t.is_contiguous():
            raise CheckpointFormatError("pyckpt loads only into contiguous tensors")
        if self._rows:
            if t.device.type == "cpu" and staging is None:
                import torch

                execute_into(self._sources, op_table(self._rows), t.view(-1).view(torch.uint8).numpy(), workers)
            else:
                self._run_staged(t, workers, staging or STAGING_BYTES)
        self._copy_memory(t)

    def _copy_memory(self, t) -> None:
        """Computed elements (a few small tensors) are copied as DeepSpeed's loader copies a slice of
        the tensor it read: ``Tensor.copy_``, which also casts and moves them to the device."""
        if not self._memory:
            return
        import torch

        flat = t.view(-1)
        for dst, data, off, count, dtype in self._memory:
            chunk = bytearray(data[off:off + count * ITEMSIZE[dtype]])  # writable: torch.frombuffer shares it
            flat[dst:dst + count].copy_(torch.frombuffer(chunk, dtype=getattr(torch, dtype)))

    def _window_bytes(self, window: int) -> int:
        """``window`` cut down to whole elements, at least one."""
        return max(self.itemsize, window - window % self.itemsize)

    def _windows(self, window: int) -> Iterator[Tuple[int, int, List[tuple], List[Tuple[int, int]]]]:
        """(start, stop, rows shifted to the window, the window's byte ranges they write, merged) for
        each window of destination bytes that a row reaches; ops are cut at window edges on element
        boundaries (a strided op into whole rows before the edge, part of a row, and the rest)."""
        window = self._window_bytes(window)
        pending = collections.deque(sorted(((r[4], r, i) for r, i in zip(self._rows, self._in_sizes)),
                                           key=lambda item: item[0]))
        while pending:
            w0 = pending[0][0] - pending[0][0] % window
            w1 = w0 + window
            rows, written = [], []
            while pending and pending[0][0] < w1:
                _, r, i = pending.popleft()
                head, tail = self._cut(r, i, w1)
                pending.extendleft((t[4], t, i) for t in reversed(tail))
                for h in head:
                    lo, hi = h[4] - w0, h[4] - w0 + self._dst_span(h, i)
                    rows.append(h[:4] + (lo, ) + h[5:])
                    if written and written[-1][1] == lo:
                        written[-1] = (written[-1][0], hi)
                    else:
                        written.append((lo, hi))
            yield w0, w1, rows, written

    def _dst_span(self, r: tuple, in_size: int) -> int:
        """Destination bytes op ``r`` writes (its rows lie end to end there)."""
        return r[7] * self._out_row(r[5], in_size)

    def _out_row(self, nbytes: int, in_size: int) -> int:
        """Destination bytes of one op row of ``nbytes`` source bytes."""
        return nbytes // in_size * self.itemsize

    def _cut(self, r: tuple, in_size: int, at: int) -> Tuple[List[tuple], List[tuple]]:
        """Op ``r`` as the ops writing its destination bytes before ``at`` and those from ``at`` on."""
        src, off, _, _, dst, nbytes, kind, rows, _, src_stride = r
        out_row = self._out_row(nbytes, in_size)
        if dst + rows * out_row <= at:
            return [r], []
        step = src_stride or nbytes

        def op(o, d, n, k):  # k rows of n source bytes from o, written from d
            return (src, o if src >= 0 else 0, 0, 0, d, n, kind, k, out_row if k > 1 else 0,
                    step if k > 1 else 0)

        full, part = divmod(at - dst, out_row)
        part_in = part // self.itemsize * in_size
        head, tail = [], []
        if full:
            head.append(op(off, dst, nbytes, full))
        if part:
            head.append(op(off + full * step, dst + full * out_row, part_in, 1))
            tail.append(op(off + full * step + part_in, at, nbytes - part_in, 1))
            full += 1
        if full < rows:
            tail.append(op(off + full * step, dst + full * out_row, nbytes, rows - full))
        return head, tail

    def _run_staged(self, t, workers: int, window: int) -> None:
        import torch

        flat = t.view(-1).view(torch.uint8)
        cuda = t.device.type == "cuda"
        window = self._window_bytes(window)
        size = min(window, flat.numel())
        buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        done = [None, None]  # the event after each buffer's last device copy
        for k, (w0, w1, rows, written) in enumerate(self._windows(window)):
            b = k % 2
            if done[b] is not None:
                done[b].synchronize()  # its previous window's copies have left the buffer
            w1 = min(w1, flat.numel())
            host = buffers[b][:w1 - w0]
            execute_into(self._sources, op_table(rows), host.numpy(), workers)
            for lo, hi in written:
                flat[w0 + lo:w0 + hi].copy_(host[lo:hi], non_blocking=cuda)
            if cuda:
                # on the stream the copies above ran on, the destination device's, which need not
                # be the current device (Event.record's default)
                done[b] = torch.cuda.Event()
                done[b].record(torch.cuda.current_stream(t.device))
        if cuda:
            torch.cuda.current_stream(t.device).synchronize()  # the buffers are freed on return

