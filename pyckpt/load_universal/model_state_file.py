"""The model-state file of a universal load, read once, through a memory map.

Under ``load_universal`` DeepSpeed reads ``*_model_states.pt`` for its metadata only (scheduler,
counters, ``client_state``, ``universal_checkpoint_info``): the ``module`` weights are never applied,
the parameters come from ``zero/``. Yet its ``SDLoaderBase`` loads the file twice per rank through
``checkpoint_engine.load`` (``deepspeed/runtime/state_dict_factory.py``: once in ``check_ckpt_list``,
once in ``load``), each a full ``torch.load(weights_only=False)`` that reads and materialises
``module`` (b·P/T bytes for ZeRO-1/2).

While a universal ``load_checkpoint`` runs, the engine's ``TorchCheckpointEngine`` is wrapped so that
model-state files are opened with ``torch.load(mmap=True, weights_only=True)``, once per path: only
the pickle is read, the tensors stay unread pages of the mapping, and torch's restricted unpickler
executes nothing from the file. A file that the restricted unpickler refuses (a ``client_state``
holding arbitrary objects) goes to DeepSpeed's own reader, exactly as without pyckpt, with a warning.
Other engines (Nebula, decoupled, fast writers) and other files are left alone.
"""

from __future__ import annotations

import logging
import os
from typing import Dict

logger = logging.getLogger("pyckpt")

MODEL_STATES_SUFFIX = "_model_states.pt"


class MappedModelStates:
    """Stands in for the engine's checkpoint engine during one universal load."""

    def __init__(self, inner):
        self._inner = inner
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

            import torch

            try:
                state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except (pickle.UnpicklingError, RuntimeError) as exc:
                # torch reports a refused global as UnpicklingError; a non-zip (legacy) file as RuntimeError
                logger.warning("pyckpt: %s is read by DeepSpeed's own loader (torch's weights-only reader "
                               "refused it: %s)", path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self.refused.append(path)
                return self._inner.load(path, map_location=map_location)
            if not isinstance(state, dict):
                self.refused.append(path)
                return self._inner.load(path, map_location=map_location)
            self._cache[key] = state
            self.mapped.append(path)
        # DeepSpeed may pop keys from what it gets; each caller gets its own top-level dict
        return dict(self._cache[key])


def applies_to(checkpoint_engine) -> bool:
    """Only DeepSpeed's default engine, whose ``load`` is a plain ``torch.load`` of the whole file."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(checkpoint_engine) is TorchCheckpointEngine
