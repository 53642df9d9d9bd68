"""A framework's method replaced whole, or the framework left stock with one warning.

pyckpt replaces a few methods of DeepSpeed, the Hugging Face Trainer, accelerate and Lightning, found by
name. A release that renames or removes one must not break the framework: a patch applied from an import
hook that raised would make ``import transformers.trainer`` itself fail, and a patch applied in part would
leave a framework that is neither stock nor pyckpt's. So a patch looks up everything it needs
(:func:`need`) before it replaces anything, and :func:`apply` runs it: where it cannot apply, one warning
names the framework, its version and what is missing, nothing is replaced, and the framework runs as
stock.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from typing import Any, Callable

from ..errors import printable_line

log = logging.getLogger("pyckpt")

_WARNED: set = set()
_MISSING = object()


def version(module_name: str) -> str:
    """The framework a module belongs to and its version: ``"transformers 5.22.0"``."""
    top = module_name.split(".")[0]
    found = getattr(sys.modules.get(top), "__version__", None)
    if not isinstance(found, str):
        try:
            found = importlib.metadata.version(top)
        except Exception:  # a module of no installed distribution (a stand-in)
            found = "(version unknown)"
    return f"{top} {found}"


def need(owner: Any, name: str) -> Any:
    """``owner.<name>`` (a module's class or function, a class's method), or AttributeError naming both."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        what = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
        raise AttributeError(f"{what} has no {name}")
    return value


def apply(module_name: str, patch: Callable[[], Any], stock: str) -> bool:
    """``patch()``, or, where it raises, one warning (once per process for the same cause): the framework
    of ``module_name`` and its version, what is missing, then ``stock`` (what runs instead); False.

    Any exception counts, not only a missing attribute: a release may change a framework in ways no
    lookup foresees, and an import must still succeed. ``patch`` looks everything up before it replaces
    anything, so a failure leaves the framework as it was."""
    try:
        patch()
        return True
    except Exception as exc:
        reason = str(exc) if isinstance(exc, AttributeError) else f"{type(exc).__name__}: {exc}"
        key = (module_name, reason)
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("%s", printable_line(f"pyckpt: {version(module_name)}: {reason}; {stock}"))
        return False
