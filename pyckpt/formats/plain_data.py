"""Plain data: what pyckpt copies from an input into a pickle that another program loads back with
``torch.load(weights_only=False)`` (a param group's hyper-parameters, read by DeepSpeed's universal load
and by torch's DCP reader). Such a loader imports and calls whatever global the pickle names, so a value
read from an untrusted checkpoint goes in only if it is plain: a number, a string, a bool, None, or a
list, tuple or dict (string keys) of those, a few levels deep and a few dozen items long, which
``weights_only=True`` loads as well. An allowlisted record (``argparse.Namespace``, a ``pathlib`` path),
a global (``torch.float32``) or a tensor is not.
"""

from __future__ import annotations

from .pickle_read import GlobalName, Opaque, TensorRef

PLAIN_RULE = "numbers, strings, bools, None, and lists, tuples or dicts (string keys) of them"
MAX_DEPTH = 4
MAX_ITEMS = 64


def kind(value) -> str:
    """What ``value`` is, as a message names it: an allowlisted record or global by its global name."""
    if isinstance(value, Opaque):
        return ".".join(value._global)
    if isinstance(value, GlobalName):
        return f"{value.module}.{value.name}"
    if isinstance(value, TensorRef):
        return "tensor"
    return type(value).__name__


def plain_problem(value, depth: int = 0) -> str:
    """'' if ``value`` is plain data, else what in it is not (``"a pathlib.PosixPath"``, ``"a list of 70
    items"``)."""
    if value is None or type(value) in (bool, str, int, float):
        return ""
    if type(value) in (list, tuple, dict):
        if depth >= MAX_DEPTH:
            return f"a {type(value).__name__} nested more than {MAX_DEPTH} levels deep"
        if len(value) > MAX_ITEMS:
            return f"a {type(value).__name__} of {len(value)} items (at most {MAX_ITEMS})"
        if type(value) is dict:
            for k, v in value.items():
                if type(k) is not str:
                    return f"a dict keyed by a {kind(k)}"
                problem = plain_problem(v, depth + 1)
                if problem:
                    return problem
            return ""
        for v in value:
            problem = plain_problem(v, depth + 1)
            if problem:
                return problem
        return ""
    return f"a {kind(value)}"


def is_plain(value) -> bool:
    return not plain_problem(value)
