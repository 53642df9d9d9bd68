"""Trains tiny Hugging Face models under real DeepSpeed on CPU and saves them the way users do.

Run by tests/huggingface/test_hf_client.py under torchrun (2 ranks, gloo):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/hf_client_worker.py JOB.json

JOB.json: {"tokenizer": folder, "jobs": [{"kind": "engine" | "trainer", "model": "llama" | "mixtral",
"stage": 2 | 3, "dtype": "fp32" | "bf16", "tie": bool, "autoep": int, "hf_optimizer": bool, "out": folder},
...]} (hf_optimizer: the Trainer makes its own AdamW, decay and no-decay groups, constant lr).

For each job: the model is trained for two steps and saved with ``engine.save_checkpoint(out)`` (or
by the Trainer, which writes ``out/checkpoint-2/``), and rank 0 writes the model config and the
tokenizer beside the checkpoint, as the Trainer and DeepSpeed's examples do. Rank 0 then writes
``out/reference.pt``: the training model's gathered weights (ZeRO-3: under GatheredParameters) and
the logits a fresh model holding them gives on a fixed batch, on one thread, so that a test process
can compare bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

# Run as a script from tests/workers: the harness package (tests/dsharness) is one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SENTENCES = ["the quick brown fox jumps over the lazy dog", "a checkpoint cut into one shard per rank",
             "pyckpt turns deepspeed checkpoints into model files", "every rank reads only its own bytes"]


def build_tokenizer(folder: str):
    """A word-level tokenizer trained on SENTENCES, saved as save_pretrained saves it (no hub)."""
    from pyckpt.demo import build_tokenizer as build

    return build(folder, SENTENCES)


def start_save_job(save_mode: str, tokenizer_dir: str):
    """One rank of a save test's job (tests/deepspeed/save/test_enable_save.py): DeepSpeed's CPU shared-memory op
    skipped, ``pyckpt.deepspeed.enable(save=save_mode)`` unless it is "none" (before anything saves), gloo up,
    the test tokenizer built once by rank 0. Returns (rank, world size, tokenizer)."""
    import deepspeed
    from dsharness.worker import skip_shm_comm_op
    from transformers import AutoTokenizer

    skip_shm_comm_op()
    if save_mode != "none":
        import pyckpt.deepspeed

        pyckpt.deepspeed.enable(save=save_mode)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not os.path.isdir(tokenizer_dir):
        build_tokenizer(tokenizer_dir)
    dist.barrier()
    return rank, world, AutoTokenizer.from_pretrained(tokenizer_dir)


def batch(tokenizer) -> torch.Tensor:
    return tokenizer(SENTENCES, padding="max_length", max_length=10, truncation=True, return_tensors="pt")["input_ids"]


def make_model(job: dict, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=job.get("tie", False),
                  pad_token_id=1, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(1234)
    if job["model"] == "mixtral":
        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    return LlamaForCausalLM(LlamaConfig(**common))


def ds_config(job: dict) -> dict:
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": job["stage"]}, "steps_per_print": 1000}
    if job["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if job.get("autoep"):
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": job["autoep"]}
    return cfg


def gathered_state(model, stage: int) -> dict:
    if stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def all_experts(state: dict) -> dict:
    """AutoEP at ZeRO-2 keeps each EP rank's own experts: the full [E, ...] tensors, gathered in
    rank order (the default placement: rank r holds experts [r*E/ep, (r+1)*E/ep))."""
    out = dict(state)
    for name, t in state.items():
        if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".experts." in name:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t.contiguous())
            out[name] = torch.cat(parts, 0)
    return out


def mixtral_names(state: dict) -> dict:
    """The AutoEP layers' tensors under transformers' Mixtral names, built with torch: the router
    is mlp.gate, each expert's gate_up_proj is its w1 rows then its w3 rows, down_proj is w2 (the
    inverse of DeepSpeed's moe/ep_repack.py::_repack_fused_3d, gate_up_first)."""
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.gate.gate.weight"):
            continue  # AutoEP's second name for the router weight
        if name.endswith(".mlp.router.gate.weight"):
            out[name.replace(".mlp.router.gate.weight", ".mlp.gate.weight")] = t
        elif name.endswith(".experts.w1"):
            out[name[:-len("w1")] + "gate_up_proj"] = torch.cat([t, state[name[:-len("w1")] + "w3"]], dim=1)
        elif name.endswith(".experts.w2"):
            out[name[:-len("w2")] + "down_proj"] = t
        elif not name.endswith(".experts.w3"):
            out[name] = t
    return out


