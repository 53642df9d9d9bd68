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
from typing import List, Optional, Tuple

from ...errors import PyckptError, UnsafePickleError
from ...formats.pickle_read import OPAQUE_CLASSES, OPAQUE_ENUMS
from ...universal.layout import OPTIMIZER_STATE_FILE, STATE_SUFFIX, STATES_FOLDER

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


def imported_globals() -> list:
    """The allowlist's entries whose modules this process has imported already (no import made)."""
    import sys

    out = []
    for module, name in sorted(OPAQUE_CLASSES | OPAQUE_ENUMS):
        obj = getattr(sys.modules.get(module), name, None)
        if obj is not None and (module, name) not in _NOT_FOR_TORCH:
            out.append((obj, f"{module}.{name}"))
    return out


def read_model_states(path: str, mmap: bool = True):
    """``path`` through torch's weights-only unpickler with pyckpt's allowlist; its tensors stay
    pages of a memory map when ``mmap``. Raises ``pickle.UnpicklingError`` on a refused global, as
    torch does.

    First with the allowlist's classes already imported: DeepSpeed's model states name only those of
    modules a DeepSpeed job has loaded (its own, numpy's, argparse's), and importing the others
    (torch.distributed.checkpoint's records) was 0.1-0.2 s of a resume from memory. A refusal then
    reads the file again with the whole allowlist."""
    import torch

    first = imported_globals()
    try:
        with torch.serialization.safe_globals(first):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError:
        if len(first) == len(allowed_globals()):
            raise
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
    zero = os.path.join(checkpoint_folder, STATES_FOLDER)
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
            out.extend(os.path.join(path, n) for n in names if n.endswith(STATE_SUFFIX) and len(n) > len(STATE_SUFFIX))
        elif entry == OPTIMIZER_STATE_FILE:
            out.append(path)
    return out


def deepspeed_tag_folder(load_dir, tag, pointer: str = "latest") -> Optional[str]:
    """The tag folder DeepSpeed's own ``load_checkpoint(load_dir, tag)`` reads (the tag ``pointer``
    names when None: ``latest``, or ``latest_universal`` for a universal load; read by pyckpt's
    confined reader), or None where it reads none (no pointer, no folder)."""
    from ...formats.confined import inside
    from ...zero.discovery import follow_pointer

    load_dir = os.fspath(load_dir)
    if tag is None:
        if not os.path.lexists(os.path.join(load_dir, pointer)):
            return None  # DeepSpeed loads nothing (or says the pointer is missing)
        return follow_pointer(load_dir, pointer)
    folder = inside(load_dir, str(tag))
    return folder if os.path.isdir(folder) else None


def check_tag_pickles(folder: str, rank: int = 0, size: int = 1, skip: str = "") -> Optional[Tuple[str, str]]:
    """The first torch file of this rank's share (every ``size``-th from ``rank``) of a tag folder's
    ``*.pt`` files that pyckpt's parser does not take, as (the kind of refusal, a message naming it),
    or None. DeepSpeed's own ``load_checkpoint`` unpickles these with ``torch.load(weights_only=False)``
    (model states, ZeRO shards, expert files): the ranks share the parsing out and agree before it
    reads any. The kind is "UnsafePickleError" for a pickle that names a global off the allowlist,
    "CheckpointFormatError" for a file pyckpt cannot parse at all (damaged, or not torch's zip
    format). Names ending in ``skip`` are left out (files read some safer way)."""
    from ...formats.torch_zip import SourceFile

    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".pt") and not (skip and n.endswith(skip)))
    except OSError:
        return None  # DeepSpeed's load says what is wrong with the folder, before it unpickles anything
    for name in names[rank::size]:
        path = os.path.join(folder, name)
        try:
            SourceFile(path).load()
        except UnsafePickleError as exc:
            return "UnsafePickleError", str(refused(path, f"pyckpt's reader refused it ({first_line(exc)})"))
        except (PyckptError, OSError, pickle.UnpicklingError, ValueError, EOFError) as exc:
            return "CheckpointFormatError", (f"{path}: pyckpt's reader cannot parse it ({first_line(exc)}), and "
                                             f"DeepSpeed's own load would unpickle it whole; {TRUST_HINT}")
    return None


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
