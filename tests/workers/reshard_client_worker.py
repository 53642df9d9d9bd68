"""Saves and resumes tiny Hugging Face models under real DeepSpeed on CPU, the way Trainer and
accelerate users do, at one world size; tests/deepspeed/load/test_reshard_clients.py resumes at another.

    torchrun --nproc_per_node W reshard_client_worker.py JOB.json

JOB.json: {"tokenizer": folder, "jobs": [{"client": "trainer" | "accelerate", "phase": "save" |
"resume", "stage": 2 | 3, "out": folder, "from": the saved run's folder (resume), "how": "pyckpt" |
"stock" (resume)}, ...]}. Every model is a LlamaForCausalLM with tied embeddings trained in bf16
(DeepSpeed's mixed precision: fp32 masters and Adam moments).

- save: two training steps, then the client's own save (the Trainer's ``checkpoint-2/``,
  ``Accelerator.save_state(out/state)``).
- resume: ``how`` "pyckpt" calls ``pyckpt.deepspeed.enable()`` and leaves the DeepSpeed config as it
  was saved with; "stock" is DeepSpeed's own road, ``"checkpoint": {"load_universal": true}`` over a
  folder the test converted with ds_to_universal. Two more steps follow; rank 0 writes
  ``out/result.pt``: the loss of every step after the resume and the weights at the end, gathered.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the harness (dsharness/), the helpers (helpers/) and the other workers
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]
import hf_client_worker as hf  # noqa: E402

STEPS_BEFORE, STEPS_AFTER = 2, 2


def ds_config(job: dict) -> dict:
    cfg = hf.ds_config({"stage": job["stage"], "dtype": "bf16"})
    if job.get("how") == "stock":
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def dataset(tokenizer) -> list:
    # 12 rows: whole batches at 2 and at 3 ranks (micro-batch 2)
    ids = hf.batch(tokenizer)
    return [{"input_ids": row, "labels": row} for _ in range(3) for row in ids]


def _enable(job: dict) -> None:
    if job.get("how") == "pyckpt":
        import pyckpt.deepspeed

        assert pyckpt.deepspeed.enable(), "pyckpt's backend did not install"


def run_trainer(job: dict, tokenizer, rank: int) -> None:
    from transformers import Trainer, TrainingArguments

    _enable(job)
    model = hf.make_model({"model": "llama", "tie": True}, len(tokenizer))
    resume = job["phase"] == "resume"
    args = TrainingArguments(
        output_dir=job["out"], deepspeed=ds_config(job) | {"train_batch_size": "auto", "train_micro_batch_size_per_gpu":
                                                           "auto", "gradient_accumulation_steps": "auto"},
        per_device_train_batch_size=2, max_steps=STEPS_BEFORE + (STEPS_AFTER if resume else 0),
        save_strategy="steps" if not resume else "no", save_steps=STEPS_BEFORE, logging_steps=1, learning_rate=1e-2,
        report_to=[], use_cpu=True, seed=1234, bf16=True, disable_tqdm=True, lr_scheduler_type="linear",
        warmup_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(tokenizer), processing_class=tokenizer)
    if not resume:
        trainer.train()
        return
    checkpoint = os.path.join(job["from"], f"checkpoint-{STEPS_BEFORE}")
    trainer.train(resume_from_checkpoint=checkpoint)
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    engine = trainer.model_wrapped
    _write_result(job, rank, engine, losses, {"global_step": trainer.state.global_step,
                                              "lr": trainer.lr_scheduler.get_last_lr()})


def run_accelerate(job: dict, tokenizer, rank: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler, set_seed

    _enable(job)
    set_seed(1234)
    model = hf.make_model({"model": "llama", "tie": True}, len(tokenizer))
    world = int(os.environ["WORLD_SIZE"])
    config = ds_config(job) | {"train_batch_size": 2 * world}
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "total_num_steps": 8,
                                                                "warmup_max_lr": 1e-2}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), mixed_precision="bf16")
    assert accelerator.distributed_type.name == "DEEPSPEED", accelerator.distributed_type
    rows = dataset(tokenizer)
    dummy = DummyOptim(model.parameters())
    engine, optimizer, scheduler = accelerator.prepare(model, dummy, DummyScheduler(dummy))
    state_dir = os.path.join(job["out"] if job["phase"] == "save" else job["from"], "state")
    start = 0
    if job["phase"] == "resume":
        accelerator.load_state(state_dir)
        start = STEPS_BEFORE
    losses = []
    engine.train()
    for step in range(start, start + (STEPS_AFTER if start else STEPS_BEFORE)):
        # the same rows at every world size and step: rank r takes rows [2r, 2r+2) of this step's batch
        chunk = rows[(step * 2 * world + 2 * rank) % len(rows):][:2]
        ids = torch.stack([r["input_ids"] for r in chunk])
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        every = [None] * world  # every rank's loss (gloo has no all_gather_into_tensor for accelerate's gather)
        dist.all_gather_object(every, loss.detach().float().item())
        losses.append((step + 1, every))
    if job["phase"] == "save":
        accelerator.save_state(state_dir)
        return
    _write_result(job, rank, engine, losses, {"global_step": engine.global_steps, "lr": scheduler.get_last_lr()})


def _write_result(job: dict, rank: int, engine, losses: list, extra: dict) -> None:
    module = engine.module if hasattr(engine, "module") else engine
    state = hf.gathered_state(module, job["stage"])
    masters = _gathered_masters(engine, job["stage"])
    if rank == 0:
        os.makedirs(job["out"], exist_ok=True)
        torch.save({"losses": losses, "state": state, "masters": masters, **extra},
                   os.path.join(job["out"], "result.pt"))
    dist.barrier()


def _gathered_masters(engine, stage: int) -> dict:
    """Every parameter's fp32 master, assembled from the ranks' partitions (what the next step starts from)."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    out = {}
    for name, p in module.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[name] = None if full is None else full.detach().clone()
    return out


def _fresh_accelerate_state() -> None:
    """accelerate keeps one Accelerator's state per process (the Trainer makes one too): each job
    here starts as a new script would, the process group kept."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    import deepspeed
    from dsharness.worker import skip_shm_comm_op

    # as every harness worker: DeepSpeed would JIT-compile its CPU shared-memory op into this run's
    # TORCH_EXTENSIONS_DIR (~100 s of CPU), which only inference_all_reduce uses
    skip_shm_comm_op()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if rank == 0 and not os.path.isdir(spec["tokenizer"]):
        hf.build_tokenizer(spec["tokenizer"])
    dist.barrier()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    for job in spec["jobs"]:
        if job["phase"] == "resume" and rank == 0 and os.path.isdir(job["out"]):
            shutil.rmtree(job["out"])
        dist.barrier()
        _fresh_accelerate_state()
        (run_trainer if job["client"] == "trainer" else run_accelerate)(job, tokenizer, rank)
        if job.get("how") == "pyckpt":
            import pyckpt.deepspeed

            pyckpt.deepspeed.disable()
        print(f"RESHARD-CLIENT done {job['client']} {job['phase']} {job['out']}", flush=True)
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main())
