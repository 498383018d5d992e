"""AReaL: ``FSDPEngine`` checkpoints and AReaL's recover flow on dcpstore URIs.

AReaL 1.0 saves its recover checkpoint with ``FSDPEngine.save(SaveLoadMeta(path,
weight_format="dcp", with_optim=True))``: ``os.makedirs(path)`` and then
``dcp.save({"dcp": DCPState(model, optimizer)}, checkpoint_id=path)``
(``areal/engine/fsdp_engine.py``). The rest of recovery is local file I/O: ``Saver``'s path
helpers call ``os.makedirs`` (``areal/utils/saver.py``), ``RecoverInfo.dump`` / ``load``
write and read six small files with ``open()`` + ``json`` / ``pickle``, and
``check_if_auto_recover`` / ``RecoverHandler`` look around with ``os.path.exists`` and
``os.listdir`` (``areal/utils/recover.py``). With a ``fileroot`` such as ``s3://bucket/run``
every one of those calls makes or reads a local directory named ``s3:``.

The user's change is one call before AReaL saves or recovers:

>>> from dcpstore.integrations import areal as dcpstore_areal
>>> dcpstore_areal.enable()
>>> config.recover.fileroot = "s3://bucket/run"      # RecoverConfig, unchanged otherwise

While enabled, AReaL's own code runs unchanged, with the names it uses for storage bound to
dcpstore in three of its modules (``areal.engine.fsdp_engine``, ``areal.utils.saver``,
``areal.utils.recover``; nothing else in the process changes):

- ``dcp.save`` / ``dcp.load`` by ``checkpoint_id`` get ``dcpstore.get_writer(path,
  overwrite=True)`` / ``dcpstore.get_reader(path)`` for every path dcpstore serves (local
  paths too). AReaL replaces the one recover checkpoint on every recovery save; dcpstore does
  it atomically (a crash mid-save leaves the previous one), checks the save plan for per-rank
  tensors saved as plain tensors, and writes an integrity manifest;
- ``os.makedirs`` of a URI stores nothing (object stores have no directories) and remembers
  the directory in this process, so AReaL's ``os.path.exists`` of a path it has just
  "made" is true as it is on local disk; ``os.path.exists`` / ``isdir`` / ``isfile`` /
  ``os.listdir`` of a URI otherwise ask the store (one listing);
- ``open(uri, "w"/"wb")`` in ``areal.utils.recover`` buffers the file and stores it with
  the backend's ``put`` when it is closed without an error; ``open(uri)`` / ``open(uri, "rb")``
  reads it with ``get`` (a missing object is a ``FileNotFoundError``, as AReaL expects).

Never a local fallback for a URI: a ``scheme://`` path that no dcpstore backend serves raises
:class:`dcpstore.BackendNotFoundError`; a URI that lost a slash (``s3:/bucket/run``, from
``pathlib`` or ``os.path.normpath``) raises
:class:`~dcpstore.integrations.dcp_routing.MangledURIError`; an HF export
(``weight_format="hf"``, which AReaL writes with ``save_pretrained`` into local files) to a
URI raises :class:`LocalFilesOnlyError`. Local paths keep AReaL's own file I/O.

Not covered: the experimental Archon engine (its own ``dcp.save`` calls and
``AsyncCheckpointManager``) and ``MegatronEngine`` (``megatron.core.dist_checkpointing``).

``DCPSTORE_DCP_ROUTING=1`` alone (:mod:`dcpstore.integrations.dcp_routing`) also catches
``FSDPEngine``'s ``dcp.save`` / ``dcp.load``, but not the rest: the empty local ``./s3:/...``
directories, the recover info written to local files, and a second recovery save into the
same recover checkpoint refused with :class:`dcpstore.CheckpointExistsError` (routing never
overwrites unless asked). Use :func:`enable` for AReaL.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from dcpstore.errors import DcpstoreError
from dcpstore.integrations.store_files import (
    is_object,
    is_store_uri,
    keys_under,
    open_file,
)

__all__ = ["SUPPORTED_AREAL", "LocalFilesOnlyError", "UnsupportedVersionError", "check_areal",
           "disable", "enable", "enabled", "is_enabled"]

logger = logging.getLogger(__name__)

#: AReaL releases whose internals this module was checked against: ``[low, high)``.
SUPPORTED_AREAL = ((1, 0), (1, 1))

#: The AReaL modules whose storage names this integration binds, and those names.
_MODULES = {
    "areal.engine.fsdp_engine": ("os", "dcp"),
    "areal.utils.saver": ("os",),
    "areal.utils.recover": ("os", "open"),
}
#: What AReaL must still have for the bindings above to mean what they meant in 1.0.
_EXPECTED = (
    ("areal.engine.fsdp_engine", "FSDPEngine", ("save", "load", "_save_to_dcp",
                                                "_load_from_dcp")),
    ("areal.utils.saver", "Saver", ("get_save_root", "get_model_save_root",
                                    "get_recover_checkpoint_path")),
    ("areal.utils.recover", "RecoverInfo", ("dump", "load")),
    ("areal.utils.recover", "RecoverHandler", ("recover_info_path", "_save_checkpoint",
                                               "_load_checkpoint")),
    ("areal.utils.recover", "check_if_auto_recover", ()),
)

_MISSING = object()
_lock = threading.RLock()
_saved: dict[tuple[str, str], Any] = {}
_engine_methods: dict[str, Any] = {}
#: Directories AReaL "made" on a store in this process (URIs, without a trailing slash).
_made: set[str] = set()


class UnsupportedVersionError(DcpstoreError, RuntimeError):
    """The installed AReaL's internals differ from those this integration adapts."""


