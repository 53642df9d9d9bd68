"""The package's floors import only downward (README, Development): the vocabulary (errors, tensors, the native
door), byte formats, plans and the logical state, execution, then one folder per checkpoint format (reading ZeRO,
the Universal Checkpoint layout, Hugging Face), the DeepSpeed integration, and on top the front ends. Only
pyckpt/native.py imports the native module itself."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "pyckpt"
VOCABULARY = ["errors", "tensors", "native"]
FOLDERS = ["formats", "planning", "execution", "zero", "universal", "huggingface", "dcp", "deepspeed",
           "testing"]  # synthetic checkpoints for tests and benchmarks: nothing in the library imports them
LAYERS = VOCABULARY + FOLDERS  # then the front ends
# What a user runs: `python -m pyckpt.NAME` (argparse, then one library call) and the `pyckpt` console
# script with its shared plumbing (pyckpt.cli).
FRONT_ENDS = {"convert", "export", "verify", "describe", "clean", "demo", "cli", "__main__"}


def _layer(module: str) -> int:
    top = module.split(".")[0]
    if top in LAYERS:
        return LAYERS.index(top)
    assert top in FRONT_ENDS, f"pyckpt.{top} is neither a floor nor a front end"
    return len(LAYERS)


def _outside_main_stanza(text: str) -> str:
    """The source without its `if __name__ == "__main__":` blocks: a module run as a program is at
    the top of the stack (python -m pyckpt.verify starts the command line that calls verify)."""
    return re.sub(r'^if __name__ == "__main__":\n(?:[ \t]+.*\n|[ \t]*\n)*', "", text, flags=re.M)


def _imports(path: pathlib.Path, module: str):
    if path.name == "__init__.py":
        package = module.split(".") if module else []
    else:
        package = module.rpartition(".")[0].split(".") if "." in module else []
    text = _outside_main_stanza(path.read_text())
    for m in re.finditer(r"^\s*from (\.+)([A-Za-z_0-9.]*) import ([A-Za-z_0-9, ()]+)", text, re.M):
        dots, name, names = m.groups()
        base = package[:len(package) - (len(dots) - 1)] if len(dots) > 1 else package
        if name:
            yield ".".join(base + [name])
        else:  # from . import x, y
            for item in names.strip("()").split(","):
                yield ".".join(base + [item.strip().split(" ")[0]])


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        module = str(path.relative_to(ROOT))[:-3].replace("/", ".")
        if module.endswith("__init__"):
            module = module[:-len(".__init__")] if "." in module else ""
        yield path, module


def test_every_import_points_down_a_layer_or_within_one():
    upward = [(module, target) for path, module in _modules() if module
              for target in _imports(path, module) if target != "_core" and _layer(target) > _layer(module)]
    assert upward == []


def test_only_the_native_boundary_imports_the_native_module():
    direct = [module for path, module in _modules()
              if re.search(r"^\s*from \.+ import _core|^\s*import pyckpt\._core", path.read_text(), re.M)]
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
    # The stanza rule must not hide anything but the stanza.
    text = 'from .a import b\nif __name__ == "__main__":\n    from .c import d\n\n    main()\nfrom .e import f\n'
    assert _outside_main_stanza(text) == "from .a import b\nfrom .e import f\n"


def test_every_library_exception_lives_in_errors_and_is_exported():
    """One home for what pyckpt raises on purpose: every error class of the library (``*Error``) is
    defined in pyckpt/errors.py, derives from PyckptError and is exported by the package. The
    command lines keep their own usage errors, and the signals planners pass to their callers
    (``NotACopy``, ``Unsupported``) are not errors."""
    import inspect

    import pyckpt
    from pyckpt import errors

    elsewhere = []
    for path, module in _modules():
        if not module or module == "errors" or _layer(module) >= len(LAYERS):
            continue
        for m in re.finditer(r"^class ([A-Za-z]\w*Error)\(([^)]*)\):", path.read_text(), re.M):
            if re.search(r"Error|Exception", m.group(2)):
                elsewhere.append(f"{module}.{m.group(1)}")
    assert elsewhere == []
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, Exception)]
    assert len(classes) >= 17
    for cls in classes:
        assert issubclass(cls, errors.PyckptError), cls
        assert cls.__name__ in pyckpt.__all__ and getattr(pyckpt, cls.__name__) is cls, cls
