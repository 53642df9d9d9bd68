"""Command line: ``python -m pyckpt.inspect CKPT`` - what a ZeRO checkpoint holds, from metadata only."""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

from .deepspeed.discovery import discover
from .formats.pickle_read import TensorRef


def describe(path) -> dict:
    ck = discover(path)
    model = ck.model[0].load()
    shapes = {}
    for group in model.get("param_shapes") or []:
        shapes.update(group)
    frozen = model.get("frozen_param_shapes") or {}
    module = model.get("module") or {}
    lp_dtypes = Counter(t.dtype for t in module.values() if isinstance(t, TensorRef) and t.numel() > 0)
    osd = ck.optim[0].load()["optimizer_state_dict"]
    master = osd.get("single_partition_of_fp32_groups") or osd.get("fp32_flat_groups") or []
    files = sorted(os.listdir(ck.folder))
    sizes = {f: os.path.getsize(os.path.join(ck.folder, f)) for f in files}
    return {
        "folder": ck.folder,
        "zero_stage": ck.stage,
        "dp": ck.dp,
        "tp": ck.tp,
        "pp": ck.pp,
        "zero_sub_groups": len(model.get("param_shapes") or []),
        "trainable_params": len(shapes),
        "trainable_numel": sum(math.prod(int(d) for d in s) for s in shapes.values()),
        "frozen_params": len(frozen),
        "frozen_numel": sum(math.prod(int(d) for d in s) for s in frozen.values()),
        "model_dtypes": dict(lp_dtypes),
        "master_dtype": master[0].dtype if master and isinstance(master[0], TensorRef) else None,
        "bf16_optimizer_files": ck.bf16_prefix,
        "ds_version": model.get("ds_version"),
        "global_steps": model.get("global_steps"),
        "has_universal_checkpoint_info": model.get("universal_checkpoint_info") is not None,
        "files": len(files),
        "bytes": sum(sizes.values()),
        "file_sizes": sizes,
    }


if __name__ == "__main__":
    # The command line lives in cli_inspect, which the pyckpt console script imports without numpy.
    from .cli_inspect import main
    sys.exit(main())
