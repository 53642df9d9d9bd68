"""A Hugging Face Trainer job on the memory tier under torchrun (tests/deepspeed/tiers/test_memory_trainer.py): a tiny
LlamaForCausalLM, ZeRO-2 bf16 on 2 CPU ranks, the Trainer saving checkpoint-4 and checkpoint-8 itself,
pyckpt.deepspeed.MemoryCheckpoints saving to memory every 2nd step.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 memory_trainer_worker.py JOB.json

JOB.json: {"root": folder, "kill_at": K, "trainer_optimizer": whether the Trainer makes its own AdamW and
scheduler (no optimizer in the DeepSpeed config: the scheduler is the Trainer's, in scheduler.pt)}.
The first run (TORCHELASTIC_RESTART_COUNT 0) trains into root/out; once step K's memory save is
published, rank 1 kills itself and rank 0 waits for torchrun. The restart calls
``trainer.train(resume_from_checkpoint=pyckpt.deepspeed.resume_point(out, tier))`` under
``enable(resume_tier=tier)``, then trains the same job uninterrupted into root/ref (another memory job) as
the reference. Rank 0 writes root/result.json: each run's loss per step and rank (as Python floats:
JSON keeps them exact), the resume point and the folder it named, and the lines pyckpt logged.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the harness (dsharness/), the helpers (helpers/) and the other workers
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]

from logged import pyckpt_warnings  # noqa: E402  (tests/helpers/logged.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hf_client_worker as hf  # noqa: E402

import pyckpt.deepspeed as pd  # noqa: E402

STEPS, SAVE_STEPS, EVERY = 8, 4, 2


def dataset(tokenizer) -> list:
    # 16 different rows: 4 steps an epoch at 2 ranks x micro-batch 2, so step 6 is inside the second
    # epoch and the resume skips the epoch's first batches as the Trainer does
    ids = hf.batch(tokenizer)
    rows = [torch.roll(row, k) for k in range(4) for row in ids]
    return [{"input_ids": row, "labels": row} for row in rows]


def make_trainer(job: dict, tokenizer, out: str):
    from transformers import Trainer, TrainingArguments

    class Recording(Trainer):
        """Keeps each step's loss on this rank (``losses``), as the step computed it."""

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append((self.state.global_step + 1, float(loss)))
            return loss

    config = hf.ds_config({"stage": 2, "dtype": "bf16"}) | {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    if job.get("trainer_optimizer"):
        del config["optimizer"]
    args = TrainingArguments(output_dir=out, deepspeed=config, per_device_train_batch_size=2, max_steps=STEPS,
                             save_strategy="steps", save_steps=SAVE_STEPS, logging_steps=1, learning_rate=1e-2,
                             report_to=[], use_cpu=True, seed=1234, bf16=True, disable_tqdm=True,
                             lr_scheduler_type="linear", warmup_steps=1)
    model = hf.make_model({"model": "llama"}, len(tokenizer))
    trainer = Recording(model=model, args=args, train_dataset=dataset(tokenizer), processing_class=tokenizer)
    trainer.losses = []
    return trainer


def fresh_accelerate_state() -> None:
    """accelerate keeps one state per process: the second Trainer starts as a new script would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    from dsharness.worker import skip_shm_comm_op

    skip_shm_comm_op()
    import deepspeed
    from transformers import AutoTokenizer, TrainerCallback

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # as tests/workers/memory_crash_worker.py: gloo's keys in torchrun's store carry no attempt number, so a
    # restarted rank would connect to the killed rank's old address; a prefix per attempt keeps them apart
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    root = job["root"]
    tokenizer_dir = os.path.join(root, "tokenizer")
    if rank == 0 and not os.path.isdir(tokenizer_dir):
        hf.build_tokenizer(tokenizer_dir)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    lines = pyckpt_warnings()
    out, ref = os.path.join(root, "out"), os.path.join(root, "ref")
    tier = pd.MemoryTier(root=os.path.join(root, "mem"), job="trainer", keep=2)
    assert pd.enable(resume_tier=tier)

    class KillAfter(TrainerCallback):
        """Rank 1 dies once step ``step``'s memory save is published on every rank; rank 0 waits for
        torchrun to take it down and restart both."""

        def __init__(self, memory, step: int):
            self.memory, self.step = memory, step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                self.memory.handle.wait()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(600)

    trainer = make_trainer(job, tokenizer, out)
    memory = pd.MemoryCheckpoints(trainer, tier, every=EVERY)
    trainer.add_callback(memory)
    if restart == 0:
        trainer.add_callback(KillAfter(memory, job["kill_at"]))
        trainer.train()
        return 1  # the kill never came
    point = pd.resume_point(out, tier)
    assembled = None
    if point is not None:  # what the Trainer is given to read
        latest = Path(point, "latest").read_text()
        memory_copy = os.path.join(tier.folder(), latest, "mp_rank_00_model_states.pt")
        assembled = {"listing": sorted(os.listdir(point)), "latest": latest,
                     "state": json.loads(Path(point, "trainer_state.json").read_text()),
                     "hard_linked": os.path.exists(memory_copy) and os.path.samefile(
                         os.path.join(point, latest, "mp_rank_00_model_states.pt"), memory_copy)}
    trainer.train(resume_from_checkpoint=point)
    crash = {"losses": trainer.losses, "global_step": trainer.state.global_step,
             "engine_steps": trainer.model_wrapped.global_steps}
    resumed_log = list(lines)
    fresh_accelerate_state()
    reference = make_trainer(job, tokenizer, ref)
    reference_memory = pd.MemoryCheckpoints(reference, pd.MemoryTier(root=os.path.join(root, "mem"), job="ref", keep=2),
                                            every=EVERY)
    reference.add_callback(reference_memory)
    reference.train()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"crash": crash["losses"], "ref": reference.losses})
    if rank == 0:
        with open(os.path.join(root, "result.json"), "w") as f:
            json.dump({"restart": restart, "resume_point": point, "assembled": assembled, "log": resumed_log,
                       "prepared": [memory.prepared, reference_memory.prepared], "global_step": crash["global_step"], "engine_steps": crash["engine_steps"],
                       "crash_losses": [e["crash"] for e in every], "ref_losses": [e["ref"] for e in every]}, f)
    dist.barrier()
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    # a normal end runs pyckpt's exit duties (the memory tier persists and clears) before leaving
    leave_and_exit(main(), exit_handlers=True)
