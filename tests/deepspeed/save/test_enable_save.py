"""``pyckpt.deepspeed.enable(save=...)`` under the Hugging Face Trainer with real DeepSpeed on CPU
(tests/workers/trainer_save_worker.py): the same ``checkpoint-N/`` files as a stock run, byte for byte, the same
losses after a resume, training going on during an asynchronous write, and a kill at each point of a save
leaving the previous checkpoint as the one ``resume_from_checkpoint=True`` takes, nothing half-written visible,
the leftovers cleaned by the next run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[2] / "workers" / "trainer_save_worker.py"


def launch(tmp: Path, out: Path, tokenizer: Path, *args, ranks: int = 2, expect_ok: bool = True,
           worker: Path = WORKER) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp / "ext"),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(worker), str(out), str(tokenizer), *map(str, args)]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    else:
        assert proc.returncode != 0, "the run was to be killed"
    return proc.stdout + proc.stderr


def files(run: Path) -> dict:
    """Every file of ``run`` but the worker's own timings: relative path -> bytes; the Trainer's pickled
    TrainingArguments as their fields, less the two that name the run's own folder."""
    out = {}
    for p in sorted(run.rglob("*")):
        if not p.is_file() or p.name.startswith("result"):
            continue
        if p.name == "training_args.bin":
            import torch

            fields = torch.load(p, weights_only=False).to_dict()  # the test's own file: trusted
            out[str(p.relative_to(run))] = {k: v for k, v in fields.items() if k not in ("output_dir", "logging_dir")}
        else:
            out[str(p.relative_to(run))] = p.read_bytes()
    return out


def visible(run: Path) -> list:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))


def hidden(run: Path) -> list:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same Trainer job three ways, each into a folder named alike (the Trainer records its output folder
    in training_args.bin): stock DeepSpeed, enable(save="atomic"), enable(save="async"), ZeRO-2; and ZeRO-3
    stock and async. The ZeRO-2 async run's background writes and model files are slowed by 3 s, so that the
    steps after each save run during its write (test_async_steps_go_on_during_the_write); the same launch then
    runs the job with --best first and --best last (test_the_best_checkpoint_is_kept_...)."""
    root = tmp_path_factory.mktemp("trainer-save")
    tokenizer = root / "tokenizer"
    made = {}
    for stage, modes in ((2, ("none", "atomic", "async")), (3, ("none", "async"))):
        for mode in modes:
            out = root / f"s{stage}-{mode}" / "run"
            # ZeRO-2 stock and async also run the worker's short extra jobs (callbacks, hub push, best-model
            # retention, a file where a checkpoint goes) into <out>/../extras
            extras = ("--extras", out.parent / "extras") if stage == 2 and mode != "atomic" else ()
            # ZeRO-2 async also runs the job with --best first and last into <out>/../best (the best checkpoint)
            slow = ("--slow-write", 3, "--best-runs", out.parent / "best") if (stage, mode) == (2, "async") else ()
            launch(root, out, tokenizer, "--stage", stage, "--mode", mode, *slow, *extras)
            made[(stage, mode)] = out
    return root, tokenizer, made


@pytest.mark.parametrize("stage,mode", [(2, "atomic"), (2, "async"), (3, "async")])
def test_the_checkpoints_are_stock_deepspeeds_byte_for_byte(runs, stage, mode):
    _, _, made = runs
    stock, mine = files(made[(stage, "none")]), files(made[(stage, mode)])
    assert visible(made[(stage, mode)]) == ["checkpoint-4", "checkpoint-6"]  # save_total_limit=2 rotated 2 away
    assert sorted(stock) == sorted(mine)
    assert [k for k in stock if stock[k] != mine[k]] == []
    assert any("global_step6" in k for k in mine) and "checkpoint-6/trainer_state.json" in mine
    assert hidden(made[(stage, mode)]) == []
    result = json.loads((made[(stage, mode)] / "result.json").read_text())
    assert result["losses"] == json.loads((made[(stage, "none")] / "result.json").read_text())["losses"]
    if (stage, mode) == (2, "async"):
        # the clone of every weight the Trainer made for model.safetensors was filled from DeepSpeed's snapshot of
        # the same weights (ZeRO-3 gathers its 16-bit weights instead, and saves none in that file)
        assert result["filled_from_snapshot"] == [result["state_dict_entries"]] * 3


def _extras(made, mode) -> Path:
    return made[(2, mode)].parent / "extras"


def test_async_on_save_and_the_hub_push_see_the_checkpoint_in_place_as_stock(runs):
    """The Trainer's on_save callbacks and its per-save hub push (hub_strategy "checkpoint", the hub stood in for
    by a copy of each upload) under enable(save="async"), each save's DeepSpeed files slowed to be written after
    the step: a callback listing checkpoint-<step>/ in on_save finds every file the checkpoint has once training
    ended, stock's, model.safetensors the same bytes as stock's callback found, on every rank (stock's own
    listing may miss a file another rank is still writing: it has no barrier there); each upload holds stock's
    files, the model's byte for byte; the user's checkpoint-2/notes.txt, there before the job, is kept beside
    the checkpoint's files as stock keeps it."""
    _, _, made = runs
    stock, mine = _extras(made, "none"), _extras(made, "async")
    seen = {(mode, rank): json.loads((folder / f"on_save_rank{rank}.json").read_text())
            for mode, folder in (("none", stock), ("async", mine)) for rank in (0, 1)}
    assert [s["step"] for s in seen[("none", 0)]] == [s["step"] for s in seen[("async", 0)]] == [2, 4]
    assert seen[("async", 0)] == seen[("async", 1)]
    for i, step in enumerate((2, 4)):
        complete = sorted(files(stock / "callbacks" / "run" / f"checkpoint-{step}"))
        assert sorted(files(mine / "callbacks" / "run" / f"checkpoint-{step}")) == complete
        assert seen[("async", 0)][i]["files"] == complete and "model.safetensors" in complete
        assert seen[("async", 0)][i]["model"] == seen[("none", 0)][i]["model"] == seen[("none", 1)][i]["model"]
        assert all(set(seen[("none", rank)][i]["files"]) <= set(complete) for rank in (0, 1))
    assert "notes.txt" in seen[("async", 0)][0]["files"]
    assert (mine / "callbacks" / "run" / "checkpoint-2" / "notes.txt").read_text() == "the user's"
    uploads = json.loads((stock / "result.json").read_text())["uploads"]
    assert uploads == json.loads((mine / "result.json").read_text())["uploads"] and len(uploads) == 4
    for upload in uploads:
        theirs, ours = files(stock / "hub" / upload), files(mine / "hub" / upload)
        # stock pushes from process 0 with no barrier after the other ranks' writes, so its copy may miss a
        # file another rank is still writing (an RNG state): ours, pushed once the folder is published, holds
        # every file stock's can hold, the model files among them
        assert set(theirs) <= set(ours) and "model.safetensors" in ours and "model.safetensors" in theirs
        assert all(theirs[k] == ours[k] for k in ("model.safetensors", "config.json"))


