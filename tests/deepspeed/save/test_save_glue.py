"""`pyckpt.deepspeed.save_checkpoint` with real DeepSpeed 0.19.8 on CPU (tests/workers/save_glue_worker.py).

The glue's checkpoint must be DeepSpeed's own (every file of a bare `engine.save_checkpoint` of the
same state, tensor by tensor) plus the tokenizer, config and training-state files, and DeepSpeed must
resume from it. When one rank's save fails (an exception, a file-size limit, a folder it may not
write), no rank hangs (every launch carries a timeout), nothing is published, `latest` and the
previous checkpoint stay, and with on_error="warn" training goes on and the next save succeeds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

import dsharness as h
from compare import diff_objects
from dsharness import _launch

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).resolve().parents[2] / "workers" / "save_glue_worker.py")
TIMEOUT_S = 240

EQUAL = {
    "z1-fp32": h.Config(1, "fp32", 2),
    "z2-fp32-wide": h.Config(2, "fp32", 2, model="wide"),
    "z3-bf16": h.Config(3, "bf16", 2),
}
# (config, the fault on rank 1, on_error)
FAULTS = {
    "exception-z3-raise": (h.Config(3, "fp32", 2), "exception", "raise"),
    "fsize-z2-warn": (h.Config(2, "fp32", 2, model="wide"), "fsize", "warn"),
    "readonly-z1-raise": (h.Config(1, "bf16", 2), "readonly", "raise"),
    "readonly-z3-warn": (h.Config(3, "bf16", 2), "readonly", "warn"),
}
DEEPSPEED_EXTRAS = {"latest", "zero_to_fp32.py", "zero_to_torch.py"}
CONVERTED = h.Config(3, "fp32", 2)


def _call(function: str, cfg: h.Config, root: Path, **extra) -> dict:
    return {"kind": "call", "module": WORKER, "function": function, "cfg": dataclasses.asdict(cfg),
            "root": str(root), **extra}


@pytest.fixture(scope="session")
def equal_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("save_glue")
    tasks = [_call("equal", cfg, base / name) for name, cfg in EQUAL.items()]
    for task in tasks:
        os.makedirs(task["root"])
    # in the same launch (one start-up): a save converted by the ranks together
    tasks.append(_call("converted", CONVERTED, base / "converted"))
    *results, converted = _launch(2, tasks, None, "save glue vs bare", TIMEOUT_S)
    runs = {name: (base / name, res) for name, res in zip(EQUAL, results)}
    runs["converted"] = (base / "converted", converted)
    return runs


@pytest.mark.parametrize("name", EQUAL)
def test_the_glue_writes_deepspeeds_own_checkpoint_plus_its_companions(equal_runs, name):
    root, res = equal_runs[name]
    bare, glue = root / "bare" / "t", root / "glue" / "t"
    assert res["ok"] == [True, True]
    deepspeed_files = sorted(os.listdir(bare))
    extras = set(os.listdir(glue)) - set(deepspeed_files)
    assert set(deepspeed_files) <= set(os.listdir(glue))
    assert {"config.json", "training_state.json", "tokenizer.json", "tokenizer_config.json"} <= extras
    for fname in deepspeed_files:
        with zipfile.ZipFile(bare / fname) as za, zipfile.ZipFile(glue / fname) as zb:
            assert za.namelist() == zb.namelist(), fname
        # both files were written by DeepSpeed in this test, not taken as input
        a = torch.load(bare / fname, weights_only=False)
        b = torch.load(glue / fname, weights_only=False)
        # bit by bit: a ZeRO-3 partition's padding is uninitialised memory, sometimes a NaN pattern,
        # which torch.equal would call unequal to itself
        differences = []
        diff_objects(a, b, fname, differences)
        assert differences == []
    # beside the tag folder: DeepSpeed's recovery scripts and `latest`, nothing else (no lock file either)
    assert sorted(os.listdir(root / "glue")) == sorted(DEEPSPEED_EXTRAS | {"t"})
    assert (root / "glue" / "latest").read_text() == "t"
    assert json.loads((glue / "config.json").read_text()) == {"model_type": "pyckpt-test", "hidden_size": 8,
                                                              "dtype": "float32"}
    state = json.loads((glue / "training_state.json").read_text())
    cfg = EQUAL[name]
    assert state["tag"] == "t" and state["global_steps"] == 2 and state["zero_stage"] == cfg.stage
    assert state["world"]["world_size"] == 2 and state["learning_rates"] == res["lrs"]
    assert state["versions"]["deepspeed"] == "0.19.8"


@pytest.mark.parametrize("name", EQUAL)
def test_deepspeed_resumes_from_the_glues_checkpoint(equal_runs, name):
    root, res = equal_runs[name]
    assert res["load_path"].startswith(str(root / "glue" / "t") + os.sep)
    assert res["problems"] == []
    assert res["global_steps"] == 2 and res["client_note"] == "from the test"


def test_the_free_space_estimate_covers_what_deepspeed_writes(equal_runs):
    for name in EQUAL:
        root, res = equal_runs[name]
        written = sum(os.path.getsize(root / "bare" / "t" / f) for f in os.listdir(root / "bare" / "t"))
        estimate = sum(res["estimates"])
        assert written <= estimate, name
    # at 1M parameters the per-file allowance no longer dominates: the estimate is close
    root, res = equal_runs["z2-fp32-wide"]
    written = sum(os.path.getsize(root / "bare" / "t" / f) for f in os.listdir(root / "bare" / "t"))
    assert sum(res["estimates"]) <= 1.1 * written


@pytest.mark.parametrize("name", FAULTS)
def test_a_save_failing_on_one_rank_publishes_nothing_and_hangs_no_rank(tmp_path, name):
    cfg, fault, on_error = FAULTS[name]
    root = tmp_path / "ckpt"
    (res, ) = _launch(2, [_call("fault", cfg, root, fault=fault, on_error=on_error)], None, f"save fault {name}",
                      TIMEOUT_S)
    assert res["first"] is True
    if on_error == "raise":
        assert res["results"] == ["raised", "raised"]
        first, second = res["errors"]
        assert first == second  # every rank raises the same message
        assert res["warned"] == [[], []]
        assert "rank 1: " in first and "rank 0:" not in first
        assert "Nothing was published (latest still names good)" in first
        if fault == "exception":
            assert "rank 1: writing" in first and "injected failure in torch.save" in first
        if fault == "readonly":
            assert "Permission denied" in first
    else:
        assert res["results"] == [False, False] and res["errors"] == [None, None]
        # logged once, by rank 0, with the failing rank's message
        (message, ), none = res["warned"]
        assert none == [] and "rank 1: " in message and "latest still names good" in message
    # nothing of the failed save is visible, latest unchanged, no staging left
    assert sorted(res["after"]) == sorted(res["before"])
    assert res["latest_after"] == "good"
    # training went on and the next save succeeded
    assert res["last"] == [True, True] and res["latest_last"] == "next"
    assert sorted(res["final"]) == sorted(DEEPSPEED_EXTRAS | {"good", "next"})
    # the checkpoint from before the failure loads, equal to the state it saved
    assert res["load_path"].startswith(str(root / "good") + os.sep)
    assert res["problems"] == []


def test_pyckpts_own_saves_under_enable_save_are_one_save_each(tmp_path):
    """enable(save="atomic") routes DeepSpeed's save_checkpoint through pyckpt; the saves pyckpt runs call that
    method for DeepSpeed's own files, and must get DeepSpeed's, not a second save nested in the first."""
    (res, ) = _launch(2, [_call("under_enable_save", h.Config(2, "fp32", 2), tmp_path)], None,
                      "pyckpt's saves under enable(save=...)", TIMEOUT_S)
    assert res["ok"] == [[True, True, True]] * 2 and res["kind"] == "made"
    own = sorted(res["stock"] + ["training_state.json"])
    assert res["folders"] == {"sync": own, "async": own, "mem": sorted(own + ["pyckpt-node.json"])}, res
    assert res["top"] == ["async", "latest", "sync", "zero_to_fp32.py", "zero_to_torch.py"], res["top"]


def test_a_call_on_some_ranks_only_is_named_not_hung(tmp_path):
    root = tmp_path / "ckpt"
    (res, ) = _launch(2, [_call("partial", h.Config(2, "fp32", 2), root)], None, "save on one rank", TIMEOUT_S)
    rank0, rank1 = res["errors"]
    assert set(rank0) == {0} and set(rank1) == {1}
    assert "called on rank(s) 0 and not on rank(s) 1" in rank0[0]
    assert "called on rank(s) 1 and not on rank(s) 0" in rank1[1]
    assert "if rank == 0:" in rank0[0]
    assert res["listing"] == []  # nothing was written: the arrival comes first
    assert res["both"] == [True, True]
    # the staging folder of a save killed earlier was removed by this one
    assert sorted(res["final"]) == sorted(DEEPSPEED_EXTRAS | {"both"})


def test_too_little_free_space_fails_before_writing_with_the_numbers(tmp_path):
    root = tmp_path / "ckpt"
    (res, ) = _launch(2, [_call("no_space", h.Config(2, "fp32", 2), root)], None, "save without space", TIMEOUT_S)
    first, second = res["errors"]
    assert first == second and "not enough free space for checkpoint big" in first
    assert "1000 B is free" in first and "nothing was written" in first
    assert res["listing"] == []


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_universal_and_export_after_the_save_equal_single_process_runs(equal_runs, tmp_path):
    from pyckpt import convert_to_universal
    from pyckpt.huggingface.export import export_hf

    root, res = equal_runs["converted"]
    assert res["ok"] == [True, True]
    assert sorted(os.listdir(root)) == sorted(DEEPSPEED_EXTRAS | {"t", "t_universal", "t_hf", "latest_universal"})
    assert (root / "latest").read_text() == "t" and (root / "latest_universal").read_text() == "t_universal"
    convert_to_universal(root / "t", tmp_path / "u")
    export_hf(root / "t", tmp_path / "hf")
    assert _files(root / "t_universal") == _files(tmp_path / "u")
    hf = _files(root / "t_hf")
    assert hf == _files(tmp_path / "hf")
    # the model config the glue saved into the checkpoint went on into the export
    assert json.loads(hf["config.json"])["model_type"] == "pyckpt-test"


def test_a_save_refuses_on_every_rank_what_it_must_not_replace_or_cannot_agree_on(tmp_path):
    """A tag (or a conversion) naming a folder that is not such a checkpoint, a tag named like the
    pointer, and arguments that differ between ranks: refused on every rank at once, nothing written,
    training goes on. keep_last then removes only this job's checkpoints, oldest step first."""
    root = tmp_path / "ckpt"
    (res, ) = _launch(2, [_call("refusals", h.Config(2, "fp32", 2), root)], None, "save refusals", TIMEOUT_S)
    out = res["outcomes"]
    for name in ("tag-async", "tag-sync"):
        first, second = out[name]
        assert first == second and first[0] == "raised", (name, first)
        assert f"{root / 'notes'} exists and is not a DeepSpeed checkpoint" in first[1] and "nothing was written" in first[1]
    assert res["notes"] == "mine"
    assert out["latest-tag"][0][0] == "raised" and "pointer file" in out["latest-tag"][0][1]
    for name, key in (("async-differs", "async_save"), ("keep-last-differs", "keep_last"),
                      ("export-differs", "export")):
        first, second = out[name]
        assert first == second and first[0] == "raised", (name, first)
        assert f"different {key}" in first[1] and "nothing was written" in first[1]
    first, second = out["hf-folder-is-someones"]
    assert first == second and first[0] == "raised" and "s1_hf exists and holds files" in first[1]
    for listing in res["listings"].values():  # nothing of a refused save is left, hidden or not
        assert sorted(listing) == ["analysis", "notes", "s1_hf"]
    assert res["saved"] == [{"s2": True, "s3": True, "s4": True}] * 2
    # s2 (touched after s3) is the oldest by step: keep_last=2 removed it; the user's folders stay
    assert res["latest"] == "s4"
    assert sorted(res["final"]) == ["analysis", "latest", "notes", "s1_hf", "s3", "s4", "zero_to_fp32.py",
                                    "zero_to_torch.py"]
