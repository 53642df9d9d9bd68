"""The package's floors import only downward (docs/architecture.md, "The package, by floor"): the vocabulary
(errors, tensors, the native door), byte formats, plans and the logical state, execution, then one folder per
checkpoint format (reading ZeRO, the Universal Checkpoint layout, Hugging Face, DCP), the DeepSpeed integration,
and on top the front ends. Only pyckpt/native.py imports the native module itself."""

import ast
import builtins
import importlib
import inspect
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "pyckpt"
VOCABULARY = ["errors", "tensors", "native"]
FOLDERS = ["formats", "planning", "execution", "zero", "universal", "huggingface", "dcp", "inputs", "deepspeed",
           "testing"]  # synthetic checkpoints for tests and benchmarks: nothing in the library imports them
LAYERS = VOCABULARY + FOLDERS  # then the front ends
# What a user runs: `python -m pyckpt.NAME` (argparse, then one library call) and the `pyckpt` console
# script with its shared plumbing (pyckpt.cli).
FRONT_ENDS = {"convert", "export", "verify", "describe", "demo", "cli", "__main__"}


def _layer(module: str) -> int:
    if module == "":
        return len(LAYERS)  # the package itself, whose names reach every floor and the front ends
    top = module.split(".")[0]
    if top in LAYERS:
        return LAYERS.index(top)
    assert top in FRONT_ENDS, f"pyckpt.{top} is neither a floor nor a front end"
    return len(LAYERS)


