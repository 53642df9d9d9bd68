"""What a ZeRO checkpoint holds, from its metadata only (``pyckpt inspect``)."""

from __future__ import annotations

import math
import os
from collections import Counter

from .discovery import discover


def describe(path) -> dict:
    ck = discover(path)
    model = ck.model[0]
    shapes, frozen = model.shapes, model.frozen
    lp_dtypes = Counter(t.dtype for t in model.module.values() if t.numel() > 0)
    groups = ck.optim[0].groups
    files = sorted(os.listdir(ck.folder))
    sizes = {f: os.path.getsize(os.path.join(ck.folder, f)) for f in files}
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
        "files": len(files),
        "bytes": sum(sizes.values()),
        "file_sizes": sizes,
    }

