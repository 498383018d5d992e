"""Old module paths: ``dcpstore.<module>`` from before the layers became subpackages.

``import dcpstore.checkpointer`` (or ``dcpstore.writer``, ``dcpstore.local``, ...) keeps
working: a meta-path finder answers the old name with the module at its new place, so
both names are one module object (classes, ``isinstance`` and pickles agree).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install"]

#: Old module name (under ``dcpstore.``) -> the subpackage that holds it now.
MOVED: dict[str, str] = {
    **dict.fromkeys(["backend", "multipart", "local", "concurrency", "clients", "registry",
                     "uri", "options", "resolve", "redact"], "storage"),
    **dict.fromkeys(["writer", "reader", "read_plan", "delivery", "read_share", "manifest",
                     "metadata_io", "codec", "references", "layout", "safe_pickle", "guard",
                     "checksum", "dist", "api", "staging"], "dcp"),
    **dict.fromkeys(["checkpointer", "local_tier", "latest", "state", "weights"],
                    "training"),
    **dict.fromkeys(["ops", "cli", "demo"], "tools"),
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        return None  # already executed under its new name


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != "dcpstore" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(f"dcpstore.{MOVED[name]}.{name}"))


def install() -> None:
    """Add the finder once (``import dcpstore`` does)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


def submodule_getattr(package: str) -> Any:
    """A module ``__getattr__`` for ``package`` that imports a submodule on first access,
    so ``dcpstore.training.state`` works after a bare ``import dcpstore`` (the package
    imports nothing heavy up front)."""

    def __getattr__(name: str) -> ModuleType:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
