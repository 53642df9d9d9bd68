"""The universal load's model-state file reader (pyckpt/load_universal/model_state_file.py): one
weights-only memory-mapped read per path, DeepSpeed's own reader for what torch's restricted
unpickler refuses, other files untouched; and enable()/disable() patching DeepSpeed only on the
version the hooks were proven against, restoring it exactly."""

from __future__ import annotations

import collections
import os

import pytest
import torch

from pyckpt.load_universal.model_state_file import MappedModelStates


class Recorder:
    """A checkpoint engine that records what reaches it (DeepSpeed's reader, in a real load)."""

    def __init__(self):
        self.calls = []
        self.name = "recorder"

    def load(self, path, map_location=None):
        self.calls.append(path)
        return torch.load(path, map_location=map_location, weights_only=False)


class UserObject:  # what a client_state may hold; torch's weights-only reader refuses it
    def __init__(self, value):
        self.value = value


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_model_state_file_is_mapped_once_and_its_module_not_read(tmp_path):
    path = os.fspath(tmp_path / "mp_rank_00_model_states.pt")
    module = collections.OrderedDict(w=torch.arange(4 << 20, dtype=torch.float32))  # 16 MiB
    torch.save({"module": module, "global_steps": 3, "param_shapes": [{"w": torch.Size([4 << 20])}]}, path)
    inner = Recorder()
    engine = MappedModelStates(inner)
    r0 = _rchar()
    first = engine.load(path, map_location=lambda s, loc: s)
    second = engine.load(path)
    read = _rchar() - r0
    assert inner.calls == [] and engine.mapped == [path] and engine.refused == []
    assert read < 1 << 20, f"{read} bytes read: the module's 16 MiB should stay unread pages of the mapping"
    assert first is not second and first["global_steps"] == 3 and second["param_shapes"] == [{"w": (4 << 20, )}]
    first.pop("module")
    assert "module" in second, "each caller gets its own top-level dict"
    assert torch.equal(second["module"]["w"][-3:], module["w"][-3:])
    assert engine.name == "recorder", "everything else is the wrapped engine's"


def test_a_file_the_weights_only_reader_refuses_goes_to_deepspeeds_reader(tmp_path, caplog):
    path = os.fspath(tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"module": {}, "my_state": UserObject(7)}, path)
    inner = Recorder()
    engine = MappedModelStates(inner)
    with caplog.at_level("WARNING", logger="pyckpt"):
        state = engine.load(path)
    assert state["my_state"].value == 7
    assert inner.calls == [path] and engine.refused == [path] and engine.mapped == []
    assert path in caplog.text and "DeepSpeed's own loader" in caplog.text


def test_other_files_are_not_intercepted(tmp_path):
    path = os.fspath(tmp_path / "optim_states.pt")
    torch.save({"x": 1}, path)
    inner = Recorder()
    assert MappedModelStates(inner).load(path) == {"x": 1}
    assert inner.calls == [path]


def test_a_damaged_model_state_file_fails_as_deepspeed_would(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "global_steps": 1}, path)
    path.write_bytes(path.read_bytes()[:100])
    inner = Recorder()
    with pytest.raises(Exception) as caught:
        MappedModelStates(inner).load(os.fspath(path))
    assert inner.calls == [os.fspath(path)], "DeepSpeed's reader gets the file and raises its own error"
    assert caught.value is not None


def test_enable_leaves_an_unproven_deepspeed_alone(monkeypatch, caplog):
    """On a DeepSpeed version the hooks were not proven against, enable() says so and patches nothing."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    import pyckpt.deepspeed

    before = (DeepSpeedEngine.load_checkpoint, DeepSpeedZeroOptimizer_Stage3._load_universal_checkpoint)
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with caplog.at_level("WARNING", logger="pyckpt"):
        handle = pyckpt.deepspeed.enable()
    assert not handle and not pyckpt.deepspeed.enabled()
    assert "0.20.0" in caplog.text and "0.19.8" in caplog.text
    assert (DeepSpeedEngine.load_checkpoint, DeepSpeedZeroOptimizer_Stage3._load_universal_checkpoint) == before


def test_enable_and_disable_patch_and_restore_the_load_path():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import pyckpt.deepspeed

    before = (DeepSpeedEngine.load_checkpoint, DeepSpeedZeroOptimizer._load_universal_checkpoint)
    with pyckpt.deepspeed.enable() as handle:
        assert handle and pyckpt.deepspeed.enabled()
        assert getattr(DeepSpeedEngine.load_checkpoint, "__pyckpt__", False)
        assert getattr(DeepSpeedZeroOptimizer._load_universal_checkpoint, "__pyckpt__", False)
    assert not pyckpt.deepspeed.enabled()
    assert (DeepSpeedEngine.load_checkpoint, DeepSpeedZeroOptimizer._load_universal_checkpoint) == before
