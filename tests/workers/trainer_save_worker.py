"""A Hugging Face Trainer job under real DeepSpeed on CPU saving every two steps, with or without
``pyckpt.deepspeed.enable(save=MODE)`` (tests/deepspeed/save/test_enable_save.py compares the runs).

    torchrun --nproc_per_node W trainer_save_worker.py OUT TOKENIZER --stage S --mode none|atomic|async
        [--steps N] [--resume] [--slow-write SECONDS] [--kill POINT --kill-step K] [--best first|last]
        [--best-runs DIR] [--extras DIR]

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
``--best-runs DIR``: after that job, the same job with ``--best first`` and with ``--best last``, ``--slow-write 2``,
in the same process, into DIR/first/run and DIR/last/run.
``--extras DIR``: after those, more short ones in the same process (see :func:`_extras`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


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
    ap.add_argument("--extras")
    ap.add_argument("--best-runs")
    args = ap.parse_args()

    rank, _, tokenizer = hf.start_save_job(args.mode, args.tokenizer)
    data = _job(args, rank, tokenizer)
    if args.best_runs:  # before the extras, which leave their own slowed write in place
        for best in ("first", "last"):
            _job(argparse.Namespace(**{**vars(args), "out": os.path.join(args.best_runs, best, "run"), "best": best,
                                       "slow_write": 2.0}), rank, tokenizer)
    if args.extras:
        _extras(args, rank, tokenizer, data)
    return 0


def _job(args, rank: int, tokenizer) -> list:
    """The job of the module doc into args.out; what it patched in this process is put back when it ends (the
    next job here starts from the same code). Returns its training data."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    restore = []
    try:
        if args.slow_write:
            from pyckpt.deepspeed.save import async_save

            write = async_save.write_files
            restore.append((async_save, "write_files", write))

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
            restore.append((SharedCopies, "resolve", resolve))

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
    finally:
        for owner, name, value in reversed(restore):
            setattr(owner, name, value)
    return data


COMBOS = {f"limit{limit}-{metric or 'nometric'}-{'loadbest' if load else 'noload'}": (limit, metric, load)
          for limit in (1, 2) for metric in ("loss", None) for load in (True, False)}


def _extras(args, rank: int, tokenizer, data) -> None:
    """Short jobs (4 steps, a save every 2) after the main one, each a new Trainer in this process, into
    DIR (rank 0 writes DIR/result.json; every rank DIR/on_save_rank<R>.json). Under --mode async the background
    write of DeepSpeed's files is slowed by 0.5 s, so that a checkpoint is still being written when the
    Trainer's next step, on_save and end of training come.

    * ``callbacks``: a callback whose on_save lists ``checkpoint-<step>/`` (its files and model.safetensors'
      sha256), ``push_to_hub`` with ``hub_strategy="checkpoint"`` and a stand-in for the hub that copies each
      upload into DIR/hub/<n>-<path in repo>/, ``save_total_limit`` None; ``checkpoint-2/notes.txt`` is a
      file of the user's before the job starts.
    * ``combos``: every combination of ``save_total_limit`` 1 or 2, ``metric_for_best_model`` "loss" (the
      greater the better: the first checkpoint is the best) or none, ``load_best_model_at_end`` or not:
      the checkpoints left after ``train()``.
    * ``file`` (not under --mode none): a file ``checkpoint-2`` of the user's: what each rank raised.
    """
    import concurrent.futures
    import fnmatch
    import hashlib
    import shutil

    import transformers.trainer as trainer_module
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if args.mode == "async":
        from pyckpt.deepspeed.save import async_save

        write = async_save.write_files

        def slow(*a, **k):
            time.sleep(0.5)
            return write(*a, **k)
        async_save.write_files = slow
    out = args.extras
    hub = os.path.join(out, "hub")
    uploads = []

    class Hub:  # the hub stand-in: each upload a copy of the folder as it is at the call
        def create_repo(self, name, **kw):
            return type("Repo", (), {"repo_id": f"stand-in/{os.path.basename(name)}"})()

        def upload_folder(self, repo_id, folder_path, path_in_repo=None, ignore_patterns=(), **kw):
            into = os.path.join(hub, f"{len(uploads)}-{path_in_repo or 'root'}")
            for dirpath, _, filenames in os.walk(folder_path):
                for name in filenames:
                    rel = os.path.relpath(os.path.join(dirpath, name), folder_path)
                    if not any(fnmatch.fnmatchcase(rel, p) for p in ignore_patterns or ()):
                        os.makedirs(os.path.join(into, os.path.dirname(rel)), exist_ok=True)
                        shutil.copy(os.path.join(dirpath, name), os.path.join(into, rel))
            uploads.append(os.path.basename(into))
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
    trainer_module.hf_api = lambda: Hub()

    def job(name, **options):
        model = hf.make_model({"model": "llama", "tie": True}, len(tokenizer))
        ds = hf.ds_config({"stage": 2, "dtype": "bf16"})
        ds.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
        callbacks = options.pop("callbacks", [])
        evaluate = options.get("metric_for_best_model") or options.get("load_best_model_at_end")
        targs = TrainingArguments(output_dir=os.path.join(out, name, "run"), deepspeed=ds,
                                  per_device_train_batch_size=2, max_steps=4, save_strategy="steps", save_steps=2,
                                  logging_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True, seed=1234,
                                  bf16=True, disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=1,
                                  **({"eval_strategy": "steps", "eval_steps": 2} if evaluate else {}), **options)
        return Trainer(model=model, args=targs, train_dataset=data, processing_class=tokenizer, callbacks=callbacks,
                       eval_dataset=data[:2] if evaluate else None)

    seen = []

    class Reader(TrainerCallback):
        def on_save(self, a, state, control, **kw):
            folder = os.path.join(a.output_dir, f"checkpoint-{state.global_step}")
            listed = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
            weights = os.path.join(folder, "model.safetensors")
            digest = hashlib.sha256(open(weights, "rb").read()).hexdigest() if os.path.isfile(weights) else None
            seen.append({"step": state.global_step, "files": listed, "model": digest})

    result = {}
    if rank == 0:
        os.makedirs(os.path.join(out, "callbacks", "run", "checkpoint-2"))
        with open(os.path.join(out, "callbacks", "run", "checkpoint-2", "notes.txt"), "w") as f:
            f.write("the user's")
    torch.distributed.barrier()
    job("callbacks", callbacks=[Reader()], push_to_hub=True, hub_strategy="checkpoint").train()
    result["uploads"] = uploads
    with open(os.path.join(out, f"on_save_rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    result["combos"] = {}
    for name, (limit, metric, load) in COMBOS.items():
        trainer = job(name, save_total_limit=limit, metric_for_best_model=metric, load_best_model_at_end=load,
                      **({"greater_is_better": True} if metric else {}))
        trainer.train()
        run = trainer.args.output_dir
        result["combos"][name] = sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))
    if args.mode != "none":
        run = os.path.join(out, "file", "run")
        if rank == 0:
            os.makedirs(run)
            with open(os.path.join(run, "checkpoint-2"), "w") as f:
                f.write("the user's")
        torch.distributed.barrier()
        try:
            job("file").train()
            raised = None
        except Exception as exc:
            raised = [type(exc).__name__, str(exc)]
        with open(os.path.join(out, f"file_rank{rank}.json"), "w") as f:
            json.dump(raised, f)
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


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
