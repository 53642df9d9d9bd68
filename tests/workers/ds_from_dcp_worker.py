"""A DeepSpeed job resuming an FSDP2 job from pyckpt's Universal Checkpoint of its DCP checkpoint (run by
torchrun at a world size other than the FSDP2 job's).

Every rank builds the model from the config beside the DCP checkpoint, torch AdamW with the FSDP2 job's
two param groups in the same order (tests/workers/dcp_save_worker.py: weight decay on the matrices, none
on the norms), and DeepSpeed with ``"checkpoint": {"load_universal": true}`` at ZeRO stage STAGE and
DTYPE, then ``load_checkpoint(UNIVERSAL_PARENT)``, by DeepSpeed's own loader or, with ``--loader pyckpt``,
through ``pyckpt.deepspeed.enable()``. Rank 0 writes OUT.pt: what was loaded (every
parameter's fp32 master and Adam moments gathered with DeepSpeed's safe_get_full_* helpers, each group's
hyper-parameters, the step) and the losses of three more steps on the FSDP2 job's batch.

    torchrun --nproc_per_node W tests/workers/ds_from_dcp_worker.py UNIVERSAL_PARENT REFERENCE.pt CONFIG_DIR OUT.pt
        --stage S [--dtype fp32|bf16] [--loader deepspeed|pyckpt]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: dsharness


def groups(model, lr: float) -> list:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1, "lr": lr},
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0, "lr": lr}]


def main() -> None:
    from dsharness.worker import skip_shm_comm_op

    # deepspeed.initialize would otherwise JIT-compile DeepSpeed's shared-memory comm op on the CPU
    # accelerator in every launch (a fresh TORCH_EXTENSIONS_DIR each): minutes of compiling on 2 cores.
    skip_shm_comm_op()
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from transformers import AutoConfig, AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("universal_parent")
    ap.add_argument("reference")
    ap.add_argument("config_dir")
    ap.add_argument("out")
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--loader", choices=("deepspeed", "pyckpt"), default="deepspeed")
    args = ap.parse_args()
    if args.loader == "pyckpt":
        import pyckpt.deepspeed
        pyckpt.deepspeed.enable()  # the universal load through pyckpt's backend

    torch.manual_seed(123)  # other initial weights than the FSDP2 job's: everything must come from the load
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(groups(model, 1e-3))  # the loaded groups set lr back to the FSDP2 job's
    # no clipping, as the FSDP2 job (DeepSpeed's default clips at norm 1.0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True,
              "checkpoint": {"load_universal": True}}
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine.load_checkpoint(args.universal_parent)
    ref = torch.load(args.reference, weights_only=False)
    loaded = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        loaded["fp32"][name] = safe_get_full_fp32_param(p).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            loaded[key][name] = safe_get_full_optimizer_state(p, key).detach().clone()
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    ids = ref["ids"]
    losses = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
    if dist.get_rank() == 0:
        torch.save({"loaded": loaded, "groups": hyper, "losses": losses, "global_steps": engine.global_steps},
                   args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(0)
