"""The memory tier with real DeepSpeed on CPU (tests/workers/save_glue_worker.py): saves into a node-local
memory folder (DeepSpeed's own files, published by the same rules), the newest `keep` kept there,
every N-th persisted to save_dir in the background, and a resume under enable(memory=...) taking the
newest step across both tiers; a checkpoint that does not fit, or a root that is not safe, goes to
save_dir with one line saying why."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import dsharness as h
from dsharness import _launch

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _mapped_writes(monkeypatch):
    """A memory save writes a file it writes over through a kept mapping from 1 MiB on; these checkpoints'
    files are smaller, so every file written over here takes that path (the production one for real models:
    the files byte-equal to DeepSpeed's own save, the crash cases, the inodes)."""
    monkeypatch.setenv("PYCKPT_MAP_MIN_BYTES", "1")

WORKER = str(Path(__file__).resolve().parents[2] / "workers" / "save_glue_worker.py")
TIMEOUT_S = 300


def _call(function: str, cfg: h.Config, root: Path, **extra) -> dict:
    return {"kind": "call", "module": WORKER, "function": function, "cfg": dataclasses.asdict(cfg),
            "root": str(root), **extra}


def _crash_job(tmp_path, ds_environ, cfg: h.Config, **job) -> None:
    """tests/workers/memory_crash_worker.py under torchrun (2 ranks, --max-restarts 1): six steps saved to memory,
    every third persisted, rank 1 killed at step 4 (``job`` adds to that), the restart resuming."""
    import json
    import subprocess
    import sys

    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"cfg": dataclasses.asdict(cfg), "root": str(tmp_path), "steps": 6, "kill_at": 4,
                                "persist_every": 3, **job}))
    env = {**ds_environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PYCKPT_MAP_MIN_BYTES": "1"}
    env.pop("PYCKPT_JOB_ID", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.5", WORKER.replace("save_glue_worker",
                                                                                               "memory_crash_worker"),
                           str(spec)], capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("cfg", [h.Config(2, "fp32", 2), h.Config(3, "bf16", 2)], ids=["z2-fp32", "z3-bf16"])