class LocalFilesOnlyError(DcpstoreError, ValueError):
    """AReaL would write (or read) this URI as local files, which dcpstore cannot redirect:
    an HF export (``weight_format="hf"``) to a URI."""


# -- which paths are ours -------------------------------------------------------------------


# -- os, os.path and open() for AReaL's modules ---------------------------------------------


class _StorePath:
    """``os.path`` with ``exists`` / ``isdir`` / ``isfile`` answering for URIs."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os.path, name)

    @staticmethod
    def isdir(path: Any) -> bool:
        if not is_store_uri(path):
            return os.path.isdir(path)
        uri = os.fspath(path).rstrip("/")
        return uri in _made or bool(keys_under(uri))

    @staticmethod
    def isfile(path: Any) -> bool:
        return is_object(os.fspath(path)) if is_store_uri(path) else os.path.isfile(path)

    @classmethod
    def exists(cls, path: Any) -> bool:
        if not is_store_uri(path):
            return os.path.exists(path)
        return cls.isdir(path) or cls.isfile(path)


class _StoreOs:
    """``os`` with ``makedirs`` / ``listdir`` (and ``os.path``) answering for URIs."""

    path = _StorePath()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def makedirs(name: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
        if not is_store_uri(name):
            os.makedirs(name, mode, exist_ok)
            return
        uri = os.fspath(name).rstrip("/")
        if not exist_ok and _StorePath.exists(uri):
            raise FileExistsError(f"{uri} exists")
        scheme, _, rest = uri.partition("://")
        parts = rest.split("/")
        with _lock:
            for i in range(1, len(parts) + 1):
                _made.add(f"{scheme}://{'/'.join(parts[:i])}")

    @staticmethod
    def listdir(path: Any = ".") -> list[str]:
        if not is_store_uri(path):
            return os.listdir(path)
        uri = os.fspath(path).rstrip("/")
        names = {key.split("/", 1)[0] for key in keys_under(uri)}
        names |= {d[len(uri) + 1:].split("/", 1)[0] for d in _made
                  if d.startswith(uri + "/")}
        if not names and uri not in _made:
            raise FileNotFoundError(f"no such directory on the store: {uri}")
        return sorted(names)


class _StoreDcp:
    """``torch.distributed.checkpoint`` whose ``save`` / ``load`` by ``checkpoint_id`` use
    dcpstore's writer (overwriting atomically) and reader."""

    def __init__(self, module: ModuleType) -> None:
        self._dcp = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dcp, name)

    @staticmethod
    def _served(checkpoint_id: Any) -> bool:
        if checkpoint_id is None:
            return False
        from dcpstore.integrations.dcp_routing import serves

        return is_store_uri(checkpoint_id) or serves(checkpoint_id)

    def save(self, state_dict: Any, *, checkpoint_id: Any = None,
             storage_writer: Any = None, **kwargs: Any) -> Any:
        if storage_writer is None and self._served(checkpoint_id):
            from dcpstore.dcp.api import get_writer

            storage_writer = get_writer(checkpoint_id, overwrite=True)
        return self._dcp.save(state_dict, checkpoint_id=checkpoint_id,
                              storage_writer=storage_writer, **kwargs)

    def load(self, state_dict: Any, *, checkpoint_id: Any = None,
             storage_reader: Any = None, **kwargs: Any) -> Any:
        if storage_reader is None and self._served(checkpoint_id):
            from dcpstore.dcp.api import get_reader

            storage_reader = get_reader(checkpoint_id)
        return self._dcp.load(state_dict, checkpoint_id=checkpoint_id,
                              storage_reader=storage_reader, **kwargs)


