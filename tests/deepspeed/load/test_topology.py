"""The topology a plain load compares (pyckpt/deepspeed/load/topology.py), read from a checkpoint's
first model-state file: what it reads is untrusted, so every hostile value is one error naming the
file and the key, the input stays as it was, and a model-state file that is a link out of the tag
folder is refused rather than followed. Fast: synthetic checkpoints, no DeepSpeed run."""

from __future__ import annotations

import hashlib
import os

import pytest

import pyckpt.testing as mc
from edit import copy_checkpoint, rewrite
from pyckpt.deepspeed.load import topology
from pyckpt.errors import CheckpointFormatError
from pyckpt.zero.describe import describe

MODEL_STATES = "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("topology")
    return {"dense": mc.make_checkpoint(root / "dense", params=20_000, dp=2, stage=2),
            "z3": mc.make_checkpoint(root / "z3", params=20_000, dp=3, stage=3),
            "moe": mc.make_checkpoint(root / "moe", params=20_000, dp=4, stage=2, experts=4, ep=2)}


def _digests(folder) -> dict:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in sorted(os.listdir(folder))}


def test_the_saved_topology_is_what_the_metadata_says(made):
    assert topology.saved(str(made["dense"])) == topology.Topology(2, 2, 1, None)
    assert topology.saved(str(made["z3"])) == topology.Topology(3, 3, 1, None)
    assert topology.saved(str(made["moe"])) == topology.Topology(2, 4, 1, 2)
    assert str(topology.Topology(2, 4, 1, 2)) == "ZeRO-2, data-parallel 4, tensor-parallel 1, expert-parallel 2"
    assert topology.Topology(1, 2, 1).partitioned_like(topology.Topology(2, 2, 1))
    assert not topology.Topology(2, 2, 1).partitioned_like(topology.Topology(3, 2, 1))
    assert not topology.Topology(2, 2, 1).partitioned_like(topology.Topology(2, 3, 1))


@pytest.mark.parametrize("key,value", [("dp_world_size", 0), ("dp_world_size", -3), ("dp_world_size", "2"),
                                       ("dp_world_size", True), ("dp_world_size", None), ("dp_world_size", 2.0),
                                       ("mp_world_size", 0), ("mp_world_size", [1])])
def test_a_hostile_world_size_is_one_error_naming_the_file(made, tmp_path, key, value):
    _, tag = copy_checkpoint(made["dense"], tmp_path)
    rewrite(tag / MODEL_STATES, lambda obj: obj.__setitem__(key, value))
    before = _digests(tag)
    with pytest.raises(CheckpointFormatError) as err:
        topology.saved(str(tag))
    assert str(err.value).startswith(f"{tag / MODEL_STATES}: {key} is ") and "not a positive integer" in str(err.value)
    assert _digests(tag) == before, "the input is untouched"


@pytest.mark.parametrize("sizes", [[2, 4], [0, 0], ["2", "2"], [True, True], [None, None]])
def test_hostile_autoep_sizes_are_one_error_naming_the_file(made, tmp_path, sizes):
    _, tag = copy_checkpoint(made["moe"], tmp_path)

    def edit(obj):
        for layer, size in zip(obj["ds_autoep_layers"], sizes):
            layer["ep_size"] = size

    rewrite(tag / MODEL_STATES, edit)
    with pytest.raises(CheckpointFormatError, match=r"ds_autoep_layers name ep sizes .*not one positive size") as err:
        topology.saved(str(tag))
    assert str(err.value).startswith(str(tag / MODEL_STATES))


def test_a_hostile_stage_or_expert_count_is_not_believed(made, tmp_path):
    """The stage is only ever one of DeepSpeed's; a file-name fallback says ZeRO-3 or unknown. Expert
    counts that are not positive integers give no expert-parallel sizes to inspect."""
    _, tag = copy_checkpoint(made["moe"], tmp_path)

    def edit(obj):
        obj["ds_config"]["zero_optimization"]["stage"] = "../../etc"
        for layer in obj["ds_autoep_layers"]:
            layer["num_experts"] = -4

    rewrite(tag / MODEL_STATES, edit)
    assert topology.saved(str(tag)).stage is None
    assert describe(str(tag))["resumable"]["expert_parallel"] is None


def test_a_model_state_file_linking_out_of_the_folder_is_refused(made, tmp_path):
    _, tag = copy_checkpoint(made["dense"], tmp_path)
    outside = tmp_path / "elsewhere.pt"
    os.replace(tag / MODEL_STATES, outside)
    os.symlink(outside, tag / MODEL_STATES)
    with pytest.raises(CheckpointFormatError, match="outside its folder"):
        topology.saved(str(tag))
    os.remove(tag / MODEL_STATES)
    os.symlink("/proc/self/environ", tag / MODEL_STATES)
    with pytest.raises(CheckpointFormatError, match="outside its folder"):
        topology.saved(str(tag))


def test_a_folder_without_the_first_model_state_file_names_what_is_missing(tmp_path):
    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="no mp_rank_00_model_states.pt or "
                                                    "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        topology.saved(str(tmp_path))
