"""An FSDP2 job resuming a Hugging Face model from pyckpt's DCP export of a Trainer's DeepSpeed
checkpoint (run by torchrun), the way a script moving to FSDP2 does it.

Every rank builds the model from the config beside the checkpoint (fp32), shards each decoder layer
and then the whole model with ``fully_shard``, makes torch AdamW with the Trainer's two groups (its
own decay rule: ``Trainer.get_decay_parameter_names``), or with ``--groups experts`` DeepSpeed
AutoEP's two (the dense parameters, then the experts), and loads ``get_state_dict`` ->
``dcp.load({"model", "optim"})`` -> ``set_state_dict``. Rank 0 writes what was loaded (every
parameter and AdamW state gathered with ``full_tensor()``, the groups) and the losses of a few more
steps, each on the same batch on every rank.

    torchrun --nproc_per_node W tests/workers/dcp_hf_fsdp_worker.py CONFIG_DIR EXPORT BATCH.pt OUT.pt [--steps N]
        [--groups trainer|experts]
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


def trainer_groups(model, lr: float, weight_decay: float) -> list:
    from transformers import Trainer
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay, "lr": lr},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0, "lr": lr}]


def expert_groups(model, lr: float, weight_decay: float) -> list:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if ".experts." not in n], "weight_decay": weight_decay, "lr": lr},
            {"params": [p for n, p in named if ".experts." in n], "weight_decay": weight_decay, "lr": lr}]


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("export")
    ap.add_argument("batch")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", choices=("trainer", "experts"), default="trainer")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the weights come from the checkpoint; this only fixes the start values
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config_dir), dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    groups = trainer_groups if args.groups == "trainer" else expert_groups
    opt = torch.optim.AdamW(groups(model, 1e-3, 0.5))  # both overwritten by the checkpoint's
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=args.export)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    names = {p: n for n, p in model.named_parameters()}
    loaded = {
        "params": {n: full(p) for n, p in model.named_parameters()},
        "state": {names[p]: {k: full(v) for k, v in s.items()} for p, s in opt.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "group_names": [[names[p] for p in g["params"]] for g in opt.param_groups],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "names": list(msd),
    }
    ids = torch.load(args.batch)
    losses = []
    model.train()
    for _ in range(args.steps):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    loaded["losses"] = losses
    if dist.get_rank() == 0:
        torch.save(loaded, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(0)
