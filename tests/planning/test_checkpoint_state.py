"""The logical checkpoint state between readers and writers (pyckpt/planning/state.py).

A ZeRO checkpoint is read into per-parameter states named by what they are; the universal writer
lays them out as files, and the other consumers look them up by name. Equality of the written
files with DeepSpeed's own is proven in test_convert.py and test_make_checkpoint.py; these tests
pin what the state itself promises: a reader asked for some states reads only those, identically,
and export asks only for the fp32 masters it writes.
"""

from __future__ import annotations

import pytest

import pyckpt.testing as mc
import pyckpt
from pyckpt.zero.discovery import discover
from pyckpt.universal.write import build_plan
from pyckpt.zero.read import read_zero_state
from pyckpt.universal.layout import param_of_path, param_state_path
from pyckpt.universal.write import universal_plan
from pyckpt.errors import CheckpointFormatError
from pyckpt.planning.state import ALL_STATES, CheckpointState



LAYOUTS = {
    "zero2": dict(dp=3, stage=2, layers=2, hidden=8),
    "zero3": dict(dp=2, stage=3, layers=2, hidden=8),
    "autoep_zero2": dict(dp=4, stage=2, layers=2, hidden=8, experts=4, ep=2, moe_layers=1),
    "autotp_zero1": dict(dp=2, stage=1, family="llama", layers=1, hidden=8, tp=2, vocab=12),
}


@pytest.fixture(scope="module")
def tags(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    return {name: mc.make_checkpoint(root / name, params=20_000, **kw) for name, kw in LAYOUTS.items()}


def _pieces(value):
    t = value["param"] if isinstance(value, dict) else value
    return [(p.src.path, p.src_off, p.nbytes, p.dst_off, p.kind, p.rows, p.stride) for p in t.pieces]


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_reader_asked_for_fp32_reads_only_it_and_the_same(tags, name):
    ck = discover(tags[name])
    full, counts = read_zero_state(ck)
    fp32, fp32_counts = read_zero_state(ck, states=("fp32", ))
    assert counts == fp32_counts
    assert set(fp32.params) == set(full.params)
    for param, held in full.params.items():
        assert set(held) <= set(ALL_STATES)
        assert list(fp32.params[param]) == ["fp32"], param
        assert _pieces(fp32.params[param]["fp32"]) == _pieces(held["fp32"]), param
    # the moments are there to leave out (dense ZeRO-3 parameters have no step file in DeepSpeed's layout)
    assert any({"exp_avg", "exp_avg_sq"} <= set(held) for held in full.params.values())


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_universal_writer_lays_out_every_state_in_the_order_it_was_read(tags, name):
    ck = discover(tags[name])
    state, _ = read_zero_state(ck)
    plan, _ = build_plan(ck)
    relpaths = [a.relpath for a in plan.archives]
    wanted = [param_state_path(n, s) for kind, *rest in state.order if kind == "param" for n, s in [rest]]
    assert [r for r in relpaths if param_of_path(r) is not None] == wanted
    assert {param_of_path(r) for r in relpaths} - {None} == set(state.params)
    assert "zero/optimizer_state.pt" in relpaths
    # the model-state files: copied verbatim, or re-saved where the layout adds metadata (AutoEP)
    names = {mf.name for mf in state.model_files}
    assert names == {c.relpath for c in plan.copies} | {r for r in relpaths if r.endswith("_model_states.pt")}
    assert len(universal_plan(state).archives) == len(plan.archives)


def test_one_state_put_twice_is_refused():
    state = CheckpointState()
    state.put("w", "fp32", 1)
    with pytest.raises(CheckpointFormatError, match="two values found for the fp32 state of parameter 'w'"):
        state.put("w", "fp32", 2)
    assert CheckpointState(("fp32", )).wanted(ALL_STATES) == ["fp32"]
    assert param_of_path("zero/w/fp32.pt") == "w" and param_of_path("mp_rank_00_model_states.pt") is None


def test_export_reads_only_the_fp32_masters(tags, tmp_path, monkeypatch):
    seen = []
    real = CheckpointState.put

    def put(self, name, state, value):
        seen.append(state)
        return real(self, name, state, value)

    monkeypatch.setattr(CheckpointState, "put", put)
    pyckpt.export_hf(tags["autoep_zero2"], tmp_path / "hf")
    assert seen and set(seen) == {"fp32"}
    seen.clear()
    pyckpt.convert_to_universal(tags["autoep_zero2"], tmp_path / "universal")
    assert set(seen) == set(ALL_STATES)