def test_memory_saves_persist_and_resume_from_the_newest_tier(tmp_path, cfg):
    (res, ) = _launch(2, [_call("memory_tier", cfg, tmp_path)], None, "memory tier", TIMEOUT_S)
    assert res["results"] == [[True] * 5] * 2
    assert res["mode"] == "0o700"
    # keep=2 in memory; every 2nd persisted, keep_last=1 on disk
    assert res["listing"]["memory"] == ["latest", "s4", "s5", "zero_to_fp32.py", "zero_to_torch.py"]
    assert res["listing"]["durable"] == ["latest", "s4"] and res["latest_durable"] == "s4"
    # the persisted copy is the memory files, less the node manifest pyckpt keeps beside DeepSpeed's
    assert res["persisted"] is True and res["differ"] == ["pyckpt-node.json"]
    # the resume took step 5 from memory (newer than step 4 on disk), equal to DeepSpeed's own load of it
    assert res["path"].endswith("/s5/") or "/s5" in res["path"], res["path"]
    (line, ), none = res["log"]
    assert none == [] and line.startswith("pyckpt: resuming step ") and "from memory" in line
    assert "newer than step" in line
    assert res["vs_stock"] == [] and res["vs_save"] == []
    # read by pyckpt's direct load (each rank's byte ranges of the tmpfs shards), not DeepSpeed's, and
    # equal to DeepSpeed's load beyond the masters and moments too: low-precision weights, loss scaler,
    # lr scheduler, counters and client state. Under ZeRO-1/2 the load filled the low-precision weights
    # from the files in memory, in place of DeepSpeed's all-gather after it (ZeRO-3 has no such gather)
    assert res["loaded_by"] == [["pyckpt", True, cfg.stage != 3]] * 2
    assert res["extras_vs_stock"] == [[], []] and res["client_vs_stock"] == [True, True]
    # the memory files are DeepSpeed's own save of the same step, byte for byte (pyckpt's two files beside)
    assert res["vs_deepspeed"] == ["pyckpt-node.json", "training_state.json"]
    # before training, prepare_memory_tier made the first two saves' slots: each rank its own files, of the
    # exact sizes DeepSpeed's save writes (the model states aside: their client_state differs), mapped by
    # their writer
    first = res["first"]
    assert [f["kind"] for f in first] == ["made", "made"], first
    made, made_next = first[0]["made"], first[0]["made_next"]
    assert made and first[1]["made"] == made and set(made) == set(first[0]["s1"]), (made, first[0]["s1"])
    assert set(made_next) == set(made) and {i for i, _ in made_next.values()}.isdisjoint(i for i, _ in made.values())
    for which, slot in (("mapped", made), ("mapped_next", made_next)):
        assert sorted(set(first[0][which]) | set(first[1][which])) == sorted(i for i, _ in slot.values())
        assert set(first[0][which]).isdisjoint(first[1][which]) and all(f[which] for f in first)
    # the first save wrote over the first slot, the second over the next one: the same inodes
    assert {n: i for n, (i, _) in first[0]["s1"].items()} == {n: i for n, (i, _) in made.items()}
    assert all(first[0]["s1"][n][1] == size for n, (_, size) in made.items() if "optim_states" in n)
    assert res["inodes"][1] == {n: i for n, (i, _) in made_next.items()}
    # keep=2: two slots, written over in turn (s3 over s1's files, s4 over s2's, s5 over s3's)
    ino = res["inodes"]
    assert ino[0] and ino[1] and set(ino[0].values()).isdisjoint(ino[1].values())
    assert ino[2] == ino[0] and ino[3] == ino[1] and ino[4] == ino[0]
    # the second save wrote over the next slot, the free slot once the first save was published
    assert res["ahead"] == ino[1], (res["ahead"], ino[1])
    # and the third save's (s1's files): each rank mapped the files it writes, before that save, in the background
    premapped = res["premapped"]
    assert all(premapped) and set(premapped[0]).isdisjoint(premapped[1]), premapped
    assert set(premapped[0]) | set(premapped[1]) == set(ino[0].values()), (premapped, ino[0])
    # and written over through kept mappings (PYCKPT_MAP_MIN_BYTES=1 here): each rank's files of the last two
    # saves, its optimizer states and, on rank 0, the model states (ZeRO-3: every rank's)
    assert all(n >= 2 for n in res["mapped"]) and res["mapped"][0] >= 4, res["mapped"]


def test_preparing_the_tier_refuses_what_a_save_would_and_a_normal_end_removes_an_unused_slot(tmp_path):
    (res, ) = _launch(2, [_call("memory_prepare_cases", h.Config(2, "fp32", 2), tmp_path)], None,
                      "memory tier preparation", TIMEOUT_S)
    # a budget the first save's files exceed, and a job folder of another save dir's job: nothing made there
    assert res["kinds"] == [[None, None, None, None, "made", "made"]] * 2
    assert res["hostile_listing"] == []  # a root writable by others: nothing made inside it
    # called before the first training step (the optimizer's state may not exist yet): nothing made, one line why
    assert res["early_made"] is False
    assert res["small_listing"] == ["node0"] and res["foreign_listing"] == res["foreign_before"]
    assert "s1" in res["foreign_before"]
    (early, hostile, small, foreign), none = res["said"]
    assert "before the first training step" in early and "nothing was prepared" in early, early
    assert "not prepared" in hostile and "writable by" in hostile, hostile
    assert none == [] and "limit" in small and "two jobs were given the job id 'j'" in foreign, res["said"]
    # the slot made for a first save that never came is removed at a normal end, with the folders it leaves empty
    assert res["unused_listing"] == ["node0"] and "c" not in res["after_exit"] and "j" in res["after_exit"]
    assert "one" not in res["after_exit"]
    # two slots where they fit the budget (the first two saves'), one where only one does
    assert res["both"] == [".pyckpt-slot", ".pyckpt-slot-next"] and res["one_listing"] == [".pyckpt-slot"]


