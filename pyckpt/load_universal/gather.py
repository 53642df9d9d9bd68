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
                    self._rows.append((s, off, 0, 0, dst * out_size, nbytes, kind, 1, 0))  # nbytes: source bytes
                    self._in_sizes.append(ITEMSIZE[dtype])
                    self.bytes_read += nbytes
                dst += count
        return n_total

    def _zeros(self, dst: int, n: int) -> None:
        self._rows.append((-1, 0, 0, 0, dst * self.itemsize, n * self.itemsize, 0, 1, 0))
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
        each window of destination bytes that a row reaches; rows are cut at window edges on element
        boundaries, their source ranges alike."""
        out_size = self.itemsize
        window = self._window_bytes(window)
        spans = sorted((r[4], r[4] + r[5] // i * out_size, r, i) for r, i in zip(self._rows, self._in_sizes))
        k = 0
        while k < len(spans):
            w0 = spans[k][0] - spans[k][0] % window
            w1 = w0 + window
            rows, written = [], []
            while k < len(spans) and spans[k][0] < w1:
                lo, hi, r, i = spans[k]
                a, b = max(lo, w0), min(hi, w1)
                src_off = r[1] + (a - lo) // out_size * i if r[0] >= 0 else 0
                rows.append((r[0], src_off, 0, 0, a - w0, (b - a) // out_size * i, r[6], 1, 0))
                if written and written[-1][1] == a - w0:
                    written[-1] = (written[-1][0], b - w0)
                else:
                    written.append((a - w0, b - w0))
                if hi > w1:  # the rest of this row belongs to the next window
                    spans[k] = (w1, hi, (r[0], r[1] + (w1 - lo) // out_size * i if r[0] >= 0 else 0) + r[2:], i)
                    break
                k += 1
            yield w0, w1, rows, written

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