def reference(job: dict, state: dict, vocab: int, ids: torch.Tensor) -> dict:
    """Logits of a fresh model holding the gathered weights, built in their dtype the way
    from_pretrained builds one (rotary frequencies stay float32; a cast with .to() would round them)."""
    template = make_model(job, vocab)
    fresh = type(template)._from_config(template.config, dtype=next(iter(state.values())).dtype)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    fresh.eval()
    torch.set_num_threads(1)
    with torch.no_grad():
        logits = fresh(ids).logits
    return {"state": state, "logits": logits, "missing": list(missing)}


def run_engine(job: dict, tokenizer, rank: int) -> None:
    import deepspeed

    vocab = len(tokenizer)
    model = make_model(job, vocab)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(job))
    ids = batch(tokenizer)
    mine = ids[2 * rank:2 * rank + 2]
    for _ in range(2):
        loss = engine(mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(job["out"])
    extra = {}
    if job["model"] == "mixtral":
        # The training model's own output (all EP ranks take part), to hold the Hugging Face
        # layout's semantics to: the grouped expert kernels add in another order, so not bit for bit.
        engine.module.eval()
        with torch.no_grad():
            extra["training_logits"] = engine.module(ids).logits
        engine.module.train()
    state = gathered_state(engine.module, job["stage"])
    if job["model"] == "mixtral":
        state = mixtral_names(all_experts(state))
    if rank == 0:
        # What the examples do beside save_checkpoint: the config and tokenizer, from rank 0.
        engine.module.config.save_pretrained(job["out"])
        tokenizer.save_pretrained(job["out"])
        torch.save(reference(job, state, vocab, ids) | extra, os.path.join(job["out"], "reference.pt"))
    dist.barrier()
    engine.destroy()


def run_trainer(job: dict, tokenizer, rank: int) -> None:
    from transformers import Trainer, TrainingArguments

    vocab = len(tokenizer)
    model = make_model(job, vocab)
    ids = batch(tokenizer)
    data = [{"input_ids": row, "labels": row} for row in ids]
    ds = ds_config(job) | {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                           "gradient_accumulation_steps": "auto"}
    if job.get("hf_optimizer"):
        # The Trainer's own AdamW (no optimizer in the DeepSpeed config): its two param groups, with
        # and without weight decay, reach DeepSpeed as a client optimizer; a constant lr keeps the
        # saved groups' lr above 0, so that training on from the checkpoint moves the weights.
        del ds["optimizer"]
    args = TrainingArguments(output_dir=job["out"], deepspeed=ds,
        per_device_train_batch_size=2, max_steps=2, save_strategy="steps", save_steps=2, logging_steps=1,
        learning_rate=1e-2, report_to=[], use_cpu=True, seed=1234, bf16=job["dtype"] == "bf16", disable_tqdm=True,
        weight_decay=0.1 if job.get("hf_optimizer") else 0.0,
        lr_scheduler_type="constant" if job.get("hf_optimizer") else "linear")
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    state = gathered_state(trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model,
                           job["stage"])
    # The Trainer leaves its ZeRO-3 config set for the process: a model built after it (the reference's,
    # on rank 0 alone) would be partitioned by zero.Init, a collective the other rank never joins.
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    if rank == 0:
        torch.save(reference(job, state, vocab, ids), os.path.join(job["out"], "reference.pt"))
    dist.barrier()


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    import deepspeed
    from dsharness.worker import skip_shm_comm_op

    # as every harness worker: DeepSpeed would JIT-compile its CPU shared-memory op into this run's
    # TORCH_EXTENSIONS_DIR (~100 s of CPU), which only inference_all_reduce uses
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if rank == 0:
        build_tokenizer(spec["tokenizer"])
    dist.barrier()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    for job in spec["jobs"]:
        (run_trainer if job["kind"] == "trainer" else run_engine)(job, tokenizer, rank)
        print(f"HF-CLIENT done {job['out']}", flush=True)
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main())
