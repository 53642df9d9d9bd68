"""The native module's test hooks (pyckpt._core.testing) are in the test build only.

CMakeLists.txt's option PYCKPT_TESTING (default OFF) compiles csrc/bindings/register_testing.cpp and its
registration; scripts/setup.sh turns it on for the test extras and scripts/sanitize.sh for the sanitizer
build, while a plain `pip install .` leaves it off. The fast checks hold the installed test build to having
the hooks and the library to never needing them; the slow one builds the release module with the compiler
and flags of CMakeLists.txt into a scratch folder and looks at what it registers, then configures the same
folder with the option and compiles what the option changes, by the commands CMake gives for them.
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

from native_hooks import HOOKS, hooks

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_installed_test_build_has_the_hooks():
    testing = hooks()
    assert all(callable(getattr(testing, name, None)) for name in HOOKS), dir(testing)


def test_the_library_never_uses_the_hooks():
    """A release build (no pyckpt._core.testing) must do everything pyckpt does: only tests reach them."""
    users = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "pyckpt").rglob("*.py"))
             if "_core.testing" in p.read_text() or any(name in p.read_text() for name in HOOKS)]
    assert users == []


# -- a release build, made here ---------------------------------------------------------------------

REGISTERED = """
import sys
sys.path.insert(0, sys.argv[1])
import _core
print(_core.__file__)
print(hasattr(_core, "write_archives"), hasattr(_core, "testing"))
"""


def _configure(build: pathlib.Path, *defines: str) -> dict:
    """Configures ``build``; returns each source's compile command (CMAKE_EXPORT_COMPILE_COMMANDS, which changes
    no flag): source path relative to ROOT -> (folder, argv)."""
    cmake = shutil.which("cmake")
    assert cmake, "cmake not found: building the native module needs it (as scripts/sanitize.sh does)"
    try:
        import pybind11
    except ImportError:
        pytest.fail("pybind11 is not installed here: scripts/setup.sh installs it with the test extras", pytrace=False)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # Release, as pyproject.toml's [tool.scikit-build] cmake.build-type; CMakeLists.txt adds the rest.
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                    "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", *defines], check=True, capture_output=True, text=True,
                   timeout=300)
    entries = json.loads((build / "compile_commands.json").read_text())
    return {str(pathlib.Path(e["file"]).resolve().relative_to(ROOT)):
            (e["directory"], e["arguments"] if "arguments" in e else shlex.split(e["command"])) for e in entries}


def _build(build: pathlib.Path) -> pathlib.Path:
    # The module target alone, on every core the machine has.
    subprocess.run([shutil.which("cmake"), "--build", str(build), "--target", "_core", "-j", str(os.cpu_count() or 1)],
                   check=True, capture_output=True, text=True, timeout=600)
    (module,) = build.glob("_core*.so")
    return module


def _registered(module: pathlib.Path):
    """(a working module, has pyckpt._core.testing, the hooks' names found in the binary), imported in a
    fresh interpreter from the build folder alone."""
    proc = subprocess.run([sys.executable, "-c", REGISTERED, str(module.parent)], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    where, flags = proc.stdout.splitlines()
    assert pathlib.Path(where) == module
    works, testing = (word == "True" for word in flags.split())
    data = module.read_bytes()
    return works, testing, [name for name in HOOKS if name.encode() in data]


MODULE = "csrc/bindings/module.cpp"
TESTING = "csrc/bindings/register_testing.cpp"
REGISTER = "pyckpt::bindings::register_testing(pybind11::module_&)"


def _object(command) -> pathlib.Path:
    folder, argv = command
    return pathlib.Path(folder, argv[argv.index("-o") + 1])


def _compiled(command) -> pathlib.Path:
    """Runs one compile command as the build would; returns the object it wrote."""
    folder, argv = command
    subprocess.run(argv, cwd=folder, check=True, capture_output=True, text=True, timeout=300)
    return _object(command)


def _symbols(obj: pathlib.Path) -> dict:
    """Demangled symbol -> its nm type letter ("T" defined, "U" needed) of an object file. The objects are GCC
    LTO objects (pybind11's Release flags: -flto -fno-fat-lto-objects): gcc-nm reads their symbol tables."""
    nm = shutil.which("gcc-nm") or shutil.which("nm")
    assert nm, "gcc-nm not found: reading the objects' symbols needs binutils"
    out = subprocess.run([nm, "-C", str(obj)], check=True, capture_output=True, text=True, timeout=60).stdout
    lines = (re.match(r"\s*(?:[0-9a-fA-F]+\s+)?([A-Za-z])\s+(.+)$", line) for line in out.splitlines())
    return {m.group(2): m.group(1) for m in lines if m}


@pytest.mark.slow
def test_a_release_build_has_no_hooks_and_the_option_adds_them(tmp_path):
    build = tmp_path / "build"
    release = _configure(build)  # what `pip install .` configures: no PYCKPT_TESTING
    assert TESTING not in release and MODULE in release
    assert _registered(_build(build)) == (True, False, [])
    released = _symbols(_object(release[MODULE]))  # the registration's object in the module just built
    assert REGISTER not in released and "pyckpt::bindings::register_fsops(pybind11::module_&)" in released
    # The same tree with the option: every source compiles by the same command as above but the registration,
    # which gains the define, and register_testing.cpp joins them; the registration then calls what
    # register_testing.cpp defines. So the option, not the tree, leaves the hooks out above; that the test
    # build (this CMakeLists.txt with the option, scripts/setup.sh) has every hook is
    # test_the_installed_test_build_has_the_hooks. Only those two sources are compiled here: a link redoes
    # the whole module's LTO code generation.
    testing = _configure(build, "-DPYCKPT_TESTING=ON")
    assert sorted(testing) == sorted([*release, TESTING])
    assert [source for source in release if testing[source] != release[source]] == [MODULE]
    folder, argv = testing[MODULE]
    assert (folder, [arg for arg in argv if arg != "-DPYCKPT_TESTING"]) == release[MODULE]
    assert argv.count("-DPYCKPT_TESTING") == 1
    assert _symbols(_compiled(testing[MODULE])).get(REGISTER) == "U"
    assert _symbols(_compiled(testing[TESTING])).get(REGISTER) == "T"


def test_the_build_scripts_ask_for_the_hooks():
    """The test set-up and the sanitizer build are test builds; the demo installs the release build."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-C cmake.define.PYCKPT_TESTING=" in setup and "TESTING=${PYCKPT_TESTING:-ON}" in setup
    assert "-DPYCKPT_TESTING=ON" in (ROOT / "scripts" / "sanitize.sh").read_text()
    assert "PYCKPT_TESTING=OFF bash scripts/setup.sh" in (ROOT / "scripts" / "demo.sh").read_text()
    assert 'option(PYCKPT_TESTING "' in (ROOT / "CMakeLists.txt").read_text()
