"""Resuming straight from a ZeRO checkpoint refuses, before DeepSpeed runs, what it cannot do right
(pyckpt/deepspeed/load/resume.py: resumable_target, which every rank runs in an agreed step before
load_zero hands the load to DeepSpeed): the universal flag makes DeepSpeed skip the module weights, so an
engine that would not reach the optimizer-state load would silently keep its own weights."""

from __future__ import annotations

import pytest

from pyckpt.errors import CheckpointFormatError, UnsupportedCheckpointError
from pyckpt.deepspeed.load.resume import resumable_target, zero_target


class _Engine:
    def __init__(self, zero: bool, nvme: bool = False):
        self._zero, self._nvme = zero, nvme

    def zero_optimization(self):
        return self._zero

    def zero_nvme_offload_optimizer(self):
        return self._nvme


@pytest.fixture()
def tag(tmp_path):
    folder = tmp_path / "global_step3"
    folder.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (folder / name).write_bytes(b"")
    (tmp_path / "latest").write_text("global_step3")
    return tmp_path


@pytest.mark.parametrize("engine", [_Engine(zero=False), _Engine(zero=True, nvme=True)], ids=["no ZeRO", "NVMe"])
def test_an_engine_that_would_not_load_the_weights_is_refused(tag, engine):
    with pytest.raises(UnsupportedCheckpointError, match="ZeRO stage 1-3 and no NVMe"):
        resumable_target(engine, str(tag), "global_step3")


def test_a_tag_folder_without_model_states_is_refused(tag):
    (tag / "global_step3" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match="no \\*_model_states.pt"):
        resumable_target(_Engine(zero=True), str(tag), "global_step3")


def test_which_loads_name_a_plain_zero_checkpoint(tag):
    assert zero_target(str(tag), None) == (str(tag), "global_step3")
    assert zero_target(str(tag), "global_step3") == (str(tag), "global_step3")
    (tag / "latest_universal").write_text("global_step3_universal")
    assert zero_target(str(tag), None) is None, "DeepSpeed's latest_universal wins"
    (tag / "global_step3" / "zero").mkdir()
    assert zero_target(str(tag), "global_step3") is None, "a folder with zero/ is universal"
