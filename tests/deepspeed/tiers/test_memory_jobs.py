"""Whose a memory checkpoint is (pyckpt.deepspeed.tiers.job_identity), without DeepSpeed: two jobs on one
memory root that name no job id of their own (plain python, the deepspeed launcher, srun: "default";
torchrun without --rdzv-id: "none") get a folder each, named after their save dirs, in whichever order
they come; a job resumes only its own step, its normal end copies only its own checkpoint into its own
save dir and removes only its own folder; two jobs given one id are told so and never take each other's
checkpoints. tests/deepspeed/tiers/test_memory_tier.py runs the same two jobs with DeepSpeed under torchrun."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from logged import pyckpt_warnings
from memory_shares import claim, describe, model_states

import pyckpt.deepspeed as pd
from pyckpt.deepspeed.load.memory_recovery import recover
from pyckpt.deepspeed.save import memory_save
from pyckpt.deepspeed.tiers import job_identity as ji
from pyckpt.deepspeed.tiers import memory_root as mr
from pyckpt.deepspeed.tiers.links import forget_all
from pyckpt.errors import MemoryRootError

RUNS = {"A": "a" * 32, "B": "b" * 32}
LAUNCHES = {"plain-python": {}, "torchrun-without-rdzv-id": {ji.ENV_RUN_ID: "none"}}


@pytest.fixture
def launch(request, monkeypatch):
    for name in (ji.ENV_JOB, ji.ENV_RUN_ID, mr.ENV_ROOT, "RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in LAUNCHES[request.param].items():
        monkeypatch.setenv(name, value)
    yield request.param
    forget_all()


def test_a_job_without_an_id_of_its_own_gets_a_folder_named_after_its_save_dir(tmp_path, monkeypatch):
    for name in (ji.ENV_JOB, ji.ENV_RUN_ID):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link-to-a")
    a = ji.identify(None, tmp_path / "a")
    assert a.derived and a.job.startswith("default-") and len(a.job) == len("default-") + 16
    assert a.save_dir == os.path.realpath(tmp_path / "a")
    assert ji.identify(None, tmp_path / "link-to-a") == a  # the real path: one job, however it is spelled
    assert ji.identify(None, tmp_path / "b").job != a.job
    mr.node_memory_folder(str(tmp_path / "root"), a.job, 0)  # one folder name, as the root's rules want it
    monkeypatch.setenv(ji.ENV_RUN_ID, "none")  # torchrun without --rdzv-id: every such job has it
    assert ji.identify(None, tmp_path / "a").job == "none-" + a.job.split("-")[1]
    monkeypatch.setenv(ji.ENV_RUN_ID, "3f2a-elastic")  # torchrun --standalone or --rdzv-id: the job's own
    assert ji.identify(None, tmp_path / "a") == ji.Identity("3f2a-elastic", a.save_dir, False)
    monkeypatch.setenv(ji.ENV_JOB, "mine")
    assert ji.identify(None, tmp_path / "a").job == "mine" and ji.identify("given", tmp_path / "a").job == "given"


def _job(tmp_path, name: str, step: int, tier) -> dict:
    """Job ``name``'s memory as it is after a crash: its folder recorded as its run's, its step there
    (a model-state file recording it, as a save writes it), nothing in its save dir yet."""
    save_dir = tmp_path / f"save-{name}"
    save_dir.mkdir()
    bound, identity = ji.bound(tier, save_dir)
    claim(tmp_path / "mem", identity.job, save_dir, RUNS[name])
    tag = bound.folder() + f"/s{step}"
    os.mkdir(tag)
    model_states(os.path.join(tag, "mp_rank_00_model_states.pt"), step)
    describe(tag, save=f"save-{name}-{step}", job=identity.job, step=step, run=RUNS[name], save_dir=save_dir)
    return {"save_dir": save_dir, "identity": identity, "tier": bound, "tag": tag}


@pytest.mark.parametrize("launch", list(LAUNCHES), indirect=True)
@pytest.mark.parametrize("first", ["A", "B"])
def test_two_jobs_without_an_id_on_one_root_never_take_each_other_s_checkpoints(tmp_path, launch, first):
    """Job A (step 3) and job B (step 5), same model, same root, both left as after a crash: A's restart
    resumes its own step 3, not B's newer 5; A's normal end copies its step 3 into its own save dir and
    removes its own folder; B's folder and checkpoint stay whole and B then resumes its step 5."""
    tier = pd.MemoryTier(root=str(tmp_path / "mem"))
    order = [first, "B" if first == "A" else "A"]
    jobs = {name: _job(tmp_path, name, {"A": 3, "B": 5}[name], tier) for name in order}
    a, b = jobs["A"], jobs["B"]
    assert a["identity"].job != b["identity"].job
    assert a["identity"].job.startswith("default-" if launch == "plain-python" else "none-")

    lines = pyckpt_warnings()
    assert recover(tier, str(a["save_dir"])) == (os.path.join(a["tier"].folder(), "restore"), "s3")
    (line, ) = lines
    assert line.startswith("pyckpt: resuming step 3 from memory"), line

    # A's normal end, as the exit handler runs it for the job's node leader
    store = dist.HashStore()
    links = SimpleNamespace(node=0, count=1, sender=None)
    memory_save._AT_EXIT.clear()
    memory_save._AT_EXIT[a["tier"].folder()] = (a["tier"], links, str(a["save_dir"]), False, store, a["identity"],
                                                RUNS["A"])
    memory_save._leave()
    assert sorted(os.listdir(a["save_dir"])) == ["latest", "s3"] and (a["save_dir"] / "latest").read_text() == "s3"
    assert sorted(os.listdir(tmp_path / "mem")) == [b["identity"].job]  # A's folder gone, B's whole
    assert os.listdir(b["save_dir"]) == [] and os.path.isfile(os.path.join(b["tag"], "mp_rank_00_model_states.pt"))
    assert recover(tier, str(b["save_dir"])) == (os.path.join(b["tier"].folder(), "restore"), "s5")


