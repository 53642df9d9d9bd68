"""TRL's ``SFTTrainer`` fine-tuning a PEFT LoRA model under real DeepSpeed on CPU, stock and under
``pyckpt.deepspeed.enable(save="async")``, in one launch (tests/deepspeed/save/test_trl_client.py compares them).

    torchrun --nproc_per_node 2 trl_client_worker.py ROOT TOKENIZER --stage 2|3

The model: a tiny LlamaForCausalLM (tests/workers/hf_client_worker.py) wrapped by ``peft.get_peft_model`` with
LoRA on the attention's q and v projections, trained in bf16 (DeepSpeed's mixed precision) for four steps with a
save every two. Four jobs, each a new SFTTrainer in this process, each into a folder named ``run`` (the Trainer
records its output folder, and TRL names the model card after it):

* ``ROOT/stock/run``: DeepSpeed's own saves;
* ``ROOT/stock-resume/run``: ``train(resume_from_checkpoint=ROOT/stock/run/checkpoint-2)``, to step 4;
* then, inside ``with pyckpt.deepspeed.enable(save="async")``, ``ROOT/async/run`` and ``ROOT/async-resume/run``
  the same way from ``ROOT/async/run/checkpoint-2``.

Every job's model is built before the first Trainer (the Trainer leaves DeepSpeed's ZeRO-3 config set for the
process, and a model built after it would be partitioned by ``zero.Init``), from the same seeds. Rank 0 writes
ROOT/result.json: for each job its losses by step, its global step and a sha256 of each trained weight (gathered
under ZeRO-3), with the names of the trainable ones and the checkpoints pyckpt's background write wrote; and ROOT/<job>/weights.pt: {"trained": the module's weights at
the end (bf16; gathered under ZeRO-3)}, for the export's comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]
import hf_client_worker as hf  # noqa: E402

STEPS = 4
JOBS = ("stock", "stock-resume", "async", "async-resume")


def lora_model(vocab: int):
    from peft import LoraConfig, get_peft_model

    model = hf.make_model({"model": "llama"}, vocab)  # seeded: every job's base model is the same
    torch.manual_seed(4321)  # and so is every job's LoRA initialisation
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("tokenizer")
    ap.add_argument("--stage", type=int, choices=(2, 3), required=True)
    args = ap.parse_args()

    rank, _, tokenizer = hf.start_save_job("none", args.tokenizer)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    import pyckpt.deepspeed
    from pyckpt.deepspeed.save import async_save

    # which checkpoints pyckpt's background write wrote (its staging folder is named after the checkpoint's)
    written = []
    write = async_save.write_files

    def recorded(files, sources, root, *a, **k):
        written.append(re.search(r"checkpoint-[0-9]+", root).group())
        return write(files, sources, root, *a, **k)
    async_save.write_files = recorded

    models = {job: lora_model(len(tokenizer)) for job in JOBS}
    # pre-tokenized rows of unequal length: TRL's collator pads them and masks the padding out of the labels
    rows = tokenizer(hf.SENTENCES)["input_ids"]
    data = Dataset.from_list([{"input_ids": row} for _ in range(4) for row in rows])
    result = {}

    def job(name: str, resume_from=None) -> None:
        ds = hf.ds_config({"stage": args.stage, "dtype": "bf16"})
        ds.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
        config = SFTConfig(output_dir=os.path.join(args.root, name, "run"), deepspeed=ds, per_device_train_batch_size=2,
                           max_steps=STEPS, save_strategy="steps", save_steps=2, logging_steps=1, learning_rate=1e-2,
                           report_to=[], use_cpu=True, seed=1234, bf16=True, disable_tqdm=True,
                           lr_scheduler_type="linear", warmup_steps=1, max_length=16, packing=False)
        trainer = SFTTrainer(model=models[name], args=config, train_dataset=data, processing_class=tokenizer)
        del written[:]
        trainer.train(resume_from_checkpoint=resume_from)
        engine = trainer.model_wrapped
        state = hf.gathered_state(engine.module, args.stage)
        trainable = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
        if rank == 0:
            result[name] = {"losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
                            "global_step": trainer.state.global_step, "trainable": trainable,
                            "written_in_background": sorted(set(written)),
                            "weights": {k: hashlib.sha256(v.float().contiguous().numpy().tobytes()).hexdigest()
                                        for k, v in state.items()}}
            torch.save({"trained": state},
                       os.path.join(args.root, name, "weights.pt"))
        dist.barrier()
        engine.destroy()

    def checkpoint_2(name: str) -> str:
        return os.path.join(args.root, name, "run", "checkpoint-2")

    job("stock")
    job("stock-resume", checkpoint_2("stock"))
    with pyckpt.deepspeed.enable(save="async"):
        job("async")
        job("async-resume", checkpoint_2("async"))
    if rank == 0:
        with open(os.path.join(args.root, "result.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main(), exit_handlers=True)
