"""The universal load's model-state file reader (pyckpt/deepspeed/load/model_state_file.py): one
weights-only memory-mapped read per path with pyckpt's allowlist, a refusal naming the file for
anything else (DeepSpeed's own reader only for a trusted checkpoint), other files untouched; the
check before a universal load goes back to DeepSpeed's unpickling loader (pickle_policy, hooks); and
enable()/disable() patching DeepSpeed only on the version the hooks were proven against, restoring it
exactly."""

from __future__ import annotations

import collections
import os

import pytest
import torch

from pyckpt.errors import CheckpointFormatError, UnsafePickleError
from pyckpt.deepspeed.load.model_state_file import MappedModelStates
from pyckpt.deepspeed.load.pickle_policy import allowed_globals


class Recorder:
    """A checkpoint engine that records what reaches it (DeepSpeed's reader, in a real load)."""

    def __init__(self):
        self.calls = []
        self.name = "recorder"

    def load(self, path, map_location=None):
        self.calls.append(path)
        return torch.load(path, map_location=map_location, weights_only=False)


RAN = []  # what unpickling a UserObject did; it must stay empty where pyckpt refuses the file


class UserObject:  # what a client_state may hold; torch's weights-only reader refuses it
    def __init__(self, value):
        self.value = value

    def __setstate__(self, state):
        RAN.append(state)
        self.__dict__.update(state)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_model_state_file_is_mapped_once_and_its_module_not_read(tmp_path):
    path = os.fspath(tmp_path / "mp_rank_00_model_states.pt")
    module = collections.OrderedDict(w=torch.arange(4 << 20, dtype=torch.float32))  # 16 MiB
    torch.save({"module": module, "global_steps": 3, "param_shapes": [{"w": torch.Size([4 << 20])}]}, path)
    inner = Recorder()
    engine = MappedModelStates(inner)
    allowed_globals()  # its first call imports the modules of the allowlist: their source is read
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


def test_a_file_off_the_allowlist_is_refused_and_nothing_in_it_runs(tmp_path):
    path = os.fspath(tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"module": {}, "my_state": UserObject(7)}, path)
    inner = Recorder()
    engine = MappedModelStates(inner)
    RAN.clear()
    with pytest.raises(UnsafePickleError) as caught:
        engine.load(path)
    message = str(caught.value)
    assert path in message and "UserObject" in message and "trust_pickles=True" in message
    assert RAN == [] and inner.calls == [] and engine.mapped == [] and engine.refused == []


def test_a_trusted_file_off_the_allowlist_goes_to_deepspeeds_reader(tmp_path, caplog):
    path = os.fspath(tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"module": {}, "my_state": UserObject(7)}, path)
    inner = Recorder()
    engine = MappedModelStates(inner, trust_pickles=True)
    with caplog.at_level("WARNING", logger="pyckpt"):
        state = engine.load(path)
    assert state["my_state"].value == 7
    assert inner.calls == [path] and engine.refused == [path] and engine.mapped == []
    assert path in caplog.text and "DeepSpeed's own loader" in caplog.text


def test_allowlisted_objects_and_legacy_files_are_read_here(tmp_path):
    """Megatron-style ``args`` (argparse.Namespace) and DeepSpeed's loss scaler in a client_state,
    and a file in torch's pre-zip format (read without a mapping), never reach DeepSpeed's reader."""
    import argparse

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    state = {"module": {}, "args": argparse.Namespace(lr=0.5, layers=[1, 2]), "scaler": DynamicLossScaler(8, 1000, 1, False, True)}
    zipped, legacy = os.fspath(tmp_path / "a_model_states.pt"), os.fspath(tmp_path / "b_model_states.pt")
    torch.save(state, zipped)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    inner = Recorder()
    engine = MappedModelStates(inner)
    for path in (zipped, legacy):
        got = engine.load(path)
        assert got["args"] == state["args"] and got["scaler"].cur_scale == 8
    assert inner.calls == [] and engine.mapped == [zipped, legacy]


def test_other_files_are_not_intercepted(tmp_path):
    path = os.fspath(tmp_path / "optim_states.pt")
    torch.save({"x": 1}, path)
    inner = Recorder()
    assert MappedModelStates(inner).load(path) == {"x": 1}
    assert inner.calls == [path]


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, 0.999, 100])
def test_a_damaged_model_state_file_fails_naming_it(tmp_path, keep):
    """Cut anywhere, the file fails with one line naming it and the rule broken (torch's reader says
    a bare ``OSError: [Errno 22] Invalid argument`` or ``EOFError`` for some cuts)."""
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.randn(256, 64)}, "global_steps": 1, "lr": torch.ones(4)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    inner = Recorder()
    with pytest.raises(CheckpointFormatError) as caught:
        MappedModelStates(inner).load(os.fspath(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert "Errno" not in message and "ZIP" in message
    assert inner.calls == [], "no unpickler of DeepSpeed's gets a file pyckpt could not read"


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


def test_a_direct_resume_refuses_an_unproven_deepspeed(monkeypatch, tmp_path, caplog):
    """load_checkpoint straight from ZeRO shards has no DeepSpeed loader to leave the load to: on a
    version the hooks were not proven against it raises, naming the proven one, and patches nothing."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    import pyckpt.deepspeed
    from pyckpt.errors import UnsupportedCheckpointError

    tag = tmp_path / "global_step3"
    tag.mkdir()
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step3")
    before = DeepSpeedEngine.load_checkpoint
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with caplog.at_level("WARNING", logger="pyckpt"), pytest.raises(UnsupportedCheckpointError, match="0.19.8"):
        pyckpt.deepspeed.load_checkpoint(object(), tmp_path)
    assert DeepSpeedEngine.load_checkpoint is before and not pyckpt.deepspeed.enabled()


def _file_mappings(path):
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(os.path.realpath(path)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def test_what_deepspeed_hands_on_is_copied_out_of_the_mapping(tmp_path):
    """client_state and scheduler tensors outlive the load (DeepSpeed returns or keeps them): they
    must not be pages of the file, which a later save to the same tag may rewrite in place (a read
    of a truncated mapping faults). The module weights, never applied, stay mapped."""
    path = os.fspath(tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"module": collections.OrderedDict(w=torch.ones(1 << 20)), "lr_scheduler": {"lrs": [torch.tensor(0.5)]},
                "trainer": {"rng": torch.arange(4096), "nested": (torch.ones(3), [torch.zeros(2)])}}, path)
    state = MappedModelStates(Recorder()).load(path)
    maps = _file_mappings(path)

    def mapped(t):
        return any(lo <= t.data_ptr() < hi for lo, hi in maps)

    assert mapped(state["module"]["w"]), "the module stays in the mapping (else this check proves nothing)"
    for t in (state["trainer"]["rng"], state["trainer"]["nested"][0], state["trainer"]["nested"][1][0],
              state["lr_scheduler"]["lrs"][0]):
        assert not mapped(t)
    assert torch.equal(state["trainer"]["rng"], torch.arange(4096)) and isinstance(state["trainer"]["nested"], tuple)
