"""A Hugging Face Trainer job under real DeepSpeed on CPU saving every two steps, with or without
``pyckpt.deepspeed.enable(save=MODE)`` (tests/deepspeed/save/test_enable_save.py compares the runs).

    torchrun --nproc_per_node W trainer_save_worker.py OUT TOKENIZER --stage S --mode none|atomic|async
        [--steps N] [--resume] [--slow-write SECONDS] [--kill POINT --kill-step K] [--best first|last]

A LlamaForCausalLM with tied embeddings in bf16 (DeepSpeed's mixed precision), ``save_steps=2``,
``save_total_limit=2``, a linear schedule. ``--resume`` continues OUT's run from
``resume_from_checkpoint=True`` (what ``get_last_checkpoint`` finds) for two more steps. ``--slow-write``
delays every file DeepSpeed writes in the background, and the Trainer's model files, by that long (async
mode: both are written in the background), so that the steps after a save run while they are written. ``--best`` evaluates at every save and loads the best checkpoint at the end (_best_args).
``--kill POINT --kill-step K`` SIGKILLs one rank in the save of step K:
``snapshot`` (rank 1, inside DeepSpeed's save, its first file), ``write`` (rank 1, as its background write
starts), ``trainer-files`` (rank 1, writing its RNG state), ``model-files`` (rank 0, as it writes the
Trainer's model files: in the background under async), ``rotation`` (rank 0, as the rotation starts).
Rank 0 writes OUT/result.json: the losses by step, the global step, the
time each save call took, for each step when it started and, with ``--slow-write``, when each checkpoint's
model files were written (to show the steps going on during a write), and how many storages of each
asynchronous save's model clones (the Trainer's, for model.safetensors) were filled from DeepSpeed's snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(TESTS, "dsharness"), os.path.join(TESTS, "helpers"), TESTS]
import hf_client_worker as hf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("tokenizer")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--mode", choices=("none", "atomic", "async"), default="none")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--slow-write", type=float, default=0.0)
    ap.add_argument("--kill", choices=("snapshot", "write", "trainer-files", "model-files", "rotation"))
    ap.add_argument("--kill-step", type=int, default=4)
    ap.add_argument("--best", choices=("first", "last"))
    args = ap.parse_args()

    rank, _, tokenizer = hf.start_save_job(args.mode, args.tokenizer)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if args.slow_write:
        from pyckpt.deepspeed.save import async_save

        write = async_save.write_files

        def slow(*a, **k):  # the background write starts late: the steps after the save run meanwhile
            time.sleep(args.slow_write)
            return write(*a, **k)
        async_save.write_files = slow

    model = hf.make_model({"model": "llama", "tie": True}, len(tokenizer))
    ds = hf.ds_config({"stage": args.stage, "dtype": "bf16"})
    ds.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    targs = TrainingArguments(output_dir=args.out, deepspeed=ds, per_device_train_batch_size=2,
                              max_steps=args.steps + (2 if args.resume else 0), save_strategy="steps", save_steps=2,
                              save_total_limit=2, logging_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True,
                              seed=1234, bf16=True, disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=1,
                              **_best_args(args.best))
    ids = hf.batch(tokenizer)
    data = [{"input_ids": row, "labels": row} for _ in range(8) for row in ids]
    starts, saves, model_written, filled_from_snapshot = {}, [], {}, []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            starts[state.global_step + 1] = time.time()

    trainer = Trainer(model=model, args=targs, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()],
                      eval_dataset=data[:2] if args.best else None)
    if args.mode == "async":
        from pyckpt.deepspeed.save.shared_copies import SharedCopies

        resolve = SharedCopies.resolve

        def counted(self):
            fill = resolve(self)
            filled_from_snapshot.append(self.from_snapshot)
            return fill
        SharedCopies.resolve = counted
    if args.slow_write:
        model_files = trainer._save

        def slow_model_files(output_dir, *a, **k):
            time.sleep(args.slow_write)
            model_files(output_dir, *a, **k)
            model_written[os.path.basename(output_dir)] = time.time()
        trainer._save = slow_model_files
    if args.kill:
        _arm(args.kill, args.kill_step, trainer, rank)
    save = trainer._save_checkpoint

    def timed(model, trial):
        t0 = time.time()
        save(model, trial)
        saves.append((trainer.state.global_step, t0, time.time()))
    trainer._save_checkpoint = timed
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    if rank == 0:
        with open(os.path.join(args.out, "result.json" if not args.resume else "result_resume.json"), "w") as f:
            json.dump({"losses": losses, "global_step": trainer.state.global_step, "saves": saves,
                       "starts": starts, "model_written": model_written,
                       "filled_from_snapshot": filled_from_snapshot,
                       "state_dict_entries": len(trainer.model.state_dict()),
                       "best_model_checkpoint": trainer.state.best_model_checkpoint,
                       "weights": _digest(trainer.model)}, f)
    return 0


def _best_args(best) -> dict:
    """``--best first|last``: evaluate at every save and load the best checkpoint at the end; the loss falls,
    so the best is the first checkpoint (kept by the rotation beside the newest) or the last (loaded at the
    end of train(), possibly while it is being written)."""
    if best is None:
        return {}
    return {"eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True,
            "metric_for_best_model": "loss", "greater_is_better": best == "first"}


def _digest(model) -> dict:
    """Each weight's name -> sha256 of its values as float32 (tests compare them with a checkpoint's files)."""
    import hashlib

    return {name: hashlib.sha256(p.detach().float().contiguous().numpy().tobytes()).hexdigest()
            for name, p in model.state_dict().items()}


def _die() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, step: int, trainer, rank: int) -> None:
    """SIGKILL this rank at ``point`` of the save of ``step`` (see the module doc)."""
    if point == "snapshot" and rank == 1:
        # the files DeepSpeed's save hands its checkpoint engine: pyckpt's snapshot of them (async) or
        # DeepSpeed's own write (stock, atomic)
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        from pyckpt.deepspeed.save.snapshot import CaptureCheckpointEngine

        for engine_cls in (TorchCheckpointEngine, CaptureCheckpointEngine):
            def killing_save(self, state_dict, path, save=engine_cls.save):
                if trainer.state.global_step == step:
                    _die()
                return save(self, state_dict, path)
            engine_cls.save = killing_save
    elif point == "write" and rank == 1:
        from pyckpt.deepspeed.save import async_save

        write = async_save.write_files

        def killing_write(files, sources, root, *a, **k):
            if f"checkpoint-{step}" in root:  # the staging folder of the save of `step`, not an earlier one
                _die()
            return write(files, sources, root, *a, **k)
        async_save.write_files = killing_write
    elif point == "trainer-files" and rank == 1:
        rng = trainer._save_rng_state

        def killing_rng(output_dir):
            if trainer.state.global_step == step:
                _die()
            return rng(output_dir)
        trainer._save_rng_state = killing_rng
    elif point == "model-files" and rank == 0:
        model_files = trainer._save

        def killing_model_files(*a, **k):
            if trainer.state.global_step == step:
                _die()
            return model_files(*a, **k)
        trainer._save = killing_model_files
    elif point == "rotation" and rank == 0:
        import transformers.trainer as module

        rotate = module.rotate_checkpoints

        def killing_rotate(**kwargs):
            if os.path.isdir(os.path.join(kwargs["output_dir"], f"checkpoint-{step}")):  # after its rename
                _die()
            return rotate(**kwargs)
        module.rotate_checkpoints = killing_rotate


if __name__ == "__main__":
    from pyckpt.execution.distributed import leave_and_exit

    leave_and_exit(main(), exit_handlers=True)
