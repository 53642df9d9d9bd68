"""The package's layers import only downward (README, Development): errors and the native boundary,
byte formats, plans, DeepSpeed rules, execution, then the capabilities and command lines. Only
pyckpt/native.py imports the native module itself."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "pyckpt"
LAYERS = ["errors", "native", "formats", "planning", "deepspeed", "execution"]  # anything else: capabilities


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else len(LAYERS)


def _imports(path: pathlib.Path, module: str):
    package = module.rpartition(".")[0].split(".") if "." in module else []
    for m in re.finditer(r"^\s*from (\.+)([A-Za-z_0-9.]*) import ([A-Za-z_0-9, ()]+)", path.read_text(), re.M):
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
