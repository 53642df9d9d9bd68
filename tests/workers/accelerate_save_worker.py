"""accelerate's ``save_state`` with automatic checkpoint naming (``ProjectConfiguration(total_limit=2)``) under
real DeepSpeed on CPU, with or without ``pyckpt.deepspeed.enable(save=MODE)``
(tests/deepspeed/save/test_enable_save.py compares the runs).

    torchrun --nproc_per_node W accelerate_save_worker.py PROJECT TOKENIZER --mode none|atomic|async
        [--resume] [--kill-at I] [--limit K] [--mine]

A LlamaForCausalLM with tied embeddings, bf16 (DeepSpeed's mixed precision), ZeRO-2, 6 steps, a
``save_state()`` after every second step (``checkpoints/checkpoint_0`` .. ``_2``; ``--limit 2`` keeps two).
Stock accelerate's own rotation cannot be run here: under torchrun on CPU, with DeepSpeed's process group set
up before the Accelerator, every process believes it is the main one and all of them delete the oldest
folder at once (accelerate 1.15); pyckpt's rotation runs on rank 0 alone.
``--resume`` loads the newest (``load_state()``) and trains two more steps. ``--kill-at I``: rank 1
SIGKILLs itself while writing its RNG state in the save of ``checkpoint_I``. Rank 0 writes
PROJECT/result.json (or result_resume.json): the losses by step, and the step the resume started from.
``--mine``: PROJECT/mine/notes.txt is a file of the user's before the job, and after the last step
``save_state(PROJECT/mine)`` (automatic naming off for that call) saves into that folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]
import hf_client_worker as hf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("project")
    ap.add_argument("tokenizer")
    ap.add_argument("--mode", choices=("none", "atomic", "async"), default="none")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="ProjectConfiguration's total_limit")
    ap.add_argument("--mine", action="store_true")
    args = ap.parse_args()

    rank, world, tokenizer = hf.start_save_job(args.mode, args.tokenizer)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler, ProjectConfiguration, set_seed

    set_seed(1234)
    model = hf.make_model({"model": "llama", "tie": True}, len(tokenizer))
    config = hf.ds_config({"stage": 2, "dtype": "bf16"}) | {"train_batch_size": 2 * world}
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "total_num_steps": 10,
                                                                "warmup_max_lr": 1e-2}}
    project = ProjectConfiguration(project_dir=args.project, automatic_checkpoint_naming=True,
                                    total_limit=args.limit)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), mixed_precision="bf16",
                              project_config=project)
    dummy = DummyOptim(model.parameters())
    engine, optimizer, scheduler = accelerator.prepare(model, dummy, DummyScheduler(dummy))
    ids_all = hf.batch(tokenizer)
    start = 0
    if args.resume:
        accelerator.load_state()  # the newest checkpoint_<i>
        start = engine.global_steps
        accelerator.project_configuration.iteration = start // 2
    if args.kill_at is not None and rank == 1:
        import accelerate.checkpointing as checkpointing

        save_rng = checkpointing.save_accelerator_state

        def killing(output_dir, *a, **k):
            if output_dir.endswith(f"checkpoint_{args.kill_at}"):
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            return save_rng(output_dir, *a, **k)
        sys.modules["accelerate.accelerator"].save_accelerator_state = killing
    losses = {}
    engine.train()
    for step in range(start, start + (2 if args.resume else 6)):
        ids = torch.stack([ids_all[(step * world + rank) % len(ids_all)]] * 2)
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step + 1] = float(loss.detach().float())
        if (step + 1) % 2 == 0:
            accelerator.save_state()
    if args.mine:
        mine = os.path.join(args.project, "mine")
        if rank == 0:
            os.makedirs(mine)
            with open(os.path.join(mine, "notes.txt"), "w") as f:
                f.write("the user's")
        accelerator.wait_for_everyone()
        accelerator.project_configuration.automatic_checkpoint_naming = False
        accelerator.save_state(mine)
        accelerator.project_configuration.automatic_checkpoint_naming = True
    if rank == 0:
        name = "result_resume.json" if args.resume else "result.json"
        with open(os.path.join(args.project, name), "w") as f:
            json.dump({"losses": losses, "start": start}, f)
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main(), exit_handlers=True)