def _refuse_hf(method: str, original: Any) -> Any:
    """``FSDPEngine.save`` / ``load``, refusing an HF export to or from a URI."""

    def checked(self: Any, meta: Any) -> Any:
        if getattr(meta, "weight_format", None) != "dcp" and is_store_uri(meta.path):
            raise LocalFilesOnlyError(
                f"FSDPEngine.{method}(weight_format={meta.weight_format!r}) to {meta.path!r}: "
                "AReaL writes HF checkpoints as local files (save_pretrained), which dcpstore "
                "cannot redirect. Use weight_format='dcp' for a URI, or keep saver.fileroot "
                "a local path (recover.fileroot may be the URI).")
        return original(self, meta)

    checked.__name__ = checked.__qualname__ = method
    checked.__doc__ = original.__doc__
    checked.__wrapped__ = original  # type: ignore[attr-defined]
    return checked


# -- enable / disable -------------------------------------------------------------------------


def _version_tuple(text: str) -> tuple[int, int]:
    import re

    parts = re.findall(r"\d+", text)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def check_areal() -> dict[str, ModuleType]:
    """Import the AReaL modules this integration binds and check their internals.

    Returns:
        The modules, by name.

    Raises:
        UnsupportedVersionError: AReaL's version is outside :data:`SUPPORTED_AREAL`, or a
            name this module binds or relies on is missing.
        ImportError: AReaL is not installed.
    """
    from importlib.metadata import version

    found = version("areal")
    modules = {name: importlib.import_module(name) for name in _MODULES}
    missing = [f"{m}.{n}" for m, names in _MODULES.items() for n in names
               if n != "open" and not hasattr(modules[m], n)]
    for module, owner, attributes in _EXPECTED:
        obj = getattr(modules[module], owner, None)
        if obj is None:
            missing.append(f"{module}.{owner}")
        missing += [f"{module}.{owner}.{a}" for a in attributes if not hasattr(obj, a)]
    low, high = SUPPORTED_AREAL
    if not low <= _version_tuple(found) < high or missing:
        raise UnsupportedVersionError(
            f"dcpstore's AReaL integration supports areal {low[0]}.{low[1]}.x; found {found}"
            + (f" without {', '.join(missing)}" if missing else "")
            + ". Install areal 1.0.x, or pass storage_writer=dcpstore.get_writer(uri, "
            "overwrite=True) / storage_reader=dcpstore.get_reader(uri) where AReaL calls "
            "dcp.save / dcp.load.")
    return modules


def enable() -> None:
    """Make AReaL's ``FSDPEngine`` save/load and its recover flow work on dcpstore URIs.

    Idempotent; undone by :func:`disable`. Imports AReaL's ``fsdp_engine``, ``saver`` and
    ``recover`` modules (AReaL is never imported by ``import dcpstore``).

    Raises:
        UnsupportedVersionError: The installed AReaL is not one this module adapts.
    """
    with _lock:
        if _saved:
            return
        modules = check_areal()
        import torch.distributed.checkpoint as dcp

        replacements = {"os": _StoreOs(), "open": open_file, "dcp": _StoreDcp(dcp)}
        for module_name, names in _MODULES.items():
            module = modules[module_name]
            for name in names:
                _saved[(module_name, name)] = module.__dict__.get(name, _MISSING)
                setattr(module, name, replacements[name])
        engine = modules["areal.engine.fsdp_engine"].FSDPEngine
        for method in ("save", "load"):
            _engine_methods[method] = engine.__dict__[method]
            setattr(engine, method, _refuse_hf(method, engine.__dict__[method]))
        logger.info("AReaL on dcpstore: FSDPEngine DCP checkpoints and recover files go "
                    "through dcpstore for the URIs it serves")


def disable() -> None:
    """Undo :func:`enable`: AReaL's modules get their own ``os``, ``open`` and ``dcp`` back."""
    with _lock:
        if not _saved:
            return
        for (module_name, name), value in _saved.items():
            module = importlib.import_module(module_name)
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)
        engine = importlib.import_module("areal.engine.fsdp_engine").FSDPEngine
        for method, original in _engine_methods.items():
            setattr(engine, method, original)
        _saved.clear()
        _engine_methods.clear()
        _made.clear()
        logger.info("AReaL on dcpstore disabled")


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect in this process."""
    return bool(_saved)


@contextmanager
def enabled() -> Iterator[None]:
    """:func:`enable` for a ``with`` block; the previous state is restored after it."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