def test_two_jobs_given_one_id_are_told_so_and_never_take_each_other_s_checkpoints(tmp_path, monkeypatch):
    for name in (ji.ENV_RUN_ID, mr.ENV_ROOT):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ji.ENV_JOB, "shared")
    tier = pd.MemoryTier(root=str(tmp_path / "mem"))
    b = _job(tmp_path, "B", 5, tier)
    save_a = tmp_path / "save-A"
    save_a.mkdir()
    lines = pyckpt_warnings()
    assert recover(tier, str(save_a)) is None
    (line, ) = lines
    assert line.startswith(f"pyckpt: resuming from {save_a}, not from memory: ") and "two jobs were given the job " \
        "id 'shared'" in line and str(b["save_dir"]) in line, line
    _, a = ji.bound(tier, save_a)
    with pytest.raises(MemoryRootError, match="holds the memory checkpoints of the job saving to"):
        ji.claim(str(tmp_path / "mem"), a, RUNS["A"])  # the save's own record step refuses it
    assert ji.read_record(str(tmp_path / "mem"), "shared") == ji.JobRecord(RUNS["B"], str(b["save_dir"]))
    forget_all()


def test_the_exit_leaves_a_folder_whose_record_is_not_its_run_s(tmp_path, monkeypatch):
    """The exit copy and removal take only the run's own: once the folder's record names another run (it
    was removed and made again meanwhile), nothing is persisted from it nor removed."""
    for name in (ji.ENV_JOB, ji.ENV_RUN_ID, mr.ENV_ROOT):
        monkeypatch.delenv(name, raising=False)
    tier = pd.MemoryTier(root=str(tmp_path / "mem"))
    b = _job(tmp_path, "B", 5, tier)
    lines = pyckpt_warnings()
    memory_save._AT_EXIT.clear()
    memory_save._AT_EXIT[b["tier"].folder()] = (b["tier"], SimpleNamespace(node=0, count=1, sender=None),
                                                str(b["save_dir"]), False, dist.HashStore(), b["identity"], "c" * 32)
    memory_save._leave()
    assert os.listdir(b["save_dir"]) == [] and os.path.isdir(b["tag"])
    (line, ) = lines
    assert "stays at" in line and "names another run or save dir" in line, line
    forget_all()


def test_a_damaged_job_record_takes_nothing_from_the_folder_and_says_so(tmp_path, monkeypatch):
    for name in (ji.ENV_JOB, ji.ENV_RUN_ID, mr.ENV_ROOT):
        monkeypatch.delenv(name, raising=False)
    tier = pd.MemoryTier(root=str(tmp_path / "mem"))
    b = _job(tmp_path, "B", 5, tier)
    record = tmp_path / "mem" / b["identity"].job / ji.RECORD
    record.write_text('{"pyckpt_job": 1, "run": "%s", "save_dir": "relative"}' % RUNS["B"])
    lines = pyckpt_warnings()
    assert recover(tier, str(b["save_dir"])) is None
    (line, ) = lines
    assert "its save_dir 'relative' is not an absolute path" in line and "pyckpt clean --memory" in line, line
    record.unlink()
    os.symlink(tmp_path / "elsewhere", record)
    with pytest.raises(MemoryRootError, match="the job's record cannot be read \\(a symbolic link\\)"):
        ji.read_record(str(tmp_path / "mem"), b["identity"].job)
    forget_all()
