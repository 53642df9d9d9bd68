"""What a load through pyckpt lets DeepSpeed's own unpickling loader read
(pyckpt/deepspeed/load/pickle_policy.py, hooks.py): when the backend hands a universal load back to
DeepSpeed (a layout it does not serve), every file that loader may unpickle must first parse with
pyckpt's allowlist reader, or the load stops naming the file before anything in it runs; a trusted
checkpoint goes to DeepSpeed as without pyckpt."""

from __future__ import annotations

import os

import pytest
import torch

from pyckpt.errors import UnsafePickleError
from pyckpt.deepspeed.load import hooks
from pyckpt.deepspeed.load.pickle_policy import check_universal_pickles
from pyckpt.deepspeed.load.unsupported import Unsupported

RAN = []  # what unpickling a Payload did; it must stay empty wherever pyckpt refuses the file


class Payload:
    def __setstate__(self, state):
        RAN.append(state)
        self.__dict__.update(state)


def _payload():
    p = Payload.__new__(Payload)
    p.__dict__["x"] = 1
    return p


@pytest.fixture()
def folder(tmp_path):
    """A universal tag folder as ds_to_universal writes it: zero/optimizer_state.pt and one folder of
    state files per parameter."""
    zero = tmp_path / "global_step1_universal" / "zero"
    for name in ("a.weight", "b.weight"):
        (zero / name).mkdir(parents=True)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.save({"param": torch.ones(3), "cat_dim": 0}, zero / name / f"{key}.pt")
        torch.save(torch.tensor(2.0), zero / name / "step.pt")
    torch.save({"optimizer_state_dict": {"param_groups": [{"lr": 0.1}]}, "param_groups": [{"lr": 0.1}]},
               zero / "optimizer_state.pt")
    RAN.clear()
    return zero.parent


def test_a_clean_folder_passes(folder):
    assert check_universal_pickles(os.fspath(folder)) is None


@pytest.mark.parametrize("victim", ["b.weight/exp_avg_sq.pt", "optimizer_state.pt", "a.weight/max_exp_avg_sq.pt"])
def test_any_file_deepspeeds_loader_may_open_is_checked(folder, victim):
    torch.save({"param": torch.ones(3), "hook": _payload()}, folder / "zero" / victim)
    message = check_universal_pickles(os.fspath(folder))
    assert message is not None and victim.split("/")[-1] in message and "Payload" in message
    assert "trust_pickles=True" in message
    assert RAN == []


