"""Stock transformers and accelerate saving into prepared folders, one process on CPU, no DeepSpeed
(tests/deepspeed/save/test_framework_against_stock.py compares pyckpt's rules with what they leave).

    python framework_stock_worker.py CASES.json RESULT.json

CASES.json: a list of {"id", "kind", "root", ...}:

* ``trainer``: ``Trainer._save_checkpoint`` at global step 3 into ``root`` (its ``checkpoint-3``), a tiny
  Llama, the optimizer and scheduler made, nothing trained;
* ``accelerate_dir``: ``Accelerator(cpu=True).save_state(root + "/" + name)`` without automatic naming;
* ``accelerate_rotation``: ``save_state()`` with ``ProjectConfiguration(project_dir=root,
  automatic_checkpoint_naming=True, total_limit=limit, iteration=10)``: its rotation of ``root/checkpoints``,
  then ``checkpoint_10``.

A case's ``copy`` ([source, target]), where given, copies a folder first (an earlier case's output: a
checkpoint saved before), and its ``files`` ([relative path, text], under ``root``) are written after. RESULT.json: id -> the exception's class name (None where the save returned) and
message.
"""

from __future__ import annotations

import json
import os
import shutil
import sys


def _trainer(root: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    args = TrainingArguments(output_dir=root, use_cpu=True, report_to=[], save_strategy="steps", save_steps=1,
                             disable_tqdm=True, seed=1)
    trainer = Trainer(model=LlamaForCausalLM(config), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    trainer.state.global_step = 3
    trainer._save_checkpoint(trainer.model, None)


def _accelerate(root: str, name, limit) -> None:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    if name is not None:
        Accelerator(cpu=True).save_state(os.path.join(root, name))
        return
    project = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=limit, iteration=10)
    Accelerator(cpu=True, project_config=project).save_state()


def main() -> int:
    cases = json.load(open(sys.argv[1]))
    results = {}
    for case in cases:
        if case.get("copy"):
            shutil.copytree(*case["copy"])
        for rel, text in case.get("files", ()):
            with open(os.path.join(case["root"], rel), "w") as f:
                f.write(text)
        try:
            if case["kind"] == "trainer":
                _trainer(case["root"])
            else:
                _accelerate(case["root"], case.get("name"), case.get("limit"))
            results[case["id"]] = [None, None]
        except Exception as exc:  # the oracle: what stock raises there
            results[case["id"]] = [type(exc).__name__, str(exc)]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
