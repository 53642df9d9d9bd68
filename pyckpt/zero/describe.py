"""What a ZeRO checkpoint holds, from its metadata only (``pyckpt inspect``)."""

from __future__ import annotations

import math
import os
import stat
from collections import Counter

from .discovery import discover
from .autoep.ep_sizes import valid_ep_sizes
from .autoep.layers import positive_int
from .tp_merge import PATTERN_KEYS


def describe(path) -> dict:
    ck = discover(path)
    for row in ck.optim_grid:  # every shard read and checked, as a conversion would (ZeRO-1/2 rows read when walked)
        for _ in row:
            pass
    model = ck.model[0]
    shapes, frozen = model.shapes, model.frozen
    lp_dtypes = Counter(t.dtype for t in model.module.values() if t.numel() > 0)
    groups = ck.optim[0].groups
    sizes = file_sizes(ck.folder)
    files = list(sizes)
    resumable = resumable_topologies(ck.stage, ck.tp, model)
    return {
        "folder": ck.folder,
        "zero_stage": ck.stage,
        "dp": ck.dp,
        "tp": ck.tp,
        "pp": ck.pp,
        "zero_sub_groups": len(model.groups),
        "trainable_params": len(shapes),
        "trainable_numel": sum(math.prod(s) for s in shapes.values()),
        "frozen_params": len(frozen),
        "frozen_numel": sum(math.prod(s) for s in frozen.values()),
        "model_dtypes": dict(lp_dtypes),
        "master_dtype": groups[0].fp32.dtype if groups else None,
        "bf16_optimizer_files": ck.bf16_prefix,
        "ds_version": model.ds_version,
        "global_steps": model.global_steps,
        "has_universal_checkpoint_info": model.universal_info is not None,
        "resumable": resumable,
        "resumable_at": _say(resumable),
        "files": len(files),
        "bytes": sum(sizes.values()),
        "file_sizes": sizes,
    }


def file_sizes(folder: str) -> dict:
    """The tag folder's files and their sizes, in name order. Only regular files count (through a link
    that resolves): a dangling or looping link, a FIFO, a folder or a socket beside the shards is no
    checkpoint file, and discovery has already refused it where a checkpoint file was expected."""
    sizes = {}
    for name in sorted(os.listdir(folder)):
        try:
            st = os.stat(os.path.join(folder, name))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes[name] = st.st_size
    return sizes


def resumable_topologies(stage: int, tp: int, model) -> dict:
    """The topologies a DeepSpeed engine can resume this checkpoint at through the universal load
    (``pyckpt.deepspeed.enable()``, or a conversion), as its metadata allows them: any data-parallel
    size (a multiple of the expert-parallel size under AutoEP); ZeRO-1 and ZeRO-2 interchangeably,
    ZeRO-3 as saved; tensor-parallel sizes other than the saved one only where the merge rules are
    recorded (AutoTP's or Megatron's patterns); expert-parallel sizes dividing every MoE layer's
    expert count (DeepSpeed's AutoEP rule): the smallest of them, with ``expert_parallel_more`` saying
    how many more there are (None: not counted) where the list stops short."""
    layers = model.autoep_layers if isinstance(model.autoep_layers, (list, tuple)) else []
    counts = [layer.get("num_experts") for layer in layers if isinstance(layer, dict)]
    counts = [n for n in counts if positive_int(n)]
    ep = valid_ep_sizes(math.gcd(*counts)) if counts else None
    info = model.universal_info or {}
    tp_rules = any(info.get(k) for k in PATTERN_KEYS) or bool(info.get("affine_map"))
    found = {"zero_stages": [3] if stage == 3 else [1, 2], "data_parallel": "any", "tensor_parallel": "any" if tp_rules
             else [tp], "expert_parallel": list(ep.listed) if ep else None}
    if ep and ep.more != 0:  # the smallest sizes only: an absurd expert count has more than anyone reads
        found["expert_parallel_more"] = ep.more  # None: not counted (a factor too large to split)
    return found


def _say(r: dict) -> str:
    parts = ["ZeRO-3" if r["zero_stages"] == [3] else "ZeRO-1 or 2", "any data-parallel size" +
             (" that the expert-parallel size divides" if r["expert_parallel"] else "")]
    parts.append("any tensor-parallel size that divides its split dimensions (merge rules recorded)"
                 if r["tensor_parallel"] == "any" else
                 f"tensor-parallel {r['tensor_parallel'][0]} only (no tensor-parallel merge rules recorded)")
    if r["expert_parallel"]:
        more = r.get("expert_parallel_more", 0)
        parts.append(f"expert-parallel {', '.join(map(str, r['expert_parallel']))}"
                     + (" and more (not counted)" if more is None else f" and {more} more" if more else ""))
    return "; ".join(parts)
