"""pyckpt: fast, safe conversion of DeepSpeed ZeRO checkpoints.

``convert_to_universal`` turns a ZeRO-1/2/3 checkpoint into DeepSpeed's Universal Checkpoint
layout (what ``ds_to_universal.py`` writes), reading the input without unpickling code and moving
the bytes with a native parallel executor.

The package imports its heavy parts (numpy, the native module) on first use, so that a command
line interrupted while starting up exits with one line instead of an import traceback.
"""

from .errors import (AutoEPError, CheckpointFormatError, CollectiveCallError, InputChangedError, MemoryRootError,
                     MissingExpertFileError, OutputExistsError, OutputLockError, PlanCheckError, PointerNameError,
                     PyckptError, RankLoadError, RanksFailedError, ReplicationError, SaveError, TpMergeError,
                     UnsafePickleError, UnsupportedCheckpointError, VerifyInputError)

# The package's one lazy table: each public verb from the folder that implements it.
_LAZY = {
    "convert_to_universal": "universal.convert",
    "ConversionReport": "universal.convert",
    "verify_universal": "universal.verify",
    "VerifyReport": "universal.verify",
    "read_expert_slice": "universal.expert_slice",
    "check_load_topology": "universal.expert_slice",
    "export_hf": "inputs.export",  # any input: a DCP folder, or a DeepSpeed checkpoint
    "export_hf_from_dcp": "dcp.to_hf",
    "read_dcp": "dcp.read",
    "ExportReport": "huggingface.export",
    "state_dict": "huggingface.state_dict",
    "export_dcp": "dcp.export",
    "DcpReport": "dcp.export",
}

__all__ = [
    "convert_to_universal", "ConversionReport", "export_hf", "export_hf_from_dcp", "read_dcp", "ExportReport", "export_dcp", "DcpReport", "state_dict", "read_expert_slice", "check_load_topology", "verify_universal", "VerifyReport",
    # every exception pyckpt raises on purpose (pyckpt.errors), all PyckptError
    "PyckptError", "CheckpointFormatError", "UnsafePickleError", "OutputExistsError", "UnsupportedCheckpointError",
    "AutoEPError", "MissingExpertFileError", "InputChangedError", "PlanCheckError", "RanksFailedError",
    "VerifyInputError", "TpMergeError", "RankLoadError", "CollectiveCallError", "SaveError", "OutputLockError",
    "PointerNameError", "MemoryRootError", "ReplicationError",
]
__version__ = "0.1.0"


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pyckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
