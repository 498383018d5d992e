"""Start-up hook for ``DCPSTORE_DCP_ROUTING=1`` (loaded by ``dcpstore-dcp-routing.pth``).

The ``.pth`` file that pip installs next to this module runs one line at every interpreter
start. When ``DCPSTORE_DCP_ROUTING`` is unset that line does nothing more than read the
environment. When it is set, :func:`install` adds an import hook, still without importing
torch or dcpstore: routing is switched on only once ``torch.distributed.checkpoint`` has
been imported by the program itself (see ``dcpstore.integrations.dcp_routing``).

Only the standard library may be imported here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["ENV_VAR", "install", "requested"]

ENV_VAR = "DCPSTORE_DCP_ROUTING"
_TARGET = "torch.distributed.checkpoint"


def requested(environ: Any = None) -> bool:
    """Whether ``$DCPSTORE_DCP_ROUTING`` asks for routing (``1``, ``true``, ``yes``, ``on``)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _enable() -> None:
    from dcpstore.integrations import dcp_routing

    dcp_routing.enable(propagate=False)


class _Loader(importlib.abc.Loader):
    """Runs the real loader of ``torch.distributed.checkpoint``, then enables routing."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _enable()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``torch.distributed.checkpoint``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot: also keeps find_spec below from recursing
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Enable routing now if torch's checkpoint package is loaded, else when it is."""
    if _TARGET in sys.modules:
        _enable()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
