"""Which backend serves a URI: explicit registrations, entry points, built-ins.

Lookup precedence for a *name* (a scheme, or the name given by the feature flag):
``register_backend`` > entry point in the ``dcpstore.backends`` group > built-in.
Which name is looked up: the ``backend=`` argument, else ``DCPSTORE_BACKEND``, else
the URI's scheme (the Megatron ``MultiStorageClientFeature`` pattern: one switch
routes every URI through one backend).
"""

from __future__ import annotations

import logging
import os
import threading
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Any

from dcpstore.errors import BackendNotFoundError

if TYPE_CHECKING:
    from dcpstore.storage.backend import Backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_backends",
    "backend_class",
    "register_backend",
    "selected_backend_name",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dcpstore.backends"
FEATURE_FLAG_ENV = "DCPSTORE_BACKEND"

#: Schemes dcpstore knows about even when their plugin is not installed.
KNOWN_SCHEMES: dict[str, str] = {
    "file": "built in",
    "s3": "pip install dcpstore-s3  (from this repository: pip install ./backends/s3)",
    "s3a": "pip install dcpstore-s3  (from this repository: pip install ./backends/s3)",
    "gs": "pip install dcpstore-gcs  (from this repository: pip install ./backends/gcs)",
    "gcs": "pip install dcpstore-gcs  (from this repository: pip install ./backends/gcs)",
    "msc": "pip install dcpstore-msc  (from this repository: pip install ./backends/msc)",
    "az": "pip install dcpstore-azure  (from this repository: pip install ./backends/azure)",
}

_lock = threading.Lock()
_explicit: dict[str, type[Backend]] = {}
_entry_points: dict[str, importlib_metadata.EntryPoint] | None = None


def _discover() -> dict[str, importlib_metadata.EntryPoint]:
    global _entry_points
    with _lock:
        if _entry_points is None:
            found: dict[str, importlib_metadata.EntryPoint] = {}
            for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
                found.setdefault(ep.name.lower(), ep)
            _entry_points = found
        return _entry_points


def register_backend(scheme: str, backend_cls: type[Any], *, clobber: bool = False) -> None:
    """Register a plugin for ``scheme`` in this process.

    Args:
        scheme: URI scheme (``"myfs"`` serves ``myfs://...``), case-insensitive.
        backend_cls: An :class:`~dcpstore.plugin.ObjectStore` subclass (the contract of
            :mod:`dcpstore.plugin`), or a framework ``Backend`` subclass.
        clobber: Replace an existing explicit registration instead of raising.

    Raises:
        ValueError: ``scheme`` is already registered explicitly and ``clobber`` is false.
        TypeError: ``backend_cls`` is neither.
    """
    backend_cls = as_backend_class(backend_cls)
    key = scheme.lower().removesuffix("://")
    if not key.isidentifier() and not key.replace("-", "").replace("+", "").isalnum():
        raise ValueError(f"invalid scheme {scheme!r}")
    with _lock:
        if key in _explicit and not clobber and _explicit[key] is not backend_cls:
            raise ValueError(
                f"scheme {key!r} is already registered to {_explicit[key].__name__}; "
                "pass clobber=True to replace it"
            )
        _explicit[key] = backend_cls


def available_backends() -> dict[str, str]:
    """Schemes usable right now, mapped to the class (or entry point) serving them."""
    out = {"file": "dcpstore.storage.local:LocalBackend"}
    for name, ep in _discover().items():
        out[name] = ep.value
    for name, cls in _explicit.items():
        out[name] = f"{cls.__module__}:{cls.__qualname__}"
    return dict(sorted(out.items()))


def selected_backend_name(scheme: str, backend: str | None = None) -> str:
    """The backend name to look up: ``backend`` > ``$DCPSTORE_BACKEND`` > ``scheme``."""
    if backend:
        return backend.lower()
    flag = os.environ.get(FEATURE_FLAG_ENV, "").strip()
    if flag:
        return flag.lower()
    return scheme.lower()


def backend_class(name: str) -> type[Backend]:
    """The backend class registered under ``name``.

    Raises:
        BackendNotFoundError: Nothing serves ``name``; the message says what to install
            for known schemes and lists what is available.
    """
    name = name.lower()
    if name in _explicit:
        return _explicit[name]
    ep = _discover().get(name)
    if ep is not None:
        try:
            loaded = ep.load()
        except Exception as exc:
            raise BackendNotFoundError(
                f"the backend plugin for {name}:// ({ep.value}) failed to import: {exc}"
            ) from exc
        return as_backend_class(loaded)
    if name == "file":
        from dcpstore.storage.local import LocalBackend

        return LocalBackend
    available = ", ".join(f"{s}://" for s in available_backends())
    hint = KNOWN_SCHEMES.get(name)
    if hint is not None:
        raise BackendNotFoundError(
            f"no backend installed for {name}:// URIs; install its plugin: {hint}. "
            f"Available now: {available}"
        )
    raise BackendNotFoundError(
        f"unknown storage scheme {name!r}; available: {available}. Plugins add schemes "
        f"through the {ENTRY_POINT_GROUP!r} entry-point group or dcpstore.register_backend()"
    )


def as_backend_class(cls: Any) -> type[Backend]:
    """The framework ``Backend`` class for a plugin class: an
    :class:`~dcpstore.plugin.ObjectStore` subclass is wrapped by the framework
    (:func:`dcpstore.storage.store_backend.backend_class`); a ``Backend`` subclass is
    used as it is.

    Raises:
        TypeError: ``cls`` is neither.
    """
    from dcpstore.storage.backend import Backend
    from dcpstore.storage.contract import ObjectStore
    from dcpstore.storage.store_backend import backend_class as wrap

    if isinstance(cls, type) and issubclass(cls, ObjectStore):
        return wrap(cls)
    if isinstance(cls, type) and issubclass(cls, Backend):
        return cls
    raise TypeError(f"a backend plugin must be a dcpstore.plugin.ObjectStore subclass, "
                    f"got {cls!r}")


def _reset_for_tests() -> None:
    global _entry_points
    with _lock:
        _explicit.clear()
        _entry_points = None
