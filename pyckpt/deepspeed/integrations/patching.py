"""A framework's class patched by declared rows, or the framework left stock with one warning.

pyckpt replaces a few methods of DeepSpeed, the Hugging Face Trainer, accelerate and Lightning, found by
name. Each replacement is one :class:`Row`: the framework (its distribution's name), the module and class,
the attributes replaced, the versions it was proven on, and the module names it relies on besides them.
A :class:`Patch` applies the rows of one feature of one framework together, all or none:

* on a version the rows were not proven on, nothing is replaced and one warning names the framework, its
  version and the proven ones; ``PYCKPT_UNPROVEN_OK`` (a comma-separated list of framework names, or
  ``all``) accepts an unproven version: the rows then apply, with one warning saying so;
* everything the rows name is looked up before anything is replaced: a release that renamed or removed
  one leaves the framework stock, with one warning naming the framework, its version and what is missing;
* neither ever raises out of an import: a patch applied from an import hook that raised would make
  ``import transformers.trainer`` itself fail, and one applied in part would leave a framework that is
  neither stock nor pyckpt's.

A patch applies now (:meth:`Patch.install`) or, for a framework that loads its modules lazily
(transformers, accelerate, Lightning), when its module is imported (:meth:`Patch.install_on_import`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from ...errors import printable_line
from ..settings import hold_async, save_mode

log = logging.getLogger("pyckpt")

UNPROVEN_OK = "PYCKPT_UNPROVEN_OK"
_WARNED: set = set()
_MISSING = object()


@dataclass(frozen=True, eq=False)
class Row:
    """One class's replaced attributes: ``replaces`` maps each attribute to ``wrap(original, module)``,
    which returns its replacement; ``needs`` names what else of ``module`` the replacements use."""

    framework: str  # the distribution: "deepspeed", "transformers", "accelerate", "lightning"
    module: str
    cls: str
    replaces: Mapping[str, Callable[[Any, Any], Any]]
    proven: Tuple[str, ...]
    needs: Tuple[str, ...] = field(default=())

    @property
    def attributes(self) -> Tuple[str, ...]:
        return tuple(self.replaces)


def version(framework: str) -> str:
    """The installed version of ``framework``: its top module's ``__version__``, else its distribution's."""
    found = getattr(sys.modules.get(framework), "__version__", None)
    if isinstance(found, str):
        return found
    try:
        return importlib.metadata.version(framework)
    except Exception:  # not installed as a distribution
        return "(version unknown)"


def unproven_accepted(framework: str) -> bool:
    """Whether ``PYCKPT_UNPROVEN_OK`` names ``framework`` (or says ``all``)."""
    names = {n.strip().lower() for n in os.environ.get(UNPROVEN_OK, "").split(",")}
    return framework.lower() in names or "all" in names


def need(owner: Any, name: str) -> Any:
    """``owner.<name>`` (a module's class or function, a class's method), or AttributeError naming both."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        what = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
        raise AttributeError(f"{what} has no {name}")
    return value


def _warn_once(framework: str, reason: str, then: str) -> None:
    key = (framework, reason, then)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s", printable_line(f"pyckpt: {framework} {version(framework)}: {reason}; {then}"))


