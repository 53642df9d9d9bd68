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


def _memory_load(monkeypatch, engine, tag, direct):
    """hooks._memory_load alone (one rank): ``direct`` stands in for the direct resume; what DeepSpeed's own
    load was asked, and the lines said, come back."""
    import logging

    from pyckpt.deepspeed.load import hooks

    asked, lines = [], []
    monkeypatch.setattr(hooks.resume, "load_zero", direct)
    monkeypatch.setattr(hooks, "_check_pickles", lambda *a, **k: None)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("pyckpt").addHandler(handler)
    try:
        out = hooks._memory_load(engine, str(tag), "global_step3", None,
                                 lambda e, d, t, *a, **k: asked.append((d, t)) or "deepspeed", (), {})
    finally:
        logging.getLogger("pyckpt").removeHandler(handler)
    return out, asked, lines


def test_a_memory_checkpoint_at_its_own_topology_is_read_by_the_direct_resume(tag, monkeypatch):
    out, asked, lines = _memory_load(monkeypatch, _Engine(zero=True), tag, lambda e, d, t, *a, **k: ("direct", d, t))
    assert out == ("direct", str(tag), "global_step3") and asked == [] and lines == []


def test_a_layout_the_direct_resume_does_not_know_goes_to_deepspeed_s_load_with_one_line(tag, monkeypatch):
    def unknown(*a, **k):
        raise UnsupportedCheckpointError("zero/x: a layout pyckpt does not know")

    out, asked, (line, *more) = _memory_load(monkeypatch, _Engine(zero=True), tag, unknown)
    assert out == "deepspeed" and asked == [(str(tag), "global_step3")] and more == []
    assert line.startswith("pyckpt: DeepSpeed's own load reads the memory checkpoint ") and "does not know" in line
    # an engine the direct resume cannot serve (NVMe optimizer offload) is told the same way
    out, asked, (line, *more) = _memory_load(monkeypatch, _Engine(zero=True, nvme=True), tag, unknown)
    assert out == "deepspeed" and len(asked) == 1 and more == [] and "NVMe" in line


def test_any_other_failure_of_the_direct_resume_raises_and_nothing_falls_back(tag, monkeypatch):
    def broken(*a, **k):
        raise CheckpointFormatError("global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt: truncated")

    with pytest.raises(CheckpointFormatError, match="truncated"):
        _memory_load(monkeypatch, _Engine(zero=True), tag, broken)