def test_the_checkpoints_left_after_training_are_stocks_in_every_combination(runs):
    """save_total_limit 1 or 2, a best metric or none, load_best_model_at_end or not: the checkpoints left when
    train() returns under enable(save="async") (the last one's write slowed past the end of training) are
    stock's. With a limit of 1 and a best checkpoint, stock's end of training deletes every other one, the last
    included: that deletion sees the last checkpoint in place."""
    _, _, made = runs
    stock = json.loads((_extras(made, "none") / "result.json").read_text())["combos"]
    mine = json.loads((_extras(made, "async") / "result.json").read_text())["combos"]
    assert len(stock) == 8 and mine == stock
    assert stock["limit1-loss-noload"] == ["checkpoint-2"]


def test_a_file_where_the_checkpoint_goes_stops_the_save_on_every_rank(runs):
    """A file of the user's named checkpoint-2: the async save raises FileExistsError naming it on every rank, as
    stock's save into it fails (test_framework_against_stock.py), and the file is kept."""
    _, _, made = runs
    run = _extras(made, "async") / "file" / "run"
    for rank in (0, 1):
        kind, message = json.loads((_extras(made, "async") / f"file_rank{rank}.json").read_text())
        assert kind == "FileExistsError" and str(run / "checkpoint-2") in message and "\n" not in message
    assert (run / "checkpoint-2").read_text() == "the user's" and os.listdir(run) == ["checkpoint-2"]


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_an_async_run_equals_resume_from_a_stock_one(runs, tmp_path, stage):
    root, tokenizer, made = runs
    losses = {}
    for mode in ("none", "async"):
        out = tmp_path / mode / "run"
        shutil.copytree(made[(stage, mode)], out)
        launch(root, out, tokenizer, "--stage", stage, "--mode", mode, "--resume")
        losses[mode] = json.loads((out / "result_resume.json").read_text())["losses"]
    # the log history holds the resumed checkpoint's steps too; 7 and 8 ran after the resume
    assert losses["async"] == losses["none"] and {"7", "8"} <= set(losses["none"])


