"""The native test hooks, pyckpt._core.testing: compiled only into the test build (the CMake option
PYCKPT_TESTING, which scripts/setup.sh and scripts/sanitize.sh turn on; a plain `pip install .` leaves them
out). The tests that drive them fail, never skip, on a build without them: the test build always has them,
so their absence means the wrong build is installed."""

import pytest

from pyckpt import _core

HOOKS = ("inject_fault", "clear_faults", "f16_to_f32_portable", "f32_to_f16_portable", "write_past_a_shrunk_output_map")

WITHOUT = ("{where} is a release build: it has no pyckpt._core.testing (fault injection, the portable fp16 "
           "kernels), which the tests drive. Install the test build: `bash scripts/setup.sh`, or "
           "`pip install -C cmake.define.PYCKPT_TESTING=ON '.[test]'`")


def hooks():
    """pyckpt._core.testing, or a failure saying which build is installed and how to get the test build."""
    testing = getattr(_core, "testing", None)
    if testing is None:
        pytest.fail(WITHOUT.format(where=_core.__file__), pytrace=False)
    return testing
