"""The native module's test hooks (pyckpt._core.testing) are in the test build only.

CMakeLists.txt's option PYCKPT_TESTING (default OFF) compiles csrc/bindings/register_testing.cpp and its
registration; scripts/setup.sh turns it on for the test extras and scripts/sanitize.sh for the sanitizer
build, while a plain `pip install .` leaves it off. The fast checks hold the installed test build to having
the hooks and the library to never needing them; the slow one configures and builds the module both ways
with the compiler and flags of CMakeLists.txt into a scratch folder and looks at what each build registers.
"""

import os
import pathlib
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


def _configure(build: pathlib.Path, *defines: str) -> None:
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
                    *defines], check=True, capture_output=True, text=True, timeout=300)


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


@pytest.mark.slow
def test_a_release_build_has_no_hooks_and_the_option_adds_them(tmp_path):
    build = tmp_path / "build"
    _configure(build)  # what `pip install .` configures: no PYCKPT_TESTING
    assert _registered(_build(build)) == (True, False, [])
    # The same tree with the option (only the registration recompiles): the hooks are there, so it is the
    # option, not the tree, that leaves them out above.
    _configure(build, "-DPYCKPT_TESTING=ON")
    assert _registered(_build(build)) == (True, True, list(HOOKS))


def test_the_build_scripts_ask_for_the_hooks():
    """The test set-up and the sanitizer build are test builds; the demo installs the release build."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-C cmake.define.PYCKPT_TESTING=" in setup and "TESTING=${PYCKPT_TESTING:-ON}" in setup
    assert "-DPYCKPT_TESTING=ON" in (ROOT / "scripts" / "sanitize.sh").read_text()
    assert "PYCKPT_TESTING=OFF bash scripts/setup.sh" in (ROOT / "scripts" / "demo.sh").read_text()
    assert 'option(PYCKPT_TESTING "' in (ROOT / "CMakeLists.txt").read_text()
