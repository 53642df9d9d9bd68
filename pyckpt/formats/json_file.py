"""Reading a JSON file that a checkpoint (or an output under check) holds: a model ``config.json``,
an export record.

Python's ``json`` module takes more than JSON and fails in ways that name no file: it accepts
``NaN`` and ``Infinity`` (and a ``1e999`` that becomes infinity), recurses once per nesting level
until the interpreter's recursion limit, converts integers of any length (or stops at the
interpreter's digit limit, a setting that may be off), keeps the last of duplicate keys, and takes
any value at the top. Here a file is read through the confined open with a size cap, the nesting
depth is counted before parsing, numbers must be finite and integers short, keys unique, and the
top level an object; any breach is one error naming the file and the rule.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
from itertools import accumulate, repeat
from typing import Tuple, Type

from ..errors import CheckpointFormatError, quoted
from .confined import read_inside

# Hugging Face configs nest a few levels (a text_config inside a model's config, rope_scaling
# inside that); the parser recurses once per level, so a bound far below the interpreter's
# recursion limit keeps it from depending on how deep the caller's stack already is.
MAX_DEPTH = 64
# An integer a config holds (a vocabulary size, a seed, a token id) fits in 64 bits: 20 digits.
MAX_INT_DIGITS = 40
# a model config is kilobytes (a vision model's id2label: about one megabyte)
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

# a JSON string, escapes included (unrolled, so long strings cost no backtracking); on the UTF-8
# bytes, whose multi-byte characters hold no quote or backslash byte
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
# an opening bracket to 2, a closing one to 0, every other byte dropped: less one, a depth step
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _nested_deeper(data: bytes, limit: int) -> bool:
    """Whether arrays and objects in ``data`` nest deeper than ``limit``, brackets inside strings not
    counted. The running depth is summed in C (tens of nanoseconds a bracket), not in a Python loop."""
    steps = _STRING.sub(b"", data).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    if len(steps) <= limit:
        return False
    if b"\x02" * (limit + 1) in steps:  # the usual deep file, found without summing
        return True
    return max(accumulate(map(operator.sub, steps, repeat(1)))) > limit


def parse_json_object(data: bytes, shown: str, what: str = "JSON file",
                      error: Type[Exception] = CheckpointFormatError) -> dict:
    """``data`` (the bytes of the file ``shown``, a ``what`` such as "model config") parsed as a JSON
    object under the rules above; otherwise ``error`` (a class taking one message) naming ``shown``
    and the rule."""
    def refuse(rule: str):
        return error(f"{shown}: not a readable {what} ({rule})")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refuse(f"not UTF-8 text at byte {exc.start}") from None
    if _nested_deeper(data, MAX_DEPTH):
        raise refuse(f"JSON nested deeper than {MAX_DEPTH} levels")

    def constant(name: str):
        raise refuse(f"{name} is not a JSON number; NaN and infinities are refused")

    def integer(digits: str) -> int:
        count = len(digits.lstrip("-"))
        if count > MAX_INT_DIGITS:
            raise refuse(f"an integer of {count} digits, more than the {MAX_INT_DIGITS} accepted")
        return int(digits)

    def real(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise refuse(f"the number {text[:40]} is beyond a float's range")
        return value

    def unique(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise refuse(f"the key {quoted(key, 80)} appears twice in one object")
            seen.add(key)
        return dict(pairs)

    try:
        value = json.loads(text, parse_constant=constant, parse_int=integer, parse_float=real,
                           object_pairs_hook=unique)
    except RecursionError:  # the depth scan keeps this from happening; the rule it stands for
        raise refuse(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        if isinstance(exc, error):
            raise
        raise refuse(f"not JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(value, dict):
        raise error(f"{shown}: {_a(what)} must be a JSON object, not {_KINDS.get(type(value), 'a number')}")
    return value


def _a(what: str) -> str:
    return f"{'an' if what[:1] in 'aeiou' else 'a'} {what}"


_KINDS = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}


def read_json_object(folder: str, name: str, what: str = "JSON file", limit: int = DEFAULT_MAX_BYTES,
                     error: Type[Exception] = CheckpointFormatError) -> Tuple[dict, bytes]:
    """The JSON object in the file ``name`` inside ``folder``, and its bytes: opened confined to the
    folder (:func:`~pyckpt.formats.confined.read_inside`: a regular file, no link out), at most
    ``limit`` bytes, parsed by :func:`parse_json_object`."""
    data = read_inside(folder, name, limit, f"{_a(what)} (JSON)")
    return parse_json_object(data, os.path.join(folder, name), what, error), data
