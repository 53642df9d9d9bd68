"""Lightning's ``DeepSpeedStrategy.save_checkpoint`` (lightning 2.6.6) under real DeepSpeed on CPU, with or
without ``pyckpt.deepspeed.enable(save=MODE)`` (tests/deepspeed/save/test_enable_save.py compares the runs).

Lightning's DeepSpeed strategy refuses to run without CUDA (``DeepSpeedStrategy.setup_environment`` raises
"The DeepSpeed strategy is only supported on CUDA GPUs"), so its Trainer cannot drive a job on these
machines. What pyckpt hooks is the one call its ``save_checkpoint`` makes,
``self.deepspeed_engine.save_checkpoint(filepath, client_state=checkpoint, tag="checkpoint", ...)``: here
Lightning's own ``save_checkpoint`` function runs, unchanged, on a strategy object that holds a real
DeepSpeed engine (ZeRO-2, bf16, a tiny Llama) and Lightning's checkpoint dictionary, after two steps and
after four, into ``OUT/epoch=0-step=2.ckpt`` and ``OUT/epoch=0-step=4.ckpt``.

    torchrun --nproc_per_node W lightning_save_worker.py OUT TOKENIZER --mode none|atomic|async [--kill-second]
        [--remove-first [--copy-first DIR]]

``--kill-second``: rank 1 SIGKILLs itself as its background write of the second save starts (async).
``--remove-first``: after the second save, Lightning's ``remove_checkpoint`` of the first, as
``ModelCheckpoint(save_top_k=1)`` calls it. ``--copy-first DIR``: rank 0 copies the first checkpoint to DIR just
before asking its removal (the second save's call has joined the first save by then, so the copy is the first
checkpoint as published), for a test to compare with stock's.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]
import hf_client_worker as hf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("tokenizer")
    ap.add_argument("--mode", choices=("none", "atomic", "async"), default="none")
    ap.add_argument("--kill-second", action="store_true")
    ap.add_argument("--remove-first", action="store_true")
    ap.add_argument("--copy-first")
    args = ap.parse_args()

    import deepspeed

    rank, world, tokenizer = hf.start_save_job(args.mode, args.tokenizer)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    torch.manual_seed(1234)
    model = hf.make_model({"model": "llama", "tie": True}, len(tokenizer))
    config = hf.ds_config({"stage": 2, "dtype": "bf16"}) | {"train_batch_size": 2 * world}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # what DeepSpeedStrategy.save_checkpoint reads of its strategy (lightning/pytorch/strategies/deepspeed.py)
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    strategy = types.SimpleNamespace(broadcast=lambda obj: obj, zero_stage_3=False, _multi_device=world > 1,
                                     is_global_zero=rank == 0, deepspeed_engine=engine,
                                     exclude_frozen_parameters=False, checkpoint_io=TorchCheckpointIO())
    ids = torch.stack([hf.batch(tokenizer)[rank % 2]] * 2)
    asked = os.path.join(os.path.dirname(os.path.abspath(args.out)), "removal-asked")  # beside OUT, not in it
    if args.kill_second and rank == 1:
        from pyckpt.deepspeed.save import async_save

        write = async_save.write_files

        def killing(files, sources, root, *a, **k):
            if "step=4" in root:
                import signal
                import time

                # with --remove-first, rank 0 asks for the removal of the first checkpoint before this rank dies
                deadline = time.monotonic() + 60
                while args.remove_first and not os.path.exists(asked) and time.monotonic() < deadline:
                    time.sleep(0.05)

                os.kill(os.getpid(), signal.SIGKILL)
            return write(files, sources, root, *a, **k)
        async_save.write_files = killing
    for step in range(1, 5):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if step % 2 == 0:
            checkpoint = {"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.6",
                          "state_dict": {}, "optimizer_states": [], "loops": {"fit_loop": {"step": step}},
                          "callbacks": {}, "lr_schedulers": []}
            DeepSpeedStrategy.save_checkpoint(strategy, checkpoint, os.path.join(args.out, f"epoch=0-step={step}.ckpt"))
            if step == 4 and args.remove_first:  # what ModelCheckpoint(save_top_k=1) does next
                if args.copy_first and rank == 0:
                    import shutil

                    shutil.copytree(os.path.join(args.out, "epoch=0-step=2.ckpt"), args.copy_first)
                DeepSpeedStrategy.remove_checkpoint(strategy, os.path.join(args.out, "epoch=0-step=2.ckpt"))
                print(f"rank {rank}: removal of step 2 asked", flush=True)
                open(asked, "w").close()
    import pyckpt.deepspeed

    pyckpt.deepspeed.wait_for_saves()
    return 0


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main(), exit_handlers=True)
