"""A tiny Hugging Face model trained by FSDP2 (or FSDP2 x tensor parallel) and saved with
torch.distributed.checkpoint the way training scripts save it (run by torchrun, gloo, CPU): the DCP
folders pyckpt reads and the references its Hugging Face export must equal.

Every rank builds the same fp32 model from a config made from the arguments (seeded alike), then:
``--mesh fsdp`` shards each decoder layer and then the model over all ranks with ``fully_shard``;
``--mesh fsdp_tp`` makes a (dp, tp) mesh with tp 2, splits q/k/v/gate/up column-wise and o/down
row-wise with ``parallelize_module`` and shards over dp. torch AdamW in two groups (weight decay on
the matrices, none on the norms) trains 2 steps on one fixed batch, and the state is saved:
``dcp.save({"model": msd, "optim": osd})`` from ``get_state_dict`` (``--writer dcp``, torch's
FileSystemWriter), or the model entries alone through ``HuggingFaceStorageWriter(save_distributed=True)``
(``--writer hf``: one safetensors file per rank whose header records each shard's offsets).

The sizes leave shards uneven: an odd vocabulary, an intermediate size that neither 2, 3 nor 4 divide
evenly once split, and (at 3 ranks) a hidden size 3 does not divide.

Rank 0 writes OUT/config.json (``save_pretrained``) and OUT/reference.pt: ``model`` (the full model
state at save time, ``get_model_state_dict(full_state_dict, cpu_offload)``), ``optim`` (the full
optimizer state, ``get_optimizer_state_dict`` likewise), ``ids`` and ``logits`` (the fixed batch and the
model's logits on it at save time), ``losses`` (3 more training steps on the same batch after the save)
and ``args``.

    torchrun --nproc_per_node W tests/workers/dcp_save_worker.py OUT [--model llama|mixtral] [--tie]
        [--mesh fsdp|fsdp_tp] [--writer dcp|hf]
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict)
from torch.distributed.fsdp import fully_shard

VOCAB = 251
HIDDEN = 40
HEADS, KV_HEADS = 4, 2
LAYERS = 2


def make_config(model: str, tie: bool):
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=tie)
    if model == "llama":
        return LlamaConfig(intermediate_size=70, **common)
    return MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **common)


def tensor_parallel(model, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)


def groups(model, lr: float) -> list:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1, "lr": lr},
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0, "lr": lr}]


def step(model, opt, ids) -> float:
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return float(loss.detach())


def detached(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: detached(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(detached(v) for v in tree)
    return tree


def main() -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", choices=("llama", "mixtral"), default="llama")
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--mesh", choices=("fsdp", "fsdp_tp"), default="fsdp")
    ap.add_argument("--writer", choices=("dcp", "hf"), default="dcp")
    args = ap.parse_args()
    if args.mesh == "fsdp_tp" and args.model != "llama":
        raise SystemExit("--mesh fsdp_tp is planned for Llama only")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    config = make_config(args.model, args.tie)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.mesh == "fsdp_tp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = None
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(groups(model, 1e-2))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    for _ in range(2):
        step(model, opt, ids)

    msd, osd = get_state_dict(model, opt)
    if args.writer == "hf":
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        dcp.save(msd, storage_writer=HuggingFaceStorageWriter(str(out / "dcp"), save_distributed=True))
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "dcp"))

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # copied now: on CPU the full state dicts share what is not a DTensor (the steps) with the live
    # optimizer, which the steps after the save change in place
    ref_model = detached(get_model_state_dict(model, options=full))
    ref_optim = detached(get_optimizer_state_dict(model, opt, options=full))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    model.train()
    losses = [step(model, opt, ids) for _ in range(3)]
    if rank == 0:
        config.save_pretrained(out)
        torch.save({"model": ref_model, "optim": ref_optim, "ids": ids, "logits": logits.detach().clone(),
                    "losses": losses, "args": vars(args), "world": world}, out / "reference.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(0)
