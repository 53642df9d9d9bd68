"""pyckpt's Universal output equals DeepSpeed's, file by file, and DeepSpeed resumes from it elsewhere."""

import os

import pytest
import torch

import dsharness
from compare import diff_folders
from conftest import CONFIGS, LOADS


@pytest.mark.parametrize("name", list(CONFIGS))
def test_output_is_bit_equal_to_deepspeed(name, deepspeed_universal, pyckpt_universal):
    expected, actual = deepspeed_universal[name], pyckpt_universal[name]
    assert (expected / "zero").is_dir() and any((expected / "zero").iterdir())
    assert diff_folders(str(expected), str(actual)) == []


@pytest.mark.parametrize("name", list(CONFIGS))
def test_latest_universal_names_the_output(name, pyckpt_universal):
    out = pyckpt_universal[name]
    assert (out.parent / "latest_universal").read_text() == out.name


def test_comparison_catches_a_single_flipped_bit(deepspeed_universal, pyckpt_universal, tmp_path):
    # The equality test above is only worth something if a one-bit change is reported.
    import shutil
    name = "s2_fp32_dp3"
    copy = tmp_path / "u"
    shutil.copytree(pyckpt_universal[name], copy)
    victim = next(p for p in sorted((copy / "zero").rglob("exp_avg.pt")))
    obj = torch.load(victim, weights_only=False)
    flat = obj["param"].view(-1).view(torch.int32)
    flat[0] ^= 1
    torch.save(obj, victim)
    diffs = diff_folders(str(deepspeed_universal[name]), str(copy))
    assert len(diffs) == 1 and "values differ" in diffs[0]


@pytest.fixture(scope="session")
def loaded_states(checkpoints, pyckpt_universal, ds_environ):
    requests = []
    for name, world in LOADS:
        out = pyckpt_universal[name]
        requests.append((CONFIGS[name], out.parent, out.name, world))
    states = dsharness.load_universal_many(requests, env=ds_environ)
    return {(name, world): st for (name, world), st in zip(LOADS, states)}


@pytest.mark.parametrize("name,world", LOADS, ids=[f"{n}-to-dp{w}" for n, w in LOADS])
def test_deepspeed_resumes_pyckpt_output_at_another_world_size(name, world, checkpoints, loaded_states):
    reference = checkpoints[name].reference
    loaded = loaded_states[(name, world)]
    assert reference["param_names"], "reference state is empty"
    assert dsharness.compare_states(reference, loaded) == []


@pytest.mark.parametrize("durable", [False, True])
def test_fsync_flushes_every_file_and_folder_only_when_asked(durable, checkpoints, deepspeed_universal, tmp_path,
                                                             monkeypatch):
    # The native executor fsyncs the archives itself (test_core); the Python side owns the copied
    # model-state files, the folders (so the names are durable) and latest_universal.
    import pyckpt
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    name = "s1_fp32_dp2"
    out = tmp_path / "u"
    pyckpt.convert_to_universal(checkpoints[name].root, out, fsync=durable)
    assert diff_folders(str(deepspeed_universal[name]), str(out)) == []
    if not durable:
        assert synced == []
        return
    staging = [p for p in synced if ".u.pyckpt-tmp-" in p]
    folders = {p for p in staging if not p.endswith(".pt")}
    assert len(folders) == len([p for p in (out / "zero").iterdir() if p.is_dir()]) + 2  # + zero/, staging root
    assert {os.path.basename(p) for p in staging if p.endswith("_model_states.pt")} == {
        p.name for p in out.glob("*_model_states.pt")}
    assert str(tmp_path) in synced  # the rename of the output, then latest_universal's
    # latest_universal's content, flushed under its temporary name before the rename
    assert any(os.path.basename(p).startswith(".u.pyckpt-ptr-") for p in synced)
