"""Every class-level replacement pyckpt makes is one declared row (pyckpt/deepspeed/integrations/table.py) with the
versions it was proven on, applied by pyckpt/deepspeed/integrations/patching.py. A framework release that lacks what a
row replaces, or a version the rows were not proven on: the import of the framework's module succeeds, one warning
names the framework, its version and the cause, nothing of the framework is replaced, and asynchronous saves become
atomic while a framework above DeepSpeed is stock; ``PYCKPT_UNPROVEN_OK`` accepts an unproven version. Stand-in
modules play the releases; no job is launched."""

from __future__ import annotations

import ast
import importlib
import logging
import os
import pathlib
import sys
import types

import pytest

from pyckpt.deepspeed import settings
from pyckpt.deepspeed.integrations import accelerate_save, deepspeed_engine, lightning_save, patching, trainer_save
from pyckpt.deepspeed.integrations.table import PATCHES, ROWS

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "pyckpt"


@pytest.fixture
def async_mode():
    before, held = settings.set_save_mode("async"), settings.SETTINGS.save_held
    try:
        yield
    finally:
        settings.SETTINGS.save_held = held
        settings.set_save_mode(before)


_INSTALLED_VERSION = patching.version
_USER_ACCEPTS = os.environ.get(patching.UNPROVEN_OK)
_PROVEN = {row.framework: row.proven[0] for row in ROWS}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own first warning (a process warns once per cause), and every framework reports the
    version its rows were proven on, whatever is installed (the compatibility run installs newer ones), unless a
    test says otherwise; no version is accepted unproven."""
    monkeypatch.setattr(patching, "_WARNED", set())
    monkeypatch.setattr(patching, "version", lambda framework: _PROVEN.get(framework, "(version unknown)"))
    monkeypatch.delenv(patching.UNPROVEN_OK, raising=False)


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


def _warnings(caplog, part: str) -> list:
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


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
    lines = _warnings(caplog, missing)
    assert len(lines) == 1 and lines[0].startswith(f"pyckpt: {top} ") and "stays stock" in lines[0]
    assert "\n" not in lines[0]
    if owner is not None:
        assert dict(vars(owner)) == before
    assert settings.save_mode() == "atomic"  # a stock framework would not wait for a background write


def test_importing_a_framework_module_that_lacks_the_method_succeeds(tmp_path, monkeypatch, caplog, async_mode):
    """Through the import hook itself (the module imported after enable()): the import returns the module, stock;
    the Trainer's own methods and module names are those pyckpt's Trainer row looks up."""
    (tmp_path / "standin_trainer.py").write_text(
        "PREFIX_CHECKPOINT_DIR = 'checkpoint'\nTRAINER_STATE_NAME = 'trainer_state.json'\n"
        "def rotate_checkpoints(**kw):\n    pass\n"
        "class Trainer:\n    def train(self):\n        return 'stock train'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    row = trainer_save.ROW
    patch = patching.save_patch("the Trainer", patching.Row(row.framework, "standin_trainer", row.cls, row.replaces,
                                                            row.proven, row.needs))
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        patching.install_save_patch(patch)
        try:
            module = importlib.import_module("standin_trainer")
        finally:
            patch.uninstall()
            sys.modules.pop("standin_trainer", None)
    assert module.Trainer().train() == "stock train" and "_save_checkpoint" not in vars(module.Trainer)
    assert len(_warnings(caplog, "pyckpt: transformers 5.22.2: Trainer has no ")) == 1


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
        assert settings.save_mode() == "async"
    finally:
        trainer_save.uninstall()
    assert dict(vars(cls)) == before


def test_deepspeed_lacking_save_checkpoint_leaves_it_stock(monkeypatch, caplog):
    import deepspeed.runtime.engine as engine_module

    stand_in = type("DeepSpeedEngine", (), {"load_checkpoint": lambda self, *a, **k: None})
    monkeypatch.setattr(engine_module, "DeepSpeedEngine", stand_in)
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            assert deepspeed_engine.SAVE.install() is False
        finally:
            deepspeed_engine.SAVE.uninstall()
    assert "save_checkpoint" not in vars(stand_in)
    lines = _warnings(caplog, "DeepSpeedEngine has no save_checkpoint")
    assert len(lines) == 1 and lines[0].startswith("pyckpt: deepspeed 0.19.8: ")


def test_deepspeed_lacking_a_class_the_load_replaces_is_left_whole(monkeypatch, caplog):
    """The load rows find the three optimizers' classes and the engine's load first: one missing (the last
    here), none is replaced."""
    rows = deepspeed_engine.LOAD_ROWS + (patching.Row("deepspeed", "types", "NoSuchOptimizer",
                                                      deepspeed_engine.LOAD_ROWS[0].replaces, deepspeed_engine.PROVEN),)
    patch = patching.Patch("the accelerated universal load", rows, "DeepSpeed's own loader stays in place")
    from deepspeed.runtime.engine import DeepSpeedEngine

    before = dict(vars(DeepSpeedEngine))
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            assert patch.install() is False
            assert not patch.installed() and dict(vars(DeepSpeedEngine)) == before
        finally:
            patch.uninstall()
    assert len(_warnings(caplog, "pyckpt: deepspeed 0.19.8: types has no NoSuchOptimizer")) == 1


# --- every row of the table ---------------------------------------------------------------------------------------

def _complete_stand_ins(patch, without=None):
    """Stand-in modules for ``patch``'s rows, each class holding every attribute its row replaces and each module
    every name the row needs, but for ``without`` ((row, attribute)): (modules, classes)."""
    modules, classes = {}, []
    for row in patch.rows:
        module = modules.setdefault(row.module, _stand_in(row.module))
        for name in row.needs:
            setattr(module, name, lambda *a, **k: None)
        own = {name: (lambda self, *a, **k: "stock") for name in row.replaces
               if without is None or (row, name) != without}
        cls = type(row.cls, (), own)
        setattr(module, row.cls, cls)
        classes.append(cls)
    return modules, classes


def _row_cases():
    return [pytest.param(patch, row, name, id=f"{row.framework}-{row.cls}-{name}")
            for patch in PATCHES for row in patch.rows for name in row.replaces]


@pytest.mark.parametrize("patch, row, name", _row_cases())
def test_every_row_lacking_an_attribute_leaves_its_framework_stock_with_one_warning(caplog, async_mode, patch, row,
                                                                                    name):
    modules, classes = _complete_stand_ins(patch, without=(row, name))
    before = [dict(vars(cls)) for cls in classes]
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            assert patch.apply(modules) is False
            assert patch.apply(modules) is False  # warned once
        finally:
            patch.uninstall()
    assert [dict(vars(cls)) for cls in classes] == before, "no row of the framework's patch applied"
    lines = _warnings(caplog, f"{row.cls} has no {name}")
    assert len(lines) == 1 and lines[0].startswith(f"pyckpt: {row.framework} {patching.version(row.framework)}: ")
    if patch.on_stock is not None:
        assert settings.save_mode() == "atomic"


@pytest.mark.parametrize("patch", [pytest.param(p, id=p.framework + "-" + p.rows[0].cls) for p in PATCHES])
def test_an_unproven_version_leaves_the_framework_stock_unless_the_user_accepts_it(monkeypatch, caplog, async_mode,
                                                                                   patch):
    """Complete stand-ins, but the framework reports a version the rows were not proven on: nothing replaced, one
    warning naming the framework, that version, the proven one and the variable that accepts it; with
    PYCKPT_UNPROVEN_OK naming the framework the rows apply (one warning saying so) and come off whole again."""
    monkeypatch.setattr(patching, "version", lambda framework: "99.0.0")
    modules, classes = _complete_stand_ins(patch)
    before = [dict(vars(cls)) for cls in classes]
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            assert patch.apply(modules) is False
            assert patch.apply(modules) is False
        finally:
            patch.uninstall()
    assert [dict(vars(cls)) for cls in classes] == before
    lines = _warnings(caplog, "99.0.0")
    assert len(lines) == 1 and lines[0].startswith(f"pyckpt: {patch.framework} 99.0.0: ")
    assert f"proven on {patch.framework} {', '.join(patch.rows[0].proven)} only" in lines[0]
    assert f"PYCKPT_UNPROVEN_OK={patch.framework}" in lines[0]
    if patch.on_stock is not None:
        assert settings.save_mode() == "atomic"

    settings.SETTINGS.save_held = False
    caplog.clear()
    monkeypatch.setenv(patching.UNPROVEN_OK, f"peft, {patch.framework.upper()}")
    with caplog.at_level(logging.WARNING, logger="pyckpt"):
        try:
            assert patch.apply(modules) is True
            assert all(name in vars(cls) and vars(cls)[name] is not before[i][name]
                       for i, (row, cls) in enumerate(zip(patch.rows, classes)) for name in row.replaces)
        finally:
            patch.uninstall()
    assert [dict(vars(cls)) for cls in classes] == before
    accepted = _warnings(caplog, "99.0.0")
    assert len(accepted) == 1 and "applied all the same, as PYCKPT_UNPROVEN_OK asks" in accepted[0]
    assert settings.save_mode() == "async"


def test_pyckpt_unproven_ok_all_accepts_every_framework(monkeypatch):
    monkeypatch.setenv(patching.UNPROVEN_OK, "all")
    assert all(patching.unproven_accepted(row.framework) for row in ROWS)
    monkeypatch.setenv(patching.UNPROVEN_OK, "transformers")
    assert patching.unproven_accepted("transformers") and not patching.unproven_accepted("deepspeed")


def test_the_rows_are_every_class_attribute_enable_replaces(monkeypatch, async_mode):
    """enable(save="async") on the real frameworks: every attribute it changes on a class of the frameworks'
    modules is a declared row's, every row's attribute is changed, and disable() puts every class back."""
    import pyckpt.deepspeed as pd

    monkeypatch.setattr(patching, "version", _INSTALLED_VERSION)  # the frameworks as installed, as a user has them
    if _USER_ACCEPTS is not None:
        monkeypatch.setenv(patching.UNPROVEN_OK, _USER_ACCEPTS)
    names = sorted({row.module for row in ROWS})
    modules = [importlib.import_module(name) for name in names]
    classes = {(m.__name__, n): c for m in modules for n, c in vars(m).items() if isinstance(c, type)}
    before = {key: dict(vars(cls)) for key, cls in classes.items()}
    settings.set_save_mode(None)
    with pd.enable(save="async"):
        changed = {(module, cls, attr) for (module, cls), klass in classes.items()
                   for attr in set(vars(klass)) | set(before[(module, cls)])
                   if vars(klass).get(attr) is not before[(module, cls)].get(attr)}
    declared = set()
    for row in ROWS:  # a class imported into another module changes there too
        declared |= {(module, cls, attr) for (module, cls), klass in classes.items()
                     if klass is classes[(row.module, row.cls)] for attr in row.replaces}
    assert changed == declared
    assert {key: dict(vars(cls)) for key, cls in classes.items()} == before


_FRAMEWORKS = ("deepspeed", "transformers", "accelerate", "lightning", "trl", "peft")


def _class_writes(tree: ast.AST):
    """Lines of ``tree`` that write an attribute of a framework's object (a name imported from a framework) or of
    a class (``cls``, ``type(...)``): assignments and ``setattr``/``delattr`` calls."""
    framework_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _FRAMEWORKS:
            framework_names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            framework_names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                                if alias.name.split(".")[0] in _FRAMEWORKS}

    def classy(expr) -> bool:
        return (isinstance(expr, ast.Name) and (expr.id in framework_names or expr.id == "cls")) or \
            (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "type")

    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Attribute) and classy(t.value) for t in targets):
            yield node.lineno
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr") and node.args and classy(node.args[0]):
            yield node.lineno


def test_only_the_patch_machinery_writes_a_framework_class():
    """A new replacement cannot bypass the table: outside integrations/patching.py (which writes what rows
    declare) no module of the package assigns, sets or deletes an attribute of a framework's class."""
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "deepspeed" / "integrations" / "patching.py"
             for line in _class_writes(ast.parse(path.read_text()))]
    assert found == []
    assert list(_class_writes(ast.parse("from deepspeed.runtime.engine import DeepSpeedEngine as E\n"
                                        "E.save_checkpoint = None\nsetattr(cls, 'x', 1)\n"))) == [2, 3]
    assert len(list(_class_writes(ast.parse((PACKAGE / "deepspeed" / "integrations" / "patching.py")
                                            .read_text())))) >= 2


def test_the_rows_claim_the_versions_the_suite_runs():
    """A row's proven versions are the pins the suite tests with (constraints.txt): a pin moved without the rows
    would leave that framework stock in every test, and rows claiming a version no test ran would be unproven."""
    pins = dict(line.split("==", 1) for line in (PACKAGE.parent / "constraints.txt").read_text().split()
                if "==" in line and not line.startswith("#"))
    assert {row.framework: row.proven for row in ROWS} == {name: (pins[name], ) for name in _PROVEN}
