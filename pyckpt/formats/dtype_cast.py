"""Casting bytes in numpy the way the native executor casts gathered ones: to float32 exactly
(Tensor.float() of floating, integer and boolean elements), to bfloat16 and float16 rounding to
nearest even, bfloat16 NaNs as 0x7fc0. For the few tensors computed in memory, and for verify's
independent recomputation of what the executor should have written."""

from __future__ import annotations

_NUMPY_SOURCES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8")


def to_float32(data: bytes, src: str):
    """``data``, elements of dtype ``src``, as a numpy float32 array."""
    # numpy only here: a plain export never computes a tensor, and its import is costly at start-up
    import numpy as np
    if src == "bfloat16":
        return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if src == "bool":
        return np.frombuffer(data, np.uint8).astype(bool).astype(np.float32)
    if src in _NUMPY_SOURCES:
        with np.errstate(over="ignore", invalid="ignore"):  # out of range -> inf, NaN stays NaN, as torch
            return np.frombuffer(data, np.dtype(src)).astype(np.float32)
    raise ValueError(f"cannot cast {src} data")


def cast_bytes(data: bytes, src: str, dst: str) -> bytes:
    if src == dst:
        return data
    import numpy as np
    wide = to_float32(data, src)
    if dst == "bfloat16":
        u = wide.view(np.uint32).astype(np.uint64)
        out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        out[np.isnan(wide)] = 0x7FC0
        return out.tobytes()
    if dst in ("float64", "float32", "float16"):
        with np.errstate(over="ignore", invalid="ignore"):
            return wide.astype(np.dtype(dst)).tobytes()
    raise ValueError(f"cannot cast computed data to {dst}")