def test_a_linked_parameter_folder_is_checked_where_it_points(folder, tmp_path):
    """DeepSpeed opens zero/<name>/<key>.pt through any link; the check reads the same files."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"param": _payload()}, elsewhere / "fp32.pt")
    os.symlink(elsewhere, folder / "zero" / "c.weight")
    message = check_universal_pickles(os.fspath(folder))
    assert message is not None and "c.weight" in message and RAN == []


def _wrapped():
    calls = []

    def planner(opt, checkpoint_folder, los, lfp32, view):
        raise Unsupported("a layout this backend does not serve")

    def original(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
        calls.append(checkpoint_folder)
        # what DeepSpeed's loader does with each file
        for root, _, names in os.walk(os.path.join(checkpoint_folder, "zero"), followlinks=True):
            for n in names:
                torch.load(os.path.join(root, n), weights_only=False)

    return hooks.universal_load_of(planner, original), calls


def test_a_load_handed_back_to_deepspeed_runs_its_loader_on_clean_files(folder):
    load, calls = _wrapped()
    load(None, os.fspath(folder), True, False)
    assert calls == [os.fspath(folder)] and hooks.last_load["backend"] == "deepspeed"


def test_a_load_handed_back_to_deepspeed_stops_before_it_unpickles_a_refused_file(folder):
    torch.save({"param": torch.ones(3), "hook": _payload()}, folder / "zero" / "a.weight" / "exp_avg.pt")
    load, calls = _wrapped()
    with pytest.raises(UnsafePickleError, match="exp_avg.pt") as caught:
        load(None, os.fspath(folder), True, False)
    assert "rank 0 refused a file" in str(caught.value)
    assert calls == [] and RAN == [], "DeepSpeed's loader never ran, nothing in the file ran"


def test_a_trusted_checkpoint_goes_to_deepspeed_as_without_pyckpt(folder):
    torch.save({"param": torch.ones(3), "hook": _payload()}, folder / "zero" / "a.weight" / "exp_avg.pt")
    load, calls = _wrapped()
    before = hooks.trust_pickles(True)
    try:
        load(None, os.fspath(folder), True, False)
    finally:
        hooks.trust_pickles(before)
    assert calls == [os.fspath(folder)] and RAN == [{"x": 1}]


def test_enable_sets_the_trust_for_its_block_only():
    import pyckpt.deepspeed

    assert hooks.trust_pickles() is False
    with pyckpt.deepspeed.enable(trust_pickles=True):
        assert hooks.trust_pickles() is True
        with pyckpt.deepspeed.enable():
            assert hooks.trust_pickles() is False
        assert hooks.trust_pickles() is True and pyckpt.deepspeed.enabled(), "the inner block installed nothing"
    assert hooks.trust_pickles() is False and not pyckpt.deepspeed.enabled()


def test_deepspeeds_own_plain_load_is_checked_file_by_file_shared_among_the_ranks(tmp_path):
    """Under enable(), the files of a tag folder DeepSpeed's own load would unpickle (model states, ZeRO
    shards, expert files) are parsed first, each by one rank; a refusal names the file."""
    from pyckpt.deepspeed.load.pickle_policy import check_tag_pickles, deepspeed_tag_folder

    RAN.clear()
    tag = tmp_path / "global_step1"
    tag.mkdir()
    names = ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)]
    for name in names:
        torch.save({"x": torch.ones(2)}, tag / name)
    (tag / "notes.txt").write_text("not a torch file: not DeepSpeed's to read")
    (tmp_path / "latest").write_text("global_step1\n")
    assert deepspeed_tag_folder(tmp_path, None) == os.fspath(tag)
    assert deepspeed_tag_folder(tmp_path, None, "latest_universal") is None  # DeepSpeed reads nothing then
    assert deepspeed_tag_folder(tmp_path, "global_step1") == os.fspath(tag)
    assert all(check_tag_pickles(os.fspath(tag), r, 2) is None for r in range(2))
    victim = "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    torch.save({"x": torch.ones(2), "hook": _payload()}, tag / victim)
    found = [check_tag_pickles(os.fspath(tag), r, 2) for r in range(2)]
    # one rank of two parses it, the other does not (the ranks agree on what any found)
    assert sum(m is not None for m in found) == 1
    kind, message = next(m for m in found if m)
    assert kind == "UnsafePickleError" and victim in message and "Payload" in message and "trust_pickles=True" in message
    assert check_tag_pickles(os.fspath(tag)) == (kind, message)  # alone: every file
    # the model-state files of a universal load are read weights-only elsewhere: skipped when asked
    torch.save({"hook": _payload()}, tag / "mp_rank_00_model_states.pt")
    torch.save({"x": 1}, tag / victim)
    assert check_tag_pickles(os.fspath(tag), skip="_model_states.pt") is None
    assert "mp_rank_00_model_states.pt" in check_tag_pickles(os.fspath(tag))[1]
    # a file pyckpt cannot parse at all is named as such
    (tag / victim).write_bytes(b"PK\x03\x04 cut short")
    kind, message = check_tag_pickles(os.fspath(tag), skip="_model_states.pt")
    assert kind == "CheckpointFormatError" and victim in message and "cannot parse" in message
    # a link out of the folder named by latest is refused, not followed
    (tmp_path / "latest").write_text("../elsewhere")
    with pytest.raises(Exception, match="latest"):
        deepspeed_tag_folder(tmp_path, None)
    assert RAN == []


_READ_IN_A_FRESH_PROCESS = """
import sys
import pyckpt.deepspeed
from pyckpt.deepspeed.load.pickle_policy import read_model_states
before = "torch.distributed.checkpoint" in sys.modules
state = read_model_states(sys.argv[1])
print(before, "torch.distributed.checkpoint" in sys.modules, sorted(state))
"""


def _read_fresh(path):
    import subprocess
    import sys

    # from the file's folder: from the repository's root `import pyckpt` would find the source folder, which
    # has no native module (the installed package is the one under test)
    proc = subprocess.run([sys.executable, "-c", _READ_IN_A_FRESH_PROCESS, str(path)], capture_output=True,
                          text=True, timeout=300, cwd=str(path.parent))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1].split(maxsplit=2)  # after any line DeepSpeed logs


def test_a_model_state_file_is_read_without_importing_what_it_does_not_name(tmp_path):
    """DeepSpeed's model states name classes of modules a DeepSpeed job has loaded; reading them imports
    nothing else (torch.distributed.checkpoint, whose records the allowlist also takes, cost a resume
    0.1-0.2 s)."""
    import argparse

    torch.save({"module": {"w": torch.ones(3)}, "args": argparse.Namespace(lr=0.1), "global_steps": 4},
               tmp_path / "mp_rank_00_model_states.pt")
    before, after, keys = _read_fresh(tmp_path / "mp_rank_00_model_states.pt")
    assert (before, after, keys) == ("False", "False", "['args', 'global_steps', 'module']")


def test_a_file_naming_an_allowed_class_of_a_module_not_imported_yet_is_still_read(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    torch.save({"module": {"w": torch.ones(3)}, "chunk": ChunkStorageMetadata(torch.Size([1]), torch.Size([3]))},
               tmp_path / "mp_rank_00_model_states.pt")
    before, after, keys = _read_fresh(tmp_path / "mp_rank_00_model_states.pt")
    assert (before, after, keys) == ("False", "True", "['chunk', 'module']")


def test_a_global_outside_the_allowlist_is_refused_after_the_second_reading(tmp_path):
    from pyckpt.deepspeed.load.pickle_policy import read_model_states
    import pickle

    RAN.clear()
    torch.save({"p": _payload()}, tmp_path / "m.pt")
    with pytest.raises(pickle.UnpicklingError):
        read_model_states(str(tmp_path / "m.pt"))
    assert RAN == []
