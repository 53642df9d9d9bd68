"""The noise file every synthetic tensor is a view of, and the flat groups cut from it: no value is
built in memory, every tensor is a list of byte ranges of one file."""

from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np

from ..formats.pickle_read import TensorRef
from ..planning.plan import Piece
from ..tensors import NewTensor
from . import records


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _prime_at_least(n: int) -> int:
    while not _is_prime(n):
        n += 1
    return n


class Region:
    """Elements of one dtype in the noise file; positions wrap around its (prime) length."""

    def __init__(self, source, offset: int, length: int, itemsize: int):
        self.source, self.offset, self.length, self.itemsize = source, offset, length, itemsize

    def ranges(self, start: int, count: int):
        start %= self.length
        while count > 0:
            take = min(count, self.length - start)
            yield self.source, self.offset + start * self.itemsize, take * self.itemsize
            count -= take
            start = 0


class Noise:
    """The source file of every tensor byte; Piece.src only needs ``.path``."""

    # Region sizes in elements, rounded up to primes: ~64 MiB in all, written in well under a second.
    F32, NONNEG, BF16, ZERO_BYTES = 8 << 20, 4 << 20, 8 << 20, 1 << 16

    def __init__(self, path: str, seed: int):
        self.path = path
        rng = np.random.default_rng(seed)
        nf, ns, nb = (_prime_at_least(n) for n in (self.F32, self.NONNEG, self.BF16))

        def signed(n):
            # float32 straight from the generator: no float64 temporaries
            return rng.random(n, dtype=np.float32) * np.float32(2) - np.float32(1)

        regions = [
            lambda: signed(nf),
            # Adam's second moment is a running mean of squared gradients: small and never negative.
            lambda: rng.random(ns, dtype=np.float32) * np.float32(1e-3),
            # bf16 is the upper half of a float32; truncating finite values in [-1, 1] stays finite.
            lambda: (signed(nb).view(np.uint32) >> 16).astype(np.uint16),
            lambda: np.zeros(self.ZERO_BYTES, np.uint8),
            lambda: np.array([float(records.GLOBAL_STEPS)], dtype=np.float32),
        ]
        offsets = [0]
        with open(path, "wb") as f:
            for make in regions:  # one region in memory at a time
                arr = make()
                f.write(memoryview(arr).cast("B"))
                offsets.append(offsets[-1] + arr.nbytes)
                del arr
        self.f32 = Region(self, offsets[0], nf, 4)
        self.nonneg = Region(self, offsets[1], ns, 4)
        self.bf16 = Region(self, offsets[2], nb, 2)
        self.zero = Region(self, offsets[3], self.ZERO_BYTES, 1)
        self.step_offset = offsets[4]


class Flat:
    """A byte string being assembled from noise ranges (one storage record)."""

    def __init__(self):
        self.pieces: List[Piece] = []
        self.nbytes = 0

    def add(self, region: Region, start: int, count: int) -> "Flat":
        if count <= 0:
            return self
        start %= region.length
        if 0 < count <= region.length - start:  # no wrap: the common case, without the generator
            return self._append(region.source, region.offset + start * region.itemsize, count * region.itemsize)
        for src, off, n in region.ranges(start, count):
            self._append(src, off, n)
        return self

    def _append(self, src, off: int, n: int) -> "Flat":
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.src is src and last.src_off + last.nbytes == off:
            last.nbytes += n  # adjacent ranges are one copy
        else:
            self.pieces.append(Piece(src, off, n, self.nbytes))
        self.nbytes += n
        return self

    def zeros(self, region: Region, nbytes: int) -> "Flat":
        # Padding after padding (a ZeRO-3 rank past the end of many small parameters) grows the last
        # zero piece: any bytes of the zero region are zeros, so the copies stay few.
        last = self.pieces[-1] if self.pieces else None
        if (nbytes > 0 and last is not None and last.src is region.source and region.offset <= last.src_off
                and last.src_off + last.nbytes + nbytes <= region.offset + region.length):
            last.nbytes += nbytes
            self.nbytes += nbytes
            return self
        return self.add(region, 0, nbytes)


class FlatStorage(NewTensor):
    """A storage record that several tensors view (a flat group), or one with a strided view.

    pyckpt's writer takes a TensorRef's ``storage.numel`` as a number and copies a NewTensor's
    pieces; this is both, so views of made-up storages pickle exactly like torch's.
    """

    def __init__(self, dtype: str, numel: int, pieces: List[Piece]):
        super().__init__(dtype, (numel, ), pieces)
        self.numel = numel  # shadows NewTensor.numel(): the writer reads it as an attribute here


def contiguous_stride(shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def view(storage: FlatStorage, offset: int, shape, requires_grad=False, py_state=None) -> TensorRef:
    return TensorRef(storage, offset, tuple(shape), contiguous_stride(shape), requires_grad, py_state)


def tensor(dtype: str, shape, flat: Flat, requires_grad=False) -> NewTensor:
    expected = math.prod(shape) * (4 if dtype == "float32" else 2)
    if flat.nbytes != expected:
        raise AssertionError(f"built {flat.nbytes} bytes for a {dtype}{list(shape)} tensor ({expected} expected)")
    return NewTensor(dtype, tuple(shape), flat.pieces, requires_grad)


# ----------------------------------------------------------------------------------------------
