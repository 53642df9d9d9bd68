"""Gathering a rank's element runs from memory-mapped state files straight into live tensors.

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

from ..deepspeed.universal_slice import Run
from ..errors import CheckpointFormatError
from ..formats.pickle_read import ITEMSIZE, TensorRef
from ..formats.torch_zip import SourceFile
from ..native import cast_kind, execute_into, op_table

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
        out_size = self.itemsize
        for src, n in runs:
            if src is None:
                self._zeros(dst, n)
                dst += n
                continue
            # a file's tensor is one byte range; a planned one (zero_view) may span several shards,
            # be cast on the way or have been computed in memory
            if hasattr(source, "byte_runs"):
                pieces = source.byte_runs(tensor, src, n)
            else:
                off, _ = source.tensor_byte_range(tensor, src, n)
                pieces = [(source.path, off, n, tensor.dtype)]
            for where, off, count, dtype in pieces:
                if where is None:
                    self._zeros(dst, count)
                elif isinstance(where, bytes):
                    self._memory.append((dst, where, off, count, dtype))
                else:
                    kind = self._kind(dtype, tensor.dtype, where)
                    s = self._index.setdefault(where, len(self._sources))
                    if s == len(self._sources):
                        self._sources.append(where)
                    nbytes = count * ITEMSIZE[dtype]
                    self._add_row(s, off, dst * out_size, nbytes, kind, ITEMSIZE[dtype])
                    self.bytes_read += nbytes
                dst += count
        return n_total

    def _add_row(self, s: int, off: int, dst: int, nbytes: int, kind: int, in_size: int) -> None:
        """Source bytes [off, off + nbytes) into destination bytes from ``dst``: a row of its own, or
        one more row of the last op when they continue it. The destination is filled in order, so a
        run that starts where the last ended in the destination and lies at the same distance again
        in the source extends that op: a column block of a matrix (a cut along dim 1, one run per
        matrix row) becomes one strided op instead of one per row."""
        if self._rows and self._in_sizes[-1] == in_size:
            ls, loff, _, _, ldst, lbytes, lkind, lrows, lstride, lsrc_stride = self._rows[-1]
            out_row = lbytes // in_size * self.itemsize
            if ls == s and lkind == kind and ldst + lrows * out_row == dst:
                if lrows == 1 and off == loff + lbytes:  # contiguous in the source: a longer run
                    self._rows[-1] = (s, loff, 0, 0, ldst, lbytes + nbytes, kind, 1, 0, 0)
                    return
                if nbytes == lbytes and (off - loff > lbytes if lrows == 1 else off == loff + lrows * lsrc_stride):
                    stride = off - loff if lrows == 1 else lsrc_stride
                    self._rows[-1] = (s, loff, 0, 0, ldst, lbytes, kind, lrows + 1, out_row, stride)
                    return
        self._rows.append((s, off, 0, 0, dst, nbytes, kind, 1, 0, 0))  # nbytes: source bytes per row
        self._in_sizes.append(in_size)

    def _zeros(self, dst: int, n: int) -> None:
        self._rows.append((-1, 0, 0, 0, dst * self.itemsize, n * self.itemsize, 0, 1, 0, 0))
        self._in_sizes.append(self.itemsize)

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
        return r[7] * (r[5] // in_size * self.itemsize)

    def _cut(self, r: tuple, in_size: int, at: int) -> Tuple[List[tuple], List[tuple]]:
        """Op ``r`` as the ops writing its destination bytes before ``at`` and those from ``at`` on."""
        src, off, _, _, dst, nbytes, kind, rows, _, src_stride = r
        out_row = nbytes // in_size * self.itemsize
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

