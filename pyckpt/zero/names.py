"""Which names from a checkpoint may become paths.

DeepSpeed's converter writes each parameter to ``zero/<name>/<state>.pt``, so a parameter name taken
from a pickle is a path component chosen by whoever wrote the file. torch builds parameter names by
joining module and attribute names with ``.``, and refuses empty names and names containing ``.``
for each part (``nn.Module.register_parameter``/``add_module``). pyckpt accepts exactly the names
that can come out of that *and* are safe as one folder name:

* a non-empty ``str`` whose ``.``-separated parts are all non-empty (so never ``.``/``..``, no
  leading, trailing or doubled dot);
* no ``/`` or ``\\`` (torch would allow them in a ``ModuleDict`` key, but DeepSpeed would then
  write nested folders that no loader looks up the same way), no NUL or other control character
  (C0, DEL or C1);
* at most 255 bytes in UTF-8, the longest folder name Linux filesystems take.

Anything else is refused with an error naming the file and the key, before any output exists.
"""

from __future__ import annotations

import itertools
import os
import re

from ..errors import CheckpointFormatError, quoted

NAME_MAX = 255
# DeepSpeed's model-state file names (engine._get_ckpt_name, _get_zero_ckpt_name): ZeRO-1/2 writes one per
# model-parallel rank, ZeRO-3 one per data- and model-parallel rank; a Universal Checkpoint keeps them.
ZERO12_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt\Z")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt\Z")
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f-\x9f/\\]")  # C0 and C1 controls, DEL, both slashes


def name_problem(name) -> str:
    """Why ``name`` is not a legal parameter name, or '' if it is."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    bad = _FORBIDDEN.search(name)
    if bad:
        return f"contains {bad.group()!r}"
    if any(part == "" for part in name.split(".")):
        return "has an empty '.'-separated part"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode"
    if size > NAME_MAX:
        return f"is {size} bytes long (at most {NAME_MAX})"
    return ""


def check_param_name(name, where: str, what: str = "parameter name") -> str:
    """``name`` if it may become a folder name, else CheckpointFormatError naming ``where``."""
    problem = name_problem(name)
    if problem:
        raise CheckpointFormatError(f"{where}: {what} {quoted(name, 80)} {problem}: not a DeepSpeed parameter name, "
                                    "refusing to use it as a path")
    return name


def check_tag(tag: str, latest_path: str) -> str:
    """A tag named by a ``latest`` file must be one folder name beside it."""
    if tag in ("", ".", "..") or "/" in tag or "\x00" in tag or os.sep in tag:
        raise CheckpointFormatError(f"{latest_path}: names tag {quoted(tag)}, which is not a folder name beside it")
    return tag


def missing_ranks(present, count: int, limit: int = 5):
    """(the first ``limit`` numbers of ``range(count)`` not in ``present``, how many are missing).

    Rank numbers and world sizes come from file names and pickles: a huge one must cost neither a
    huge list nor a long loop (at most ``len(present) + limit`` numbers are looked at)."""
    listed = list(itertools.islice((r for r in range(count) if r not in present), limit))
    return listed, count - sum(1 for r in present if 0 <= r < count)
