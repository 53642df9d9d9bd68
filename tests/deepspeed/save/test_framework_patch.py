"""A framework release that lacks what pyckpt replaces (pyckpt/deepspeed/framework_patch.py and its users): the
import of the framework's module succeeds, one warning names the framework, its version and the attribute,
nothing of the framework is replaced, and asynchronous saves become atomic while it is stock. Stand-in modules
play the release that renamed ``Trainer._save_checkpoint`` (or lost a class); no job is launched."""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest

from pyckpt.deepspeed import accelerate_save, lightning_save, trainer_save
from pyckpt.deepspeed.save import engine_hook


@pytest.fixture
def async_mode():
    before, held = engine_hook.set_mode("async"), engine_hook._MODE["held"]
    try:
        yield
    finally:
        engine_hook._MODE["held"] = held
        engine_hook.set_mode(before)


def _stand_in(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


class _Trainer:
    """transformers' Trainer after a release renamed _save_checkpoint."""

    def train(self):
        return "stock train"

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        return "stock"

    def _finalize_training(self, *args, **kwargs):
        return "stock"

    def _save_model_checkpoint(self, model, trial):
        return "renamed"


def _trainer_module():
    return _stand_in("transformers.trainer", Trainer=_Trainer, PREFIX_CHECKPOINT_DIR="checkpoint",
                     TRAINER_STATE_NAME="trainer_state.json", rotate_checkpoints=lambda **kw: None)


@pytest.mark.parametrize("framework", ["trainer", "accelerate", "lightning"])
def test_a_framework_lacking_what_pyckpt_replaces_stays_stock_with_one_warning(monkeypatch, caplog, async_mode,
                                                                              framework):
    """Each framework hook installed on a module already loaded, as enable(save=...) installs it: no exception,
    one warning (the framework, its version, what is missing), the class as it was, saves held atomic."""
    if framework == "trainer":
        module, install, uninstall = _trainer_module(), trainer_save.install, trainer_save.uninstall
        missing, owner = "Trainer has no _save_checkpoint", _Trainer
    elif framework == "accelerate":
        owner = type("Accelerator", (), {"load_state": lambda self: None})
        module = _stand_in("accelerate.accelerator", Accelerator=owner)
        install, uninstall, missing = accelerate_save.install, accelerate_save.uninstall, "has no save_state"
    else:
        module, owner = _stand_in(lightning_save.MODULE), None  # its DeepSpeedStrategy gone
        install, uninstall, missing = lightning_save.install, lightning_save.uninstall, "has no DeepSpeedStrategy"
    before = dict(vars(owner)) if owner is not None else None
    monkeypatch.setitem(sys.modules, module.__name__, module)
    top = module.__name__.split(".")[0]
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            install()
            install()  # warned once
        finally:
            uninstall()
    lines = [r.getMessage() for r in caplog.records if missing in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"pyckpt: {top} ") and "stays stock" in lines[0]
    assert "\n" not in lines[0]
    if owner is not None:
        assert dict(vars(owner)) == before
    assert engine_hook.mode() == "atomic"  # a stock framework would not wait for a background write


def test_importing_a_framework_module_that_lacks_the_method_succeeds(tmp_path, monkeypatch, caplog, async_mode):
    """Through the import hook itself (the module imported after enable()): the import returns the module, stock;
    the Trainer's own methods and module names are those pyckpt's Trainer patch looks up."""
    (tmp_path / "standin_trainer.py").write_text(
        "PREFIX_CHECKPOINT_DIR = 'checkpoint'\nTRAINER_STATE_NAME = 'trainer_state.json'\n"
        "def rotate_checkpoints(**kw):\n    pass\n"
        "class Trainer:\n    def train(self):\n        return 'stock train'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = trainer_save.MethodOnImport("standin_trainer", "Trainer", trainer_save._TRAINER.wraps,
                                       trainer_save._TRAINER.needs)
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        hook.install()
        try:
            module = importlib.import_module("standin_trainer")
        finally:
            hook.uninstall()
            sys.modules.pop("standin_trainer", None)
    assert module.Trainer().train() == "stock train" and "_save_checkpoint" not in vars(module.Trainer)
    assert any("standin_trainer (version unknown): Trainer has no " in r.getMessage() for r in caplog.records)


def test_a_trainer_with_every_method_is_patched_and_put_back(monkeypatch, async_mode):
    """The same stand-in with _save_checkpoint: every method replaced, all put back by uninstall."""
    cls = type("Trainer", (_Trainer,), {"_save_checkpoint": lambda self, model, trial: "stock save"})
    module = _trainer_module()
    module.Trainer = cls
    monkeypatch.setitem(sys.modules, "transformers.trainer", module)
    before = dict(vars(cls))
    trainer_save.install()
    try:
        assert all(name in vars(cls) and vars(cls)[name] is not getattr(_Trainer, name, None)
                   for name in ("train", "_maybe_log_save_evaluate", "_finalize_training"))
        assert vars(cls)["_save_checkpoint"].__pyckpt_hooked__
        assert engine_hook.mode() == "async"
    finally:
        trainer_save.uninstall()
    assert dict(vars(cls)) == before


def test_deepspeed_lacking_save_checkpoint_leaves_it_stock(monkeypatch, caplog):
    import deepspeed.runtime.engine as engine_module

    stand_in = type("DeepSpeedEngine", (), {"load_checkpoint": lambda self, *a, **k: None})
    monkeypatch.setattr(engine_module, "DeepSpeedEngine", stand_in)
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            assert engine_hook.install() is False
        finally:
            engine_hook.uninstall()
    assert "save_checkpoint" not in vars(stand_in)
    assert any("pyckpt: deepspeed " in r.getMessage() and "DeepSpeedEngine has no save_checkpoint" in r.getMessage()
               for r in caplog.records)


def test_deepspeed_lacking_a_class_the_load_replaces_is_left_whole(monkeypatch, caplog):
    """The load hooks find the three optimizers' classes and the engine's load first: one missing (the last
    here), none is replaced."""
    from pyckpt.deepspeed.load import hooks

    targets = dict(hooks._TARGETS)
    targets[("types", "NoSuchOptimizer")] = targets[next(iter(targets))]
    monkeypatch.setattr(hooks, "_TARGETS", targets)
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            assert hooks.install() is False
            assert not hooks.installed() and not hooks._ENGINE_ORIGINAL
        finally:
            hooks.uninstall()
    assert any("pyckpt: deepspeed " in r.getMessage() and "types has no NoSuchOptimizer" in r.getMessage()
               for r in caplog.records)
