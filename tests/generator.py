"""benchmarks/make_checkpoint.py as a module, for the tests that make synthetic checkpoints with it.

benchmarks/ is not a package, and the generator's dataclasses need their module registered while it
executes; loaded once per process, under one name, whichever test file asks first.
"""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "make_checkpoint.py"
NAME = "benchmarks_make_checkpoint"


def load():
    module = sys.modules.get(NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(NAME, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    return module
