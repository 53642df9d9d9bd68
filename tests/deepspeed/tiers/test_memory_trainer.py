"""The memory tier under the Hugging Face Trainer (tests/workers/memory_trainer_worker.py, real libraries on CPU):
pyckpt.deepspeed.MemoryCheckpoints saves to memory every 2nd step while the Trainer saves checkpoint-4
itself; a rank SIGKILLed after step 6's memory save, torchrun's restart resumes with
``trainer.train(resume_from_checkpoint=pyckpt.deepspeed.resume_point(out, tier))``: at step 6 from
memory, not at checkpoint-4, and the steps after it compute the losses of an uninterrupted run, bit for
bit (which also holds the learning rate: the schedule is linear). Without DeepSpeed: the Trainer's folder
resume_point builds from a memory checkpoint's client_state, the refusals, and the one recovery."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from memory_shares import claim, describe

import pyckpt.deepspeed as pd
from pyckpt.deepspeed.integrations import trainer_memory as mt
from pyckpt.deepspeed.load.memory_recovery import recover
from pyckpt.errors import CheckpointFormatError

WORKER = Path(__file__).resolve().parents[2] / "workers" / "memory_trainer_worker.py"
TIMEOUT_S = 300


@pytest.mark.slow
@pytest.mark.parametrize("trainer_optimizer", [False, True], ids=["deepspeed-optimizer", "trainer-optimizer"])
def test_a_trainer_killed_after_a_memory_save_resumes_that_step_from_memory(tmp_path, ds_environ, trainer_optimizer):
    """trainer-optimizer: the Trainer's own AdamW and scheduler (no optimizer in the DeepSpeed config), so
    the scheduler is the Trainer's to save (scheduler.pt), which the memory checkpoint carries too."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"root": str(tmp_path), "kill_at": 6, "trainer_optimizer": trainer_optimizer}))
    env = {**ds_environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYCKPT_JOB_ID", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.5", str(WORKER), str(job)],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["restart"] == 1
    # the Trainer's own newest checkpoint is step 4; memory's is step 6, and it wins
    node = tmp_path / "mem" / "trainer" / "node0"
    assert res["resume_point"] == str(node / "restore" / "checkpoint-6")
    assembled = res["assembled"]
    assert assembled["listing"] == ["global_step6", "latest"] + ["scheduler.pt"] * trainer_optimizer + [
        "trainer_state.json"]
    assert assembled["latest"] == "global_step6" and assembled["hard_linked"] is True
    assert assembled["state"]["global_step"] == 6 and assembled["state"]["max_steps"] == 8
    # one recovery, in resume_point: the engine's load of the assembled folder under
    # enable(memory=tier) reads it as it is
    (line, ) = [m for m in res["log"] if "from memory" in m]
    assert line.startswith("pyckpt: resuming step 6 from memory (") and "newer than step 4 in" in line, line
    assert line.rstrip().endswith("checkpoint-4"), line
    # at the start of training the callback readied the tier for the first save: the resumed job mapped the files
    # of step 4's share (its next save writes over them), the fresh reference job made a free slot
    assert res["prepared"] == ["mapped", "made"]
    # training went on from step 6: steps 7 and 8 only, the Trainer and DeepSpeed at step 8 at the end
    assert res["global_step"] == 8 and res["engine_steps"] == 8
    for rank, (resumed, reference) in enumerate(zip(res["crash_losses"], res["ref_losses"])):
        assert [step for step, _ in resumed] == [7, 8], (rank, resumed)
        assert [step for step, _ in reference] == list(range(1, 9))
        assert resumed == [e for e in reference if e[0] > 6], (rank, resumed, reference)


# -- without DeepSpeed ----------------------------------------------------------------------------

PARAMS = OrderedDict([("layer.weight", (4, 3)), ("layer.bias", (4, ))])
SCHEDULER = {"base_lrs": [0.01], "last_epoch": 6, "_step_count": 7, "_last_lr": [0.004], "lr_lambdas": [{}],
             "_get_lr_called_within_step": False}


