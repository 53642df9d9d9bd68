"""An FSDP2 job resuming from pyckpt's DCP export of a DeepSpeed checkpoint (run by torchrun).

Every rank builds the harness model in fp32, shards it with ``fully_shard``, makes torch Adam with
DeepSpeed's param groups, and loads the export the way FSDP2 scripts do:
``get_state_dict`` -> ``dcp.load({"model": ..., "optim": ...})`` -> ``set_state_dict``. Rank 0 then
writes what was loaded (every parameter and Adam state gathered with ``full_tensor()``, the groups'
hyper-parameters) and the losses of a few more training steps, each on the same batch on every rank.

    torchrun --nproc_per_node W tests/workers/dcp_fsdp_worker.py JOBS.json [--steps N]

JOBS.json lists several resumes (model, export, out, groups), run one after the other in one launch.
A job with "flat": true loads torchtitan's checkpointer layout instead: the model's entries at the top
level, the optimizer under "optimizer" as ``flatten_optimizer_state_dict=True`` gives it.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

# The harness package (tests/dsharness) sits one folder up from the workers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsharness import models  # noqa: E402

LR = 1e-2  # the harness's DeepSpeed config


def param_groups(model, groups: bool):
    """DeepSpeed's groups in the harness: one, or the weights and the biases (models.BIAS_GROUP)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not groups:
        return [{"params": [p for _, p in named]}]
    return [{"params": [p for n, p in named if not n.endswith(".bias")]},
            {"params": [p for n, p in named if n.endswith(".bias")], **models.BIAS_GROUP}]


def next_batch(name: str, step: int):
    """One batch, the same on every rank: the concatenation of the harness's two dp ranks' batches."""
    parts = [models.batch(name, r, step, torch.float32) for r in range(2)]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def resume(name: str, export: str, out: str, groups: bool, steps: int, first_step: int, flat: bool) -> None:
    model = models.build_model(name)
    # one FSDP unit: the harness models tie weights across their submodules
    fully_shard(model)
    opt = torch.optim.Adam(param_groups(model, groups), lr=LR)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = get_state_dict(model, opt, options=options)
    if flat:
        dcp.load({**msd, "optimizer": osd}, checkpoint_id=export)
    else:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=export)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)

    names = {p: n for n, p in model.named_parameters()}
    loaded = {
        "params": {n: full(p) for n, p in model.named_parameters()},
        "buffers": {n: full(b) for n, b in model.named_buffers()},
        "state": {names[p]: {k: full(v) for k, v in s.items()} for p, s in opt.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "group_names": [[names[p] for p in g["params"]] for g in opt.param_groups],
    }
    losses = []
    model.train()
    for k in range(steps):
        opt.zero_grad()
        loss = model(*next_batch(name, first_step + k))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    loaded["losses"] = losses
    if dist.get_rank() == 0:
        torch.save(loaded, out)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", help="JSON: [{model, export, out, groups}, ...], resumed one after the other")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--first-step", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    for job in json.loads(open(args.jobs).read()):
        resume(job["model"], job["export"], job["out"], job["groups"], args.steps, args.first_step,
               job.get("flat", False))


if __name__ == "__main__":
    main()
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(0)
