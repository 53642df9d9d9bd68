"""Which checkpoint pickles a load through pyckpt lets DeepSpeed's own readers unpickle.

pyckpt reads the files of a universal load with its own parser, which rebuilds only an allowlist of
types (:mod:`pyckpt.formats.pickle_read`). Two kinds of file still go to a real unpickler:

* the model-state file, whose ``client_state`` and scheduler DeepSpeed returns as live objects: it is
  read with torch's weights-only unpickler, given the same allowlist (:func:`read_model_states`);
* every state file of a universal load that this backend hands back to DeepSpeed's own loader (a
  layout it does not serve), which DeepSpeed unpickles with ``torch.load(weights_only=False)``: each
  rank first parses every file that loader can open with pyckpt's parser, and the ranks agree
  (:func:`check_universal_pickles`), so a file naming any other global stops every rank before
  DeepSpeed runs anything from it.

Both refuse with :class:`UnsafePickleError` naming the file unless the user trusts the checkpoint
(``enable(trust_pickles=True)``), which gives those files to DeepSpeed's readers as without pyckpt.
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import warnings
from typing import List, Optional

from ...errors import PyckptError, UnsafePickleError
from ...formats.pickle_read import OPAQUE_CLASSES, OPAQUE_ENUMS

TRUST_HINT = ("pyckpt does not let a checkpoint run code; if you trust this checkpoint, "
              "pyckpt.deepspeed.enable(trust_pickles=True) gives it to DeepSpeed's own reader "
              "(torch.load(weights_only=False))")

# A protocol-0/1 pickle names the class it rebuilds as an argument of copyreg._reconstructor; torch's
# weights-only unpickler checks that class itself only for the protocol-2 form torch.save writes.
_NOT_FOR_TORCH = {("copyreg", "_reconstructor")}


@functools.lru_cache(maxsize=None)
def allowed_globals() -> tuple:
    """pyckpt's allowlist as torch's weights-only unpickler takes it: (object, "module.name") pairs,
    the name as pickles spell it (numpy 2 moved ``numpy.core`` to ``numpy._core``; both are listed,
    each where this numpy has it)."""
    out = []
    for module, name in sorted(OPAQUE_CLASSES | OPAQUE_ENUMS):
        if (module, name) in _NOT_FOR_TORCH:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy 2's warning for its numpy.core alias
                obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        out.append((obj, f"{module}.{name}"))
    return tuple(out)


def read_model_states(path: str, mmap: bool = True):
    """``path`` through torch's weights-only unpickler with pyckpt's allowlist; its tensors stay
    pages of a memory map when ``mmap``. Raises ``pickle.UnpicklingError`` on a refused global, as
    torch does."""
    import torch

    with torch.serialization.safe_globals(list(allowed_globals())):
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)


def refused(path: str, why: str) -> UnsafePickleError:
    return UnsafePickleError(f"{path}: {why}; {TRUST_HINT}")


def first_line(exc: BaseException) -> str:
    """The line of an error that says what was wrong: for torch's weights-only refusal, the one
    naming the global (its first lines are advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(". Please use", 1)[0].strip()
    return lines[0] if lines else type(exc).__name__


def _universal_state_files(checkpoint_folder: str) -> List[str]:
    """Every file DeepSpeed's universal loader may unpickle: ``zero/optimizer_state.pt`` and each
    ``zero/<name>/<key>.pt`` (DeepSpeed opens the files of every folder a parameter names, following
    links; the names here are the folder's own)."""
    zero = os.path.join(checkpoint_folder, "zero")
    out = []
    try:
        entries = sorted(os.listdir(zero))
    except OSError:
        return out
    for entry in entries:
        path = os.path.join(zero, entry)
        if os.path.isdir(path):
            try:
                names = sorted(os.listdir(path))
            except OSError:
                continue
            out.extend(os.path.join(path, n) for n in names if n.endswith(".pt") and len(n) > 3)
        elif entry == "optimizer_state.pt":
            out.append(path)
    return out


def check_universal_pickles(checkpoint_folder: str) -> Optional[str]:
    """The first state file under ``checkpoint_folder/zero`` that pyckpt's parser refuses, as a
    message naming it, or None when every one parses. Only pickles are read, not tensors."""
    from ...formats.torch_zip import SourceFile

    for path in _universal_state_files(checkpoint_folder):
        try:
            SourceFile(path).load()
        except (PyckptError, OSError, pickle.UnpicklingError, ValueError, EOFError) as exc:
            return str(refused(path, f"pyckpt's reader refused it ({first_line(exc)})"))
    return None