def _is_main_stanza(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``: a module run as a program is at the top of the stack (python -m
    pyckpt.verify starts the command line that calls verify), so what that block imports does not count."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq) and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _imports_in(source: str, module: str, package: bool = False):
    """The pyckpt modules, named inside the package ("zero.read", "errors"; "" for the package itself),
    that ``source`` imports as module ``module`` (``package``: its ``__init__``): relative and absolute
    (``from pyckpt.x import y``, ``import pyckpt.x``), at the top or inside a function, outside its
    ``__main__`` stanza. ``from X import a, b`` counts X, and a and b too where X is a package folder
    named by ``from . import a`` or ``from pyckpt import a``."""
    here = module.split(".") if module else []
    if not package:
        here = here[:-1]
    for stmt in ast.parse(source).body:
        if _is_main_stanza(stmt):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "pyckpt":
                        yield ".".join(parts[1:])
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                named = node.module.split(".") if node.module else []
            elif node.module and node.module.split(".")[0] == "pyckpt":
                base, named = [], node.module.split(".")[1:]
            else:
                continue  # outside the package
            if named:
                yield ".".join(base + named)
            else:  # from . import x, y / from pyckpt import x, y
                for alias in node.names:
                    yield ".".join(base + [alias.name])


def _imports(path: pathlib.Path, module: str):
    return _imports_in(path.read_text(), module, path.name == "__init__.py")


def _upward(module: str, targets) -> list:
    """(module, target) for each import of ``targets`` that reaches a higher floor than ``module``'s."""
    return [(module, target) for target in targets if target != "_core" and _layer(target) > _layer(module)]


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        module = str(path.relative_to(ROOT))[:-3].replace("/", ".")
        if module.endswith("__init__"):
            module = module[:-len(".__init__")] if "." in module else ""
        yield path, module


def test_every_import_points_down_a_layer_or_within_one():
    upward = [pair for path, module in _modules() if module for pair in _upward(module, _imports(path, module))]
    assert upward == []


def test_the_import_reader_sees_absolute_relative_and_lazy_imports():
    """An import is an import however it is spelt: an absolute upward one is caught like a relative one."""
    source = textwrap.dedent('''
        """Module docstring: from pyckpt.deepspeed import enable is no import."""
        import os
        import pyckpt.dcp.export as dcp_export
        from pyckpt.deepspeed.load import enable
        from pyckpt import convert, errors
        from ..huggingface import export
        from . import names, shards
        from .shards import Step


        def late():
            from ..execution.executor import run
            import pyckpt.planning.plan


        if __name__ == "__main__":
            from pyckpt.cli import main
        ''')
    found = list(_imports_in(source, "zero.read"))
    assert found == ["dcp.export", "deepspeed.load", "convert", "errors", "huggingface", "zero.names", "zero.shards",
                     "zero.shards", "execution.executor", "planning.plan"]
    assert _upward("zero.read", found) == [("zero.read", "dcp.export"), ("zero.read", "deepspeed.load"),
                                           ("zero.read", "convert"), ("zero.read", "huggingface")]
    assert _upward("zero.read", _imports_in("from pyckpt.universal.write import universal_plan\n", "zero.read")) \
        == [("zero.read", "universal.write")]
    # A package's __init__ resolves relative imports from itself, a module from its package.
    assert list(_imports_in("from .read import x\nfrom .. import tensors\n", "zero", package=True)) == \
        ["zero.read", "tensors"]
    assert list(_imports_in("from . import _core\nimport pyckpt\n", "native")) == ["_core", ""]
    # The stanza rule hides the stanza and nothing else.
    text = 'from .a import b\nif __name__ == "__main__":\n    from .c import d\n\n    main()\nfrom .e import f\n'
    assert list(_imports_in(text, "verify")) == ["a", "e"]


def test_only_the_native_boundary_imports_the_native_module():
    direct = [module for path, module in _modules()
              if any(t == "_core" or t.startswith("_core.") for t in _imports(path, module))]
    assert direct == ["native"]


def _cycle(graph):
    """One import cycle in ``graph`` (module -> modules it imports), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_cycles_between_modules():
    """Lazy imports inside functions count: a cycle hidden in a function is still a cycle of concerns."""
    modules = {module for _, module in _modules() if module}
    graph = {module: {t for t in _imports(path, module) if t in modules and t != module}
             for path, module in _modules() if module}
    assert _cycle(graph) is None


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_top_level_holds_only_front_ends_and_vocabulary():
    """A top-level module is a front end or basic vocabulary; everything else lives in a folder."""
    top = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert top == (FRONT_ENDS - {"cli"}) | set(VOCABULARY)
    assert folders == set(FOLDERS) | {"cli"}


def test_every_folder_states_its_import_rule():
    missing = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("__init__.py"))
               if p.parent != ROOT and "Import rule" not in p.read_text()]
    assert missing == []


def test_the_load_backend_and_the_save_glue_stay_apart():
    """Siblings on the integration floor: a load never runs save code, nor a save the load backend."""
    crossing = [(module, target) for path, module in _modules()
                for side, other in (("deepspeed.load", "deepspeed.save"), ("deepspeed.save", "deepspeed.load"))
                if module.startswith(side) for target in _imports(path, module) if target.startswith(other)]
    assert crossing == []


def test_the_synthetic_checkpoint_writer_reads_no_checkpoint():
    """pyckpt.testing writes DeepSpeed's files through the executor; were it to use the readers,
    a reader's mistake could shape the very inputs that test it."""
    readers = [(module, target) for path, module in _modules() if module.startswith("testing")
               for target in _imports(path, module)
               if target.split(".")[0] in ("zero", "universal", "huggingface", "deepspeed")]
    assert readers == []


def test_front_ends_are_the_top_layer():
    assert _layer("cli") == _layer("cli.common") == _layer("convert") == _layer("__main__") == len(LAYERS)
    assert _layer("export") == _layer("verify") == _layer("describe") == len(LAYERS)
    assert _layer("universal.verify") < _layer("huggingface.export") < _layer("deepspeed.save") < len(LAYERS)
    with pytest.raises(AssertionError):
        _layer("universal_plan")  # a stray top-level module is neither


# The exception classes the library defines outside errors.py: signals that never leave it, each
# caught by its callers. A planner's slice that is no copy (NotACopy), a load the backend hands back to
# DeepSpeed (Unsupported), a pointer file that stops pruning (PointerUnreadable, an OSError its callers
# catch as one), a pickle value the safe reader rejects, a replica peer's closed stream or refusal.
SIGNALS = {"universal.restore_meta.NotACopy", "deepspeed.load.unsupported.Unsupported",
           "deepspeed.save.retention.PointerUnreadable", "formats.pickle_read._BadData",
           "deepspeed.tiers.replica_protocol._Closed", "deepspeed.tiers.replica_protocol._Refusal",
           "dcp.tiling.LayoutTooIrregular"}


def _resolve(expr: ast.expr, namespace: dict):
    """The object a class statement's base (``Name`` or ``a.b.Name``) is in ``namespace``, or None."""
    if isinstance(expr, ast.Name):
        return namespace[expr.id] if expr.id in namespace else getattr(builtins, expr.id, None)
    if isinstance(expr, ast.Attribute):
        owner = _resolve(expr.value, namespace)
        return getattr(owner, expr.attr, None) if owner is not None else None
    return None


def _exception_classes(source: str, namespace: dict) -> list:
    """The names of the exception classes that ``source`` defines, whatever they are called: every
    class statement (at the top, in a function, in a class) with a base that is an exception in
    ``namespace`` (the module's, once imported; else the builtins) or another such class of ``source``."""
    classes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    found = []
    grew = True
    while grew:  # a class may derive from one defined further down (in a function)
        grew = False
        for node in classes:
            if node.name in found:
                continue
            for base in node.bases:
                obj = _resolve(base, namespace)
                if (isinstance(base, ast.Name) and base.id in found) or \
                        (inspect.isclass(obj) and issubclass(obj, BaseException)):
                    found.append(node.name)
                    grew = True
                    break
    return found


def test_the_exception_finder_goes_by_base_not_by_name():
    import pickle

    source = textwrap.dedent('''
        class Quiet(Exception):
            pass


        class Plain:
            pass


        class Refused(pickle.UnpicklingError):
            pass


        def f():
            class Inner(OSError):
                pass

            class Deeper(Inner):
                pass
        ''')
    assert _exception_classes(source, {"pickle": pickle}) == ["Quiet", "Refused", "Inner", "Deeper"]
    retention = importlib.import_module("pyckpt.deepspeed.save.retention")
    assert "PointerUnreadable" in _exception_classes(pathlib.Path(retention.__file__).read_text(), vars(retention))


def test_every_library_exception_lives_in_errors_and_is_exported():
    """One home for what pyckpt raises on purpose: every exception class of the library, whatever its
    name, is defined in pyckpt/errors.py, derives from PyckptError and is exported by the package;
    the only others are the signals listed in SIGNALS, which never leave the library. The command
    lines keep their own usage errors."""
    import pyckpt
    from pyckpt import errors

    elsewhere = []
    for path, module in _modules():
        if module == "errors" or (module and _layer(module) >= len(LAYERS)):
            continue
        mod = importlib.import_module(f"pyckpt.{module}" if module else "pyckpt")
        elsewhere.extend(f"{module}.{name}" if module else name
                         for name in _exception_classes(path.read_text(), vars(mod)))
    assert sorted(elsewhere) == sorted(SIGNALS)
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, Exception)]
    assert len(classes) >= 17
    for cls in classes:
        assert issubclass(cls, errors.PyckptError), cls
        assert cls.__name__ in pyckpt.__all__ and getattr(pyckpt, cls.__name__) is cls, cls
