"""pyckpt: fast, safe conversion of DeepSpeed ZeRO checkpoints.

``convert_to_universal`` turns a ZeRO-1/2/3 checkpoint into DeepSpeed's Universal Checkpoint
layout (what ``ds_to_universal.py`` writes), reading the input without unpickling code and moving
the bytes with a native parallel executor.
"""

from .errors import CheckpointFormatError, OutputExistsError, PyckptError, UnsafePickleError
from .universal import ConversionReport, convert_to_universal

__all__ = [
    "convert_to_universal", "ConversionReport", "PyckptError", "CheckpointFormatError", "UnsafePickleError",
    "OutputExistsError"
]
__version__ = "0.1.0"
