"""How many bytes a DeepSpeed save will write, and whether the filesystem has them.

A save that runs out of space half-way costs the time of writing the part that fits and leaves a
partial file (DeepSpeed's torch.save writes in place). The state's sizes are known before writing
anything, so the check runs first and fails with the numbers.
"""

from __future__ import annotations

import os
from typing import Iterable

# torch.save's per-file framing (ZIP records, 64-byte storage alignment, the pickle) is small next
# to the tensors but not nothing for a model of many small parameters: a fixed allowance per file
# and per tensor, and a margin for what the estimate cannot see (client_state, scheduler, config).
PER_FILE = 64 << 10
PER_TENSOR = 256
MARGIN = 1.02

# Attributes of DeepSpeed's optimizers holding the fp32 master partitions a ZeRO shard saves:
# DeepSpeedZeroOptimizer (ZeRO-1/2), DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer.
FP32_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def _tensors(value) -> Iterable:
    import torch

    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _nbytes(tensors) -> tuple:
    """(bytes, count) of distinct storages' worth of ``tensors`` (views of one flat count once)."""
    seen = set()
    total = count = 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()) if t.numel() else None
        if key in seen:
            continue
        if key is not None:
            seen.add(key)
        total += t.numel() * t.element_size()
        count += 1
    return total, count


def estimate_rank_bytes(engine) -> int:
    """Bytes this rank's part of ``engine.save_checkpoint`` writes, from the state it holds."""
    opt = engine.optimizer
    tensors = []
    files = 0
    if opt is not None:
        base = getattr(opt, "optimizer", opt)
        tensors.extend(_tensors(getattr(base, "state", {})))
        for attr in FP32_PARTITIONS:
            tensors.extend(_tensors(getattr(opt, attr, None) or []))
        files += 1
    if getattr(engine, "save_non_zero_checkpoint", True):
        tensors.extend(_tensors(engine.module.state_dict()))
        files += 1
    nbytes, count = _nbytes(tensors)
    return int(nbytes * MARGIN) + files * PER_FILE + count * PER_TENSOR


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (or, if it
    does not exist yet, its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
