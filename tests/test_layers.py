"""The package's layers import only downward (README, Development): errors, the tensor vocabulary, the native boundary,
byte formats, plans, Hugging Face and DeepSpeed rules, execution, the capabilities, then the command lines. Only
pyckpt/native.py imports the native module itself."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "pyckpt"
LAYERS = ["errors", "tensors", "native", "formats", "planning", "huggingface", "deepspeed", "execution"]  # then capabilities, command lines
# What a user runs (the cli* modules, and the command lines older than pyckpt/cli.py). Anything else
# at the top level is a capability, which must not depend on how it is invoked.
COMMAND_LINES = {"convert", "clean", "demo", "__main__"}


def _layer(module: str) -> int:
    top = module.split(".")[0]
    if top in LAYERS:
        return LAYERS.index(top)
    return len(LAYERS) + (top in COMMAND_LINES or top == "cli" or top.startswith("cli_"))


def _outside_main_stanza(text: str) -> str:
    """The source without its `if __name__ == "__main__":` blocks: a module run as a program is at
    the top of the stack (python -m pyckpt.verify starts the command line that calls verify)."""
    return re.sub(r'^if __name__ == "__main__":\n(?:[ \t]+.*\n|[ \t]*\n)*', "", text, flags=re.M)


def _imports(path: pathlib.Path, module: str):
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


def test_command_lines_are_the_top_layer():
    assert _layer("cli") == _layer("cli_common") == _layer("convert") == _layer("__main__") == len(LAYERS) + 1
    assert _layer("universal") == _layer("verify") == _layer("inspect") == len(LAYERS)
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
        if module == "errors" or _layer(module) > len(LAYERS):
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
