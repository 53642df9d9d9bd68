"""How a state dict is split into weight files, as ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` splits it (and so ``save_pretrained`` and ``zero_to_fp32``).

Keys are taken in order; a tensor goes into the current shard unless it would take the shard past
``max_shard_size``, which closes the shard first; a tensor larger than the limit gets a shard of its
own at once (so it is numbered before the shard being filled). Tensors sharing storage (tied
aliases) join the shard of the first of them, after that shard's other keys, and count once in
``total_size``. One shard means a
single file and no index; otherwise files are ``name-0000K-of-0000N.ext`` and an index maps every
key, aliases included, to its file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Union

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(size: Union[int, str]) -> int:
    """Bytes of a ``max_shard_size``: a number of bytes, or a number with KB/MB/GB/TB (decimal
    units, as huggingface_hub reads them: "5GB" is 5e9 bytes)."""
    if isinstance(size, str) and size.strip().isdigit():
        size = int(size)
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]B)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB', '500MB' or a number of bytes")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not math.isfinite(value):  # 400 digits: more than a float holds
        raise ValueError(f"max_shard_size {str(size)[:24]!r}... is too large a number")
    value = int(value)
    if value <= 0:
        raise ValueError(f"max_shard_size {size!r} is not positive")
    return value


@dataclass
class ShardSplit:
    files: Dict[str, List[str]]  # file name -> keys, in state-dict order
    total_size: int

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def weight_map(self) -> Dict[str, str]:
        return {key: name for name, keys in self.files.items() for key in keys}

    def index_json(self) -> bytes:
        """The index file's bytes, written as transformers writes it (sorted keys, indent 2, newline)."""
        index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map()}
        return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def split(keys: Sequence[str], nbytes: Mapping[str, int], aliases: Mapping[str, str], max_shard_size: int,
          weights_name: str) -> ShardSplit:
    """``keys``: every entry in order (aliases included); ``nbytes``: the size of each non-alias
    entry in the output dtype; ``aliases``: alias -> the entry it shares storage with."""
    shards: List[List[str]] = []
    current: List[str] = []
    current_size = total = 0
    for key in keys:
        if key in aliases:
            continue
        size = nbytes[key]
        total += size
        if size > max_shard_size:
            shards.append([key])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(key)
        current_size += size
    if current:
        shards.append(current)
    shard_of = {key: i for i, shard in enumerate(shards) for key in shard}
    # Aliases follow the keys of their holder's shard, grouped by holder in the holders' order
    # (huggingface_hub walks its storage groups after the split), even in a single file.
    by_holder: Dict[str, List[str]] = {key: [] for key in keys if key not in aliases}
    for alias in (k for k in keys if k in aliases):
        by_holder[aliases[alias]].append(alias)
    for holder, tied in by_holder.items():
        shards[shard_of[holder]].extend(tied)
    if len(shards) <= 1:
        return ShardSplit({weights_name: shards[0] if shards else []}, total)
    stem, dot, ext = weights_name.rpartition(".")
    n = len(shards)
    return ShardSplit({f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}": shard for i, shard in enumerate(shards)}, total)
