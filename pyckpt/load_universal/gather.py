"""Gathering a rank's element runs from memory-mapped state files straight into live tensors.

One :class:`TensorFill` per destination tensor (a flat fp32 partition, a new optimizer-state
buffer): Python lists where each run of each state file lands; the native executor then copies (or
casts) them with the GIL released, in parallel windows, into the tensor's own memory. CPU tensors
are written in place. Other devices get the runs through a host staging copy of the tensor, then
one copy to the device; elements no run covers keep their values in both cases.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..deepspeed.universal_slice import Run
from ..errors import CheckpointFormatError
from ..formats.pickle_read import ITEMSIZE, TensorRef
from ..formats.torch_zip import SourceFile
from ..native import cast_kind, execute_into, op_table

_TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.float64": "float64"}


def dtype_name(tensor) -> str:
    name = _TORCH_DTYPES.get(str(tensor.dtype))
    if name is None:
        raise CheckpointFormatError(f"pyckpt cannot load into a {tensor.dtype} tensor")
    return name


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
        self.bytes_read = 0

    def add(self, source: Optional[SourceFile], tensor: Optional[TensorRef], runs: Sequence[Run], dst: int) -> int:
        """Runs of ``tensor``'s elements (None: zeros) land at element ``dst`` onward; returns the
        element count written."""
        n_total = sum(n for _, n in runs)
        if dst < 0 or dst + n_total > self.numel:
            raise CheckpointFormatError(f"{source.path if source else 'zero fill'}: {n_total} elements at {dst} do not "
                                        f"fit the {self.numel}-element destination")
        kind = None
        if any(src is not None for src, _ in runs):
            kind = cast_kind(tensor.dtype, self.dtype)
            if kind is None:
                raise CheckpointFormatError(f"{source.path}: cannot load {tensor.dtype} into a {self.dtype} tensor")
        out_size = self.itemsize
        in_size = ITEMSIZE[tensor.dtype] if tensor is not None else out_size
        for src, n in runs:
            if src is None:
                self._rows.append((-1, 0, 0, 0, dst * out_size, n * out_size, 0, 1, 0))
                dst += n
                continue
            # a file's tensor is one byte range; a planned one (zero_view) may span several shards
            ranges = source.byte_runs(tensor, src, n) if hasattr(source, "byte_runs") else \
                [(source.path, *source.tensor_byte_range(tensor, src, n))]
            for path, off, nbytes in ranges:
                s = self._index.setdefault(path, len(self._sources))
                if s == len(self._sources):
                    self._sources.append(path)
                self._rows.append((s, off, 0, 0, dst * out_size, nbytes, kind, 1, 0))  # nbytes: source bytes
                self.bytes_read += nbytes
                dst += nbytes // in_size
        return n_total

    def run(self, workers: int = 0) -> None:
        if not self._rows:
            return
        import torch

        t = self.tensor.detach()
        host = t if t.device.type == "cpu" else t.to("cpu")
        if not host.is_contiguous():
            raise CheckpointFormatError("pyckpt loads only into contiguous tensors")
        buf = host.view(-1).view(torch.uint8).numpy()
        execute_into(self._sources, op_table(self._rows), buf, workers)
        if host is not t:
            t.copy_(host)