def trainer_state(step: int) -> str:
    return json.dumps({"global_step": step, "max_steps": 8, "log_history": []}, indent=2, sort_keys=True) + "\n"


def tag_folder(parent: Path, tag: str, step: int, **client_state) -> Path:
    """A DeepSpeed ZeRO-2 tag folder (its model-state file as DeepSpeed 0.19.8 writes it, with
    ``client_state`` merged in, and a shard)."""
    folder = parent / tag
    folder.mkdir(parents=True)
    state = {"module": OrderedDict((n, torch.zeros(s)) for n, s in PARAMS.items()),
             "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in PARAMS.items())],
             "frozen_param_shapes": None, "buffer_names": [], "global_steps": step, "global_samples": step * 4,
             "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 1, "ds_version": "0.19.8", "ds_config": {},
             **client_state}
    torch.save(state, folder / "mp_rank_00_model_states.pt")
    (folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"shard")
    return folder


def trainer_checkpoint(out: Path, step: int) -> Path:
    """The Trainer's own checkpoint-<step>: DeepSpeed's files and latest inside."""
    folder = out / f"checkpoint-{step}"
    tag_folder(folder, f"global_step{step}", step)
    (folder / "latest").write_text(f"global_step{step}")
    (folder / "trainer_state.json").write_text(trainer_state(step))
    return folder


def memory_checkpoint(tier, step: int, out: Path, **client_state) -> Path:
    """A memory checkpoint of one node and rank, published as a memory save into ``out`` (the Trainer's
    output_dir, the callback's save dir) publishes it."""
    claim(tier.root, tier.job_name, out)
    node = Path(tier.folder())
    tag = f"global_step{step}"
    folder = tag_folder(node, tag, step, **client_state)
    describe(folder, save=f"save-{step}", job=tier.job_name, step=step, save_dir=out)
    (node / "latest").write_text(tag)
    return folder