def test_async_steps_go_on_during_the_write(runs):
    _, _, made = runs
    out = made[(2, "async")]  # its writes slowed by 3 s (runs)
    result = json.loads((out / "result.json").read_text())
    (step2, _, returned), (step4, called4, returned4) = result["saves"][:2]
    assert (step2, step4) == (2, 4)
    # every file of the step-2 save is written 3 s after the call returned at the earliest; steps 3 and 4 ran
    # before that, and the step-4 save waited for it
    assert result["starts"]["3"] - returned < 1.0 and result["starts"]["4"] < returned + 3.0
    assert returned4 - called4 > 1.0
    # the Trainer's model files too: written from the snapshot while step 3 ran
    assert result["starts"]["3"] < result["model_written"]["checkpoint-2"]
    assert visible(out) == ["checkpoint-4", "checkpoint-6"] and hidden(out) == []
    assert (out / "checkpoint-6" / "model.safetensors").is_file()
    # the same job as the stock run: the same files, byte for byte, although the step-2 save's on_save ran only at
    # the step-4 save (still being written before), whose trainer_state.json records that step's own flags
    stock = files(made[(2, "none")])
    assert sorted(files(out)) == sorted(stock) and [k for k, v in files(out).items() if stock[k] != v] == []


@pytest.mark.parametrize("best", ["first", "last"])
def test_the_best_checkpoint_is_kept_and_loaded_as_stock_keeps_and_loads_it(runs, best):
    """load_best_model_at_end under enable(save="async"): the rotation keeps the best checkpoint beside the newest
    (as stock transformers does: checkpoint-2 and checkpoint-6 when the best is the first, 4 and 6 when it is the
    last), and the best one is what the model holds after train(), loaded even when it is the last, whose
    background write (slowed here) is still running when train() ends."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    _, _, made = runs
    out = made[(2, "async")].parent / "best" / best / "run"  # --best, --slow-write 2, in the ZeRO-2 async launch
    result = json.loads((out / "result.json").read_text())
    assert visible(out) == (["checkpoint-2", "checkpoint-6"] if best == "first" else ["checkpoint-4", "checkpoint-6"])
    assert hidden(out) == []
    want = out / ("checkpoint-2" if best == "first" else "checkpoint-6")
    assert result["best_model_checkpoint"] == str(want)
    saved = load_file(want / "model.safetensors")
    assert saved and {name: hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()
                      for name, t in saved.items()} == {name: result["weights"][name] for name in saved}
    if best == "first":  # the model after train() is not the last step's
        last = load_file(out / "checkpoint-6" / "model.safetensors")
        assert any(not torch.equal(last[name], saved[name]) for name in saved)


@pytest.mark.parametrize("mode,point", [("async", "snapshot"), ("async", "write"), ("async", "trainer-files"),
                                        ("async", "model-files"), ("async", "rotation"),
                                        ("atomic", "trainer-files")])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(runs, tmp_path, mode, point):
    from transformers.trainer_utils import get_last_checkpoint

    root, tokenizer, made = runs
    out = tmp_path / "run"
    launch(root, out, tokenizer, "--stage", 2, "--mode", mode, "--kill", point, "--kill-step", 4, expect_ok=False)
    stock = files(made[(2, "none")])
    want = sorted(k for k in stock if k.startswith("checkpoint-4/"))
    if point == "rotation":
        # killed after checkpoint-4 was in place, before the rotation: both complete, 4 the newest
        assert visible(out) == ["checkpoint-2", "checkpoint-4"]
        last = "checkpoint-4"
    else:
        assert visible(out) == ["checkpoint-2"]
        last = "checkpoint-2"
    assert get_last_checkpoint(str(out)) == str(out / last)
    got = sorted(k for k in files(out) if k.startswith(last + "/"))
    assert got == [k.replace("checkpoint-4", last).replace("global_step4", "global_step" + last[-1]) for k in want]
    if point != "write":
        return  # one resume after a kill shows the rest (a launch each costs the suite ~15 s)
    # the next run resumes from it and cleans what the killed one left
    launch(root, out, tokenizer, "--stage", 2, "--mode", mode, "--resume")
    resumed = json.loads((out / "result_resume.json").read_text())
    assert min(int(s) for s in resumed["starts"]) == int(last.split("-")[1]) + 1  # the first step this run ran
    assert hidden(out) == []
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-8")


ACCELERATE = Path(__file__).resolve().parents[2] / "workers" / "accelerate_save_worker.py"


def launch_accelerate(tmp: Path, project: Path, tokenizer: Path, *args, expect_ok: bool = True) -> None:
    launch(tmp, project, tokenizer, *args, expect_ok=expect_ok, worker=ACCELERATE)


def test_accelerate_save_state_is_stock_and_survives_a_kill(runs, tmp_path):
    """accelerate's save_state with automatic naming: the same folders as stock accelerate byte for byte under
    enable(save="async"), total_limit=2 keeping the two newest (stock runs without a limit: see the worker), and
    a last save_state(output_dir) into a folder of the user's; a
    rank killed while writing checkpoint_1 leaves checkpoint_0 the one load_state() takes, and the next run
    resumes from it and cleans up."""
    root, tokenizer, _ = runs
    made = {}
    for mode, limit in (("none", ()), ("async", ("--limit", 2))):
        project = tmp_path / mode / "project"
        launch_accelerate(root, project, tokenizer, "--mode", mode, "--mine", *limit)
        made[mode] = project
    stock, mine = files(made["none"]), files(made["async"])
    assert sorted(p.name for p in (made["async"] / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    # save_state(output_dir) into a folder of the user's: its notes kept beside accelerate's files, as stock keeps
    # them (the byte-for-byte comparison below covers mine/ too)
    assert mine["mine/notes.txt"] == stock["mine/notes.txt"] == b"the user's" and "mine/latest" in mine
    stock = {k: v for k, v in stock.items() if not k.startswith("checkpoints/checkpoint_0/")}
    assert sorted(stock) == sorted(mine) and [k for k in stock if stock[k] != mine[k]] == []
    assert hidden(made["async"]) == []
    assert json.loads((made["async"] / "result.json").read_text())["losses"] == \
        json.loads((made["none"] / "result.json").read_text())["losses"]
    resumed = {}
    for mode in ("none", "async"):  # load_state() of the newest, checkpoint_2, then two more steps
        project = tmp_path / "resumed" / mode / "project"
        shutil.copytree(made[mode], project)
        launch_accelerate(root, project, tokenizer, "--mode", mode, "--resume")
        resumed[mode] = json.loads((project / "result_resume.json").read_text())
    assert resumed["none"]["start"] == resumed["async"]["start"] == 6
    assert resumed["async"]["losses"] == resumed["none"]["losses"] and len(resumed["none"]["losses"]) == 2

    project = tmp_path / "killed" / "project"
    launch_accelerate(root, project, tokenizer, "--mode", "async", "--limit", 2, "--kill-at", 1, expect_ok=False)
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_0"]
    want = sorted(k.replace("checkpoint_1", "checkpoint_0") for k in mine if k.startswith("checkpoints/checkpoint_1/"))
    assert sorted(k for k in files(project) if k.startswith("checkpoints/checkpoint_0/")) == want
    launch_accelerate(root, project, tokenizer, "--mode", "async", "--limit", 2, "--resume")
    resumed = json.loads((project / "result_resume.json").read_text())
    assert resumed["start"] == 2
    assert hidden(project) == [] and hidden(project / "checkpoints") == []


LIGHTNING = Path(__file__).resolve().parents[2] / "workers" / "lightning_save_worker.py"


def test_lightning_deepspeed_strategy_save_checkpoint(runs, tmp_path):
    """Lightning's DeepSpeedStrategy.save_checkpoint, its own function on a real engine (its strategy refuses
    CPU: see the worker): the same folders as stock under enable(save="async"); a rank killed in the second
    save's background write leaves the first complete and no half-written tag folder in the second."""
    root, tokenizer, _ = runs
    stock, removed, first = tmp_path / "none" / "out", tmp_path / "async" / "out", tmp_path / "first"
    launch(root, stock, tokenizer, "--mode", "none", worker=LIGHTNING)
    # under async, the removal of the older checkpoint (ModelCheckpoint's save_top_k=1) asked after the second
    # save's call, done once the newer one is published; rank 0 copied the first, as published, before asking
    launch(root, removed, tokenizer, "--mode", "async", "--remove-first", "--copy-first", first, worker=LIGHTNING)
    assert sorted(os.listdir(removed)) == ["epoch=0-step=4.ckpt"]
    stock = files(stock)
    mine = files(removed) | {f"epoch=0-step=2.ckpt/{k}": v for k, v in files(first).items()}
    assert "epoch=0-step=4.ckpt/checkpoint/mp_rank_00_model_states.pt" in mine
    assert "epoch=0-step=2.ckpt/checkpoint/mp_rank_00_model_states.pt" in mine
    assert sorted(stock) == sorted(mine) and [k for k in stock if stock[k] != mine[k]] == []
    # a rank killed in the second save's background write, after the removal of the first was asked: the first
    # stays whole (the second was never published), the second has no half-written tag folder
    killed = tmp_path / "killed" / "out"
    said = launch(root, killed, tokenizer, "--mode", "async", "--kill-second", "--remove-first", worker=LIGHTNING,
                  expect_ok=False)
    assert "rank 0: removal of step 2 asked" in said
    got = files(killed)
    assert sorted(k for k in got if k.startswith("epoch=0-step=2.ckpt/")) == \
        sorted(k for k in mine if k.startswith("epoch=0-step=2.ckpt/"))
    second = killed / "epoch=0-step=4.ckpt"
    assert not (second / "checkpoint").exists() and not (second / "latest").exists()
