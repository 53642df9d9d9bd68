"""A torchtitan 0.3.0 checkpoint made by torchtitan's own checkpointer (run by torchrun, gloo, CPU): the
folder pyckpt's ``from_torchtitan`` reader reads, and torchtitan's own Hugging Face conversion of it.

torchtitan's trainer cannot run here: it needs torchdata (not installed) for its dataloader, and torch
2.13 has no CPU backward for FlexAttention, the attention its Llama3 builds for language models. So
the pieces its trainer would hand to the checkpointer are built with torchtitan's own classes instead,
and its ``CheckpointManager.save`` writes the folder:

- the model: torchtitan's Llama3 (``torchtitan_worker.build``: its layer and model configs, shrunk to a
  few hundred KB), sharded like its FSDP path (``fully_shard`` on each block, then the model);
- the optimizer: its ``OptimizersContainer`` (AdamW, two param groups by pattern: weight decay on the
  matrices, none on the norms; the for-loop implementation, fused being CUDA-only) and its
  ``LRSchedulersContainer`` (linear warm-up and decay);
- 2 training steps whose gradients are set by hand (a fixed function of each parameter), since the
  attention has no backward on CPU;
- ``train_state``: what its Trainer's ``state_dict`` returns (step, ntokens_seen);
- ``dataloader``: a stand-in with the state layout of its ``ParallelAwareDataloader`` (the pickled
  per-rank state under ``dp_rank_R`` and ``world_size``), torchdata being absent.

``CheckpointManager.save(2)`` writes OUT/checkpoint/step-2: the model at the top level under torchtitan's
names, the optimizer flattened under "optimizer", "lr_scheduler", "dataloader", "train_state".

Rank 0 also writes OUT/hf/config.json (a transformers LlamaConfig of the model's shape: dim, heads, kv
heads, vocabulary, ffn size, rotary base, norm eps) and OUT/reference.pt: ``hf`` (torchtitan's
``Llama3StateDictAdapter.to_hf`` of the model's full state dict), ``tt`` (that full state dict) and ``hf_config``.

    torchrun --nproc_per_node W tests/workers/torchtitan_save_worker.py OUT [--tie]
"""

import argparse
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from torchtitan_worker import build, stub_triton_kernels

# The model's shape in Hugging Face terms (torchtitan_worker.build reads these keys).
HF_SHAPE = {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "intermediate_size": 80, "vocab_size": 203, "max_position_embeddings": 64, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5}
STEPS = 2


class TrainState(Stateful):
    """What torchtitan's Trainer saves under "train_state" (Trainer.state_dict)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class DataLoaderState(Stateful):
    """The state layout of torchtitan's ParallelAwareDataloader: its rank's pickled loader state under
    ``dp_rank_R``, and the data-parallel world size."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.batches = 0

    def state_dict(self) -> dict:
        return {f"dp_rank_{self.rank}": pickle.dumps({"batches_yielded": self.batches}), "world_size": self.world}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches = pickle.loads(state_dict[f"dp_rank_{self.rank}"])["batches_yielded"]


def hf_config(tie: bool):
    from transformers import LlamaConfig

    s = HF_SHAPE
    return LlamaConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                       intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_hidden_layers"],
                       num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
                       max_position_embeddings=s["max_position_embeddings"], rms_norm_eps=s["rms_norm_eps"],
                       rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
                       tie_word_embeddings=tie, attention_bias=False, mlp_bias=False)


def main() -> None:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tie", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config, model = build({**HF_SHAPE, "tie_word_embeddings": args.tie})
    for block in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(block)
    fully_shard(model)

    adamw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r"norm", optimizer_name="AdamW",
                                       optimizer_kwargs={**adamw, "weight_decay": 0.0}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={**adamw, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=10)
    train_state = TrainState()
    loader = DataLoaderState(rank, world)
    adapter = Llama3StateDictAdapter(config, None)
    checkpointer = CheckpointManager.Config(enable=True, folder="checkpoint", interval=STEPS).build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=adapter, base_folder=str(out))

    for _ in range(STEPS):
        train_state.step += 1
        optimizers.zero_grad()
        for p in model.parameters():
            p.grad = torch.sin(p.detach() * 3.0 + train_state.step) * 1e-2
        optimizers.step()
        schedulers.step()
        train_state.ntokens_seen += 2 * 16
        loader.batches += 1
    checkpointer.save(train_state.step)
    checkpointer.close()

    tt = {}
    for key, value in model.state_dict().items():  # torchtitan's names (its hook splits the fused wqkv)
        tt[key] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    if rank == 0:
        hf = adapter.to_hf(dict(tt))
        cfg = hf_config(args.tie)
        cfg.save_pretrained(out / "hf")
        torch.save({"hf": hf, "tt": tt, "hf_config": cfg.to_dict(), "step": STEPS}, out / "reference.pt")
    dist.barrier()


if __name__ == "__main__":
    stub_triton_kernels()
    main()
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(0)
