"""The road to torch.distributed.checkpoint that users take today, for benchmarks/dcp.py to time:
zero_to_fp32's state dict in memory, loaded into an FSDP2 (fully_shard) model, saved with dcp.save.
Weights only: zero_to_fp32 drops the optimizer state.

    python benchmarks/dcp_road.py TAG_DIR OUT --params 200M [--width 4096]

One process (a gloo group of one), as a user converting on one machine would run it. The model is
make_real_checkpoint.py's, built on the meta device and materialised by the load, so its own
initialisation costs nothing here.
"""

import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("tag_dir")
    p.add_argument("out")
    p.add_argument("--params", default="200M")
    p.add_argument("--width", type=int, default=4096)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from make_real_checkpoint import build_model

    tag = os.path.basename(os.path.normpath(args.tag_dir))
    full = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(os.path.normpath(args.tag_dir)), tag=tag)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    with torch.device("meta"):
        model, _ = build_model(args.params, args.width)
    fully_shard(model)
    model.to_empty(device="cpu")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    del full
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