@pytest.fixture
def alone(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "PYCKPT_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


def test_resume_point_builds_a_trainer_checkpoint_from_the_newer_memory_one(tmp_path, alone, caplog):
    tier = pd.MemoryTier(root=str(tmp_path / "mem"), job="j")
    out = tmp_path / "out"
    trainer_checkpoint(out, 4)
    source = memory_checkpoint(tier, 6, out, hf_trainer_state=trainer_state(6), hf_lr_scheduler=SCHEDULER)
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        point = pd.resume_point(out, tier)
    restore = Path(tier.folder()) / "restore"
    assert point == str(restore / "checkpoint-6")
    assert sorted(os.listdir(point)) == ["global_step6", "latest", "scheduler.pt", "trainer_state.json"]
    assert (restore / "checkpoint-6" / "latest").read_text() == "global_step6"
    assert (restore / "checkpoint-6" / "trainer_state.json").read_text() == trainer_state(6)
    assert torch.load(restore / "checkpoint-6" / "scheduler.pt", weights_only=True) == SCHEDULER
    files = sorted(os.listdir(restore / "checkpoint-6" / "global_step6"))
    assert files == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
    for name in files:  # links to the memory tier's files, no second copy
        assert os.path.samefile(restore / "checkpoint-6" / "global_step6" / name, source / name)
    (line, ) = caplog.messages
    assert line.startswith("pyckpt: resuming step 6 from memory") and line.endswith(f"newer than step 4 in {out}"
                                                                                     "/checkpoint-4"), line
    # the engine's load of that folder (under enable(memory=tier)) reads it as it is: no second recovery
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        assert recover(tier, point) is None
        assert recover(tier, str(restore / "checkpoint-6" / ".." / "checkpoint-6")) is None
    assert caplog.messages == []
    # anywhere else, it recovers as before: the checkpoints of the job saving to out, not to another folder
    assert recover(tier, str(out / "checkpoint-4"), save_dir=str(out)) == (str(restore), "global_step6")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pyckpt"):  # the Trainer's own load of its checkpoint-4
        assert recover(tier, str(out / "checkpoint-4")) is None
    assert caplog.messages == []  # a folder inside the job's save dir: nothing said of another job


def test_resume_point_takes_the_trainers_own_checkpoint_when_it_is_newer_or_memory_is_empty(tmp_path, alone):
    tier = pd.MemoryTier(root=str(tmp_path / "mem"), job="j")
    out = tmp_path / "out"
    assert pd.resume_point(out, tier) is None  # nothing anywhere: a fresh start
    assert not os.path.exists(tmp_path / "mem" / "j")  # and nothing made in memory by looking
    trainer_checkpoint(out, 4)
    assert pd.resume_point(out, tier) == str(out / "checkpoint-4")
    memory_checkpoint(tier, 6, out, hf_trainer_state=trainer_state(6))
    trainer_checkpoint(out, 8)
    assert pd.resume_point(out, tier) == str(out / "checkpoint-8")
    assert not os.path.exists(Path(tier.folder()) / "restore")


def test_a_memory_checkpoint_without_the_trainers_state_stops_the_resume(tmp_path, alone):
    tier = pd.MemoryTier(root=str(tmp_path / "mem"), job="j")
    memory_checkpoint(tier, 6, tmp_path / "out")  # saved by pyckpt.deepspeed.save_checkpoint, not by the callback
    with pytest.raises(pd.RankLoadError, match="not saved by pyckpt.deepspeed.MemoryCheckpoints"):
        pd.resume_point(tmp_path / "out", tier)
    assert not os.path.exists(Path(tier.folder()) / "restore" / "checkpoint-6")


@pytest.mark.parametrize("client_state, message", [
    ({"hf_trainer_state": "{not json"}, "the Trainer state is not JSON"),
    ({"hf_trainer_state": json.dumps({"global_step": True})}, "records no global_step"),
    ({"hf_trainer_state": trainer_state(6), "hf_lr_scheduler": {"lr": torch.ones(2)}}, "holds more than numbers"),
])
def test_a_damaged_trainer_record_is_refused_naming_it(tmp_path, client_state, message):
    restore = tmp_path / "restore"
    tag_folder(restore, "global_step6", 6, **client_state)
    with pytest.raises(CheckpointFormatError, match=message):
        mt._trainer_folder(str(restore), "global_step6")
    assert sorted(os.listdir(restore)) == ["global_step6"]


def test_resume_point_outside_torch_distributed_in_a_launch_of_several_is_refused(tmp_path, alone, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="after creating the TrainingArguments"):
        pd.resume_point(tmp_path / "out", pd.MemoryTier(root=str(tmp_path / "mem"), job="j"))


def test_the_callback_refuses_a_trainer_without_deepspeed():
    tier = pd.MemoryTier(root="/nonexistent", job="j")
    with pytest.raises(ValueError, match="does not run DeepSpeed"):
        pd.MemoryCheckpoints(SimpleNamespace(is_deepspeed_enabled=False), tier, every=2)
    with pytest.raises(TypeError, match="MemoryTier"):
        pd.MemoryCheckpoints(SimpleNamespace(is_deepspeed_enabled=True), "/dev/shm", every=2)
    with pytest.raises(ValueError, match="every"):
        pd.MemoryCheckpoints(SimpleNamespace(is_deepspeed_enabled=True), tier, every=0)
    from transformers import TrainerCallback

    assert issubclass(pd.MemoryCheckpoints, TrainerCallback) and pd.MemoryCheckpoints is mt.MemoryCheckpoints


def test_importing_pyckpt_deepspeed_does_not_import_transformers():
    code = ("import sys; import pyckpt.deepspeed; from pyckpt.deepspeed import *; "
            "assert 'transformers' not in sys.modules, 'imported'; assert callable(resume_point)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd="/")  # the installed package
