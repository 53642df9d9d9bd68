"""pyckpt: fast, safe conversion of DeepSpeed ZeRO checkpoints.

``convert_to_universal`` turns a ZeRO-1/2/3 checkpoint into DeepSpeed's Universal Checkpoint
layout (what ``ds_to_universal.py`` writes), reading the input without unpickling code and moving
the bytes with a native parallel executor.
"""

try:
    from . import _core  # noqa: F401  (the native executor; everything below needs it)
except ImportError as exc:  # most often: running from the source folder, which has no built module
    raise ImportError("pyckpt's native module pyckpt._core is not built here. Install the package "
                      "(`pip install .`, or scripts/setup.sh) and run from outside the source folder, or use an "
                      "editable install (`pip install --no-build-isolation -e .`).") from exc

from .autoep import check_load_topology, read_expert_slice
from .errors import (AutoEPError, CheckpointFormatError, MissingExpertFileError, OutputExistsError, PyckptError,
                     UnsafePickleError, UnsupportedCheckpointError)
from .universal import ConversionReport, convert_to_universal

__all__ = [
    "convert_to_universal", "ConversionReport", "read_expert_slice", "check_load_topology", "PyckptError",
    "CheckpointFormatError", "UnsafePickleError", "OutputExistsError", "UnsupportedCheckpointError", "AutoEPError",
    "MissingExpertFileError"
]
__version__ = "0.1.0"
