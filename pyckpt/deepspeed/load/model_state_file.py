"""The model-state file of a universal load, read once, through a memory map.

Under ``load_universal`` DeepSpeed reads ``*_model_states.pt`` for its metadata only (scheduler,
counters, ``client_state``, ``universal_checkpoint_info``): the ``module`` weights are never applied,
the parameters come from ``zero/``. Yet its ``SDLoaderBase`` loads the file twice per rank through
``checkpoint_engine.load`` (``deepspeed/runtime/state_dict_factory.py``: once in ``check_ckpt_list``,
once in ``load``), each a full ``torch.load(weights_only=False)`` that reads and materialises
``module`` (b·P/T bytes for ZeRO-1/2).

While a universal ``load_checkpoint`` runs, the engine's ``TorchCheckpointEngine`` is wrapped so that
model-state files are opened with ``torch.load(mmap=True, weights_only=True)`` and pyckpt's allowlist
(:mod:`.pickle_policy`), once per path: only the pickle is read, the tensors stay unread pages of the
mapping, and torch's restricted unpickler executes nothing from the file. A file it refuses (a
``client_state`` holding arbitrary objects) stops the load with the file and the global named, or,
for a trusted checkpoint, goes to DeepSpeed's own reader as without pyckpt. Other engines (Nebula,
decoupled, fast writers) and other files are left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Dict

from ...errors import CheckpointFormatError, printable
from .pickle_policy import first_line, read_model_states, refused

logger = logging.getLogger("pyckpt")

MODEL_STATES_SUFFIX = "_model_states.pt"
# What a universal load never applies (the parameters come from zero/): left as pages of the map.
# Every other tensor is copied out of it, because DeepSpeed hands it on (client_state to the caller,
# the scheduler's state into the scheduler), and a mapped tensor read after the file was rewritten
# in place (a save to the same tag) would fault.
MAPPED_KEYS = ("module", "frozen_param_fragments")


def _in_memory(obj):
    """``obj`` with every tensor in its dicts, lists and tuples cloned out of the file's mapping."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        out = type(obj)()  # an OrderedDict stays one
        for k, v in obj.items():
            out[k] = _in_memory(v)
        return out
    if isinstance(obj, list):
        return [_in_memory(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_in_memory(v) for v in obj)
    return obj


class MappedModelStates:
    """Stands in for the engine's checkpoint engine during one universal load."""

    def __init__(self, inner, trust_pickles: bool = False):
        self._inner = inner
        self._trust = trust_pickles
        self._cache: Dict[str, dict] = {}
        # paths read here, and those handed to DeepSpeed's reader, for tests and benchmarks
        self.mapped = []
        self.refused = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, map_location=None):
        if not str(path).endswith(MODEL_STATES_SUFFIX):
            return self._inner.load(path, map_location=map_location)
        key = os.path.realpath(path)
        if key not in self._cache:
            import pickle

            try:
                try:
                    state = read_model_states(path)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):
                        raise
                    state = read_model_states(path, mmap=False)  # a legacy (non-zip) file cannot be mapped
            except pickle.UnpicklingError as exc:  # how torch reports a global off the allowlist
                if not self._trust:
                    raise refused(path, f"torch's weights-only reader refused it with pyckpt's allowlist "
                                        f"({first_line(exc)})") from None
                logger.warning("pyckpt: %s is read by DeepSpeed's own loader, as trusted (torch's weights-only "
                               "reader refused it: %s)", printable(path), printable(first_line(exc)))
                self.refused.append(path)
                return self._inner.load(path, map_location=map_location)
            except Exception as exc:  # a damaged file: torch says EOFError, OSError(EINVAL), RuntimeError...
                raise unreadable(path, exc) from exc
            if not isinstance(state, dict):
                raise CheckpointFormatError(f"{path}: holds a {type(state).__name__}; a model-state file holds a dict")
            state = {k: v if k in MAPPED_KEYS else _in_memory(v) for k, v in state.items()}
            self._cache[key] = state
            self.mapped.append(path)
        # DeepSpeed may pop keys from what it gets; each caller gets its own top-level dict
        return dict(self._cache[key])


def read_ahead(engine, states: MappedModelStates, load_dir, tag):
    """Read into ``states`` the model-state files DeepSpeed's universal ``load_checkpoint`` is about
    to read on this rank, and return the tag it will load (``latest_universal``'s when None).

    Under the universal flag DeepSpeed reads ``ckpt_list[0]`` (``SDLoaderBase.check_ckpt_list``) and
    ``ckpt_list[checkpoint_mp_rank * n // mp_world_size]`` (``engine._load_checkpoint``), where
    ``ckpt_list`` is ``engine._get_all_ckpt_names(load_dir, tag)``. Errors are DeepSpeed's where its
    own load would raise them, pyckpt's for a file it cannot read."""
    from ...formats.confined import read_small_text

    load_dir = os.fspath(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, "latest_universal")
        if not os.path.isfile(latest):
            raise ValueError(f'Invalid for universal checkpoint: {latest} does not exist')  # DeepSpeed's message
        tag = read_small_text(load_dir, "latest_universal").strip()
    files = engine._get_all_ckpt_names(load_dir, tag)
    if files:
        for path in dict.fromkeys((files[0], files[engine.checkpoint_mp_rank * len(files) // engine.mp_world_size])):
            states.load(path)
    return tag


def unreadable(path: str, exc: BaseException) -> CheckpointFormatError:
    """The error for a model-state file torch's reader failed on, naming the file and what is wrong
    with it: pyckpt's own ZIP reader says which rule a damaged archive breaks (torch reports a
    truncated one as a bare ``OSError: [Errno 22] Invalid argument`` or an ``EOFError``)."""
    from ...formats.torch_zip import SourceFile

    try:
        SourceFile(path)
    except CheckpointFormatError as diagnosis:
        return diagnosis
    except OSError as failed:
        return CheckpointFormatError(f"{path}: unreadable ({failed.strerror or type(failed).__name__})")
    return CheckpointFormatError(f"{path}: unreadable ({type(exc).__name__}: {first_line(exc) or 'no detail'})")


def applies_to(checkpoint_engine) -> bool:
    """Only DeepSpeed's default engine, whose ``load`` is a plain ``torch.load`` of the whole file."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(checkpoint_engine) is TorchCheckpointEngine