class Patch:
    """The rows of one feature of one framework (``feature`` names it in a warning), applied all or none.
    ``stock`` says what runs where they cannot apply; ``on_stock`` is called then."""

    def __init__(self, feature: str, rows: Sequence[Row], stock: str, on_stock: Optional[Callable[[], None]] = None):
        frameworks = {row.framework for row in rows}
        if len(frameworks) != 1:
            raise ValueError(f"a patch is of one framework, not {sorted(frameworks)}")
        self.feature, self.rows, self.stock, self.on_stock = feature, tuple(rows), stock, on_stock
        self.framework = rows[0].framework
        self.saved: Dict[type, Dict[str, Any]] = {}  # class -> its own attributes before (or _MISSING: inherited)
        self.originals: Dict[Tuple[type, str], Any] = {}  # (class, attribute) -> what the class answered before
        self._finder: Optional[_OnImport] = None

    def installed(self) -> bool:
        return bool(self.saved)

    def original(self, cls: type, name: str) -> Any:
        """What ``cls.<name>`` was before this patch replaced it."""
        return self.originals[(cls, name)]

    def _proven(self) -> bool:
        have = version(self.framework)
        proven = self.rows[0].proven
        if have in proven:
            return True
        reason = f"{self.feature} is proven on {self.framework} {', '.join(proven)} only"
        if unproven_accepted(self.framework):
            _warn_once(self.framework, reason, f"applied all the same, as {UNPROVEN_OK} asks")
            return True
        _warn_once(self.framework, reason, f"{self.stock} (set {UNPROVEN_OK}={self.framework} to apply it anyway)")
        return False

    def apply(self, modules: Mapping[str, Any]) -> bool:
        """The rows applied to the classes of ``modules`` (name -> module), all or none; False (one warning,
        nothing replaced, ``on_stock`` called) on an unproven version or where anything is missing. Any
        exception counts, not only a missing attribute: a release may change a framework in ways no lookup
        foresees, and an import must still succeed."""
        if self.saved:
            return True
        ok = self._proven()
        if ok:
            try:
                self._replace(modules)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, AttributeError) else f"{type(exc).__name__}: {exc}"
                _warn_once(self.framework, reason, self.stock)
                ok = False
        if not ok and self.on_stock is not None:
            self.on_stock()
        return ok

    def _replace(self, modules: Mapping[str, Any]) -> None:
        found = []
        for row in self.rows:
            module = modules[row.module]
            cls = need(module, row.cls)
            for name in row.needs:
                need(module, name)
            found.append((row, module, cls, {name: need(cls, name) for name in row.replaces}))
        replaced = [(cls, originals, {name: wrap(originals[name], module) for name, wrap in row.replaces.items()})
                    for row, module, cls, originals in found]
        for cls, originals, new in replaced:  # nothing raised: every row replaced
            self.saved[cls] = {name: cls.__dict__.get(name, _MISSING) for name in new}
            for name, value in new.items():
                self.originals[(cls, name)] = originals[name]
                setattr(cls, name, value)

    def install(self) -> bool:
        """The rows' modules imported now and patched; False as for :meth:`apply` (an import that fails
        counts as missing)."""
        if self.saved:
            return True
        try:
            modules = {row.module: importlib.import_module(row.module) for row in self.rows}
        except Exception as exc:
            if not self._proven():
                return False
            _warn_once(self.framework, f"{type(exc).__name__}: {exc}", self.stock)
            if self.on_stock is not None:
                self.on_stock()
            return False
        return self.apply(modules)

    def install_on_import(self, active: Callable[[], bool]) -> None:
        """Patch each row's module now where it is loaded, else when it is imported while ``active()``
        (a framework imported after ``enable()``: transformers and accelerate load theirs lazily)."""
        names = list(dict.fromkeys(row.module for row in self.rows))
        if all(name in sys.modules for name in names):
            self.apply({name: sys.modules[name] for name in names})
            return
        if len(names) != 1:
            raise ValueError("a patch applied on import names one module")
        if self._finder is None:
            self._finder = _OnImport(names[0], lambda module: self.apply({names[0]: module}), active)
        if self._finder not in sys.meta_path:
            sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        """Every replaced attribute put back as it was (an inherited one removed again)."""
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        for cls, own in list(self.saved.items()):
            for name, value in own.items():
                if value is _MISSING:
                    delattr(cls, name)
                else:
                    setattr(cls, name, value)
            del self.saved[cls]
        self.originals.clear()


class _OnImport(importlib.abc.MetaPathFinder):
    """Calls ``patch(module)`` once the module ``name`` has run, when it is imported while ``active()``."""

    def __init__(self, name: str, patch: Callable[[Any], bool], active: Callable[[], bool]):
        self.name, self.patch, self.active = name, patch, active

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(mod):
            run(mod)
            if self.active():
                self.patch(mod)  # never raises: Patch.apply warns instead
        loader.exec_module = exec_module
        return spec


def save_patch(feature: str, row: Row) -> Patch:
    """A framework above DeepSpeed patched for ``enable(save=...)``. Where it cannot be, it runs stock and
    DeepSpeed's saves become atomic, not asynchronous (:func:`..settings.hold_async`): a stock framework
    would go on (rotate, remove the older checkpoint, call it complete) while a background write runs."""
    return Patch(feature, [row], f"{row.cls} stays stock under enable(save=...); DeepSpeed's saves are atomic, "
                 "not asynchronous, while it is (it would not wait for a background write)", on_stock=hold_async)


def install_save_patch(patch: Patch) -> None:
    """``patch`` applied now where its module is loaded, else when it is imported while a save mode is set."""
    patch.install_on_import(lambda: save_mode() is not None)
