"""Casting the few tensors computed in memory (not gathered by the executor) the way the
executor casts gathered ones: to float32 exactly, to bfloat16 and float16 rounding to nearest
even, bfloat16 NaNs as 0x7fc0."""

from __future__ import annotations

_FLOATS = ("float64", "float32", "float16")


def cast_bytes(data: bytes, src: str, dst: str) -> bytes:
    if src == dst:
        return data
    # numpy only here: a plain export never computes a tensor, and its import is costly at start-up
    import numpy as np
    _NUMPY = {name: np.dtype(name).type for name in _FLOATS}
    if src == "bfloat16":
        wide = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif src in _NUMPY:
        wide = np.frombuffer(data, _NUMPY[src]).astype(np.float32)
    else:
        raise ValueError(f"cannot cast computed {src} data")
    if dst == "bfloat16":
        u = wide.view(np.uint32).astype(np.uint64)
        out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        out[np.isnan(wide)] = 0x7FC0
        return out.tobytes()
    if dst in _NUMPY:
        return wide.astype(_NUMPY[dst]).tobytes()
    raise ValueError(f"cannot cast computed data to {dst}")