def test_what_does_not_fit_or_is_not_safe_goes_to_save_dir_with_one_line(tmp_path):
    (res, ) = _launch(2, [_call("memory_refusals", h.Config(2, "fp32", 2), tmp_path)], None, "memory refusals",
                      TIMEOUT_S)
    assert res["ok"] == [[True, True]] * 2
    full, hostile = res["warned"][0]
    assert res["warned"][1] == []
    assert full.startswith("pyckpt: checkpoint full goes to ") and "not to memory" in full and "limit" in full
    assert hostile.startswith("pyckpt: checkpoint hostile goes to ") and "writable by" in hostile
    assert res["durable"] == ["full", "hostile", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    assert [f for f in res["mem_files"] if "full" in f or "hostile" in f] == []
    assert res["open_listing"] == []  # nothing made inside a root that others can write
    # asynchronous memory saves back to back: each whole when its call returns; keep=1 kept b2, and b1's
    # files (the same inodes) wait in the free slot for the next save to write over
    assert res["back_to_back"] == [[True, True]] * 2 and res["first_done"] is True
    assert res["mem2"] == [".pyckpt-slot", "b2", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    assert res["b1_in_slot"] is True


@pytest.mark.parametrize("cfg", [h.Config(2, "fp32", 2), h.Config(3, "bf16", 2)], ids=["z2-fp32", "z3-bf16"])
def test_a_rank_killed_mid_run_resumes_from_memory_when_torchrun_restarts_it(tmp_path, ds_environ, cfg):
    """A job saving to memory after every step (every 3rd persisted) loses rank 1 to SIGKILL after step
    4's save is published; torchrun restarts the workers (--max-restarts 1), and engine.load_checkpoint
    (save_dir) under enable(memory=...) resumes step 4 from memory, not the older step 3 on disk, equal
    bit for bit to DeepSpeed's own load of that checkpoint; the restarted job, saving nothing more and
    ending normally, persists step 4 to save_dir and removes its memory folder."""

    import torch

    _crash_job(tmp_path, ds_environ, cfg)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)  # the test's own file
    assert resumed["restart"] == 1 and resumed["global_steps"] == 4
    (line, ) = resumed["log"]
    assert line.startswith("pyckpt: resuming step 4 from memory (") and "newer than step 3" in line, line
    # prepare_memory_tier after the resume: the tier holds s3 and s4 (keep=2), so the next save writes over
    # s3's files, and each rank mapped its own of them then, before training went on
    prepared = resumed["prepared"]
    mapped = prepared["mapped"]
    assert prepared["kind"] == "mapped" and all(mapped) and set(mapped[0]).isdisjoint(mapped[1]), prepared
    assert all(name.startswith("s3/") and name.endswith(".pt") for name in mapped[0] + mapped[1]), mapped
    assert any("model_states" in name for name in mapped[0]), mapped
    # the restarted job saved nothing and ended normally: what it resumed is persisted, its memory gone,
    # and that copy is the state it resumed, by DeepSpeed's own load of it
    durable = tmp_path / "durable"
    assert (durable / "latest").read_text() == "s4" and not (tmp_path / "mem" / "crash").exists()
    (res, ) = _launch(2, [_call("stock_equals", cfg, durable, tag="s4", resumed=str(tmp_path / "resumed.pt"))],
                      None, "stock load of the persisted memory checkpoint", TIMEOUT_S)
    assert res["global_steps"] == 4 and res["problems"] == []


def test_a_rank_killed_while_its_memory_save_is_written_resumes_the_step_before(tmp_path, ds_environ):
    """Rank 1 is SIGKILLed while its files of step 4 are being written into the memory tier's staging
    folder (rank 0's are written, the step is not published): the restart resumes step 3 (in memory
    and on disk alike: memory is read), equal to DeepSpeed's own load of it, and the next save clears
    what the killed one left in memory."""

    import torch

    cfg = h.Config(3, "bf16", 2)
    _crash_job(tmp_path, ds_environ, cfg, kill_mid_write=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)  # the test's own file
    assert resumed["restart"] == 1 and resumed["global_steps"] == 3
    (line, ) = resumed["log"]
    assert line.startswith("pyckpt: resuming step 3 from memory (") and "the same step as in" in line, line
    # the step saved after the resume took the killed save's tag: nothing hidden is left beside it
    assert resumed["after_save"] == ["latest", "s3", "s4", "zero_to_fp32.py", "zero_to_torch.py"]
    memory = tmp_path / "mem" / "crash" / "node0"
    (res, ) = _launch(2, [_call("stock_equals", cfg, tmp_path / "durable", tag="s3",
                                resumed=str(tmp_path / "resumed.pt"))], None, "stock load of step 3", TIMEOUT_S)
    assert res["global_steps"] == 3 and res["problems"] == []
    # the restart saved step 4 and ended normally: step 4 persisted, the memory folder gone
    assert not memory.exists() and (tmp_path / "durable" / "latest").read_text() == "s4"


def test_a_job_that_ends_normally_leaves_its_newest_checkpoint_on_disk_and_nothing_in_memory(tmp_path, ds_environ):
    """Five steps saved to memory (every 3rd persisted) and a normal end: at exit rank 0 persists step 5
    (save_dir held step 3) and removes the job's memory folder; save_dir's latest then loads as DeepSpeed's
    own checkpoint of step 5. Under torchrun without --rdzv-id (every such job's run id is "none") and
    without $PYCKPT_JOB_ID, beside another such job that saved step 7 of the same model to the same root and
    crashed: this job's first load resumes nothing of the other's, its end copies only its own step into
    its own save dir and removes only its own folder; the other job's checkpoint stays whole."""
    import json
    import subprocess
    import sys

    from rendezvous import held_rendezvous

    cfg = h.Config(2, "fp32", 2)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cfg": dataclasses.asdict(cfg), "root": str(tmp_path), "steps": 5, "kill_at": None,
                               "persist_every": 3, "job": None, "other_job": {"save_dir": "durable-b", "step": 7}}))
    env = {**ds_environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PYCKPT_MAP_MIN_BYTES": "1"}
    env.pop("PYCKPT_JOB_ID", None)
    with held_rendezvous() as rendezvous:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                               *rendezvous, WORKER.replace("save_glue_worker", "memory_crash_worker"), str(job)],
                              capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = json.loads((tmp_path / "first_load.json").read_text())
    assert first["path"] is None and first["global_steps"] == 0, first  # not the other job's step 7
    assert not [line for line in first["log"] if "from memory" in line], first["log"]
    # this job's folder is gone; the other job's (named after its save dir) is whole, its step 7 in it
    (other, ) = sorted(p.name for p in (tmp_path / "mem").iterdir())
    assert other.startswith("none-"), other
    kept = tmp_path / "mem" / other / "node0"
    assert (kept / "latest").read_text() == "s7" and (kept / "s7" / "mp_rank_00_model_states.pt").is_file()
    assert not (tmp_path / "durable-b").exists() or list((tmp_path / "durable-b").iterdir()) == []
    durable = tmp_path / "durable"
    assert (durable / "latest").read_text() == "s5" and sorted(p.name for p in durable.iterdir()) == ["latest", "s3", "s5"]
    (res, ) = _launch(2, [_call("stock_step", cfg, durable)], None, "stock load of the persisted checkpoint", TIMEOUT_S)
    assert res["global_steps"] == 5 and "/durable/s5/" in res["path"]
