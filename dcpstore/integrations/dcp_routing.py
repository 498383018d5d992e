"""Route plain ``dcp.save(checkpoint_id=uri)`` / ``dcp.load`` / ``dcp.async_save`` to dcpstore.

Without a ``storage_writer``/``storage_reader``, torch picks one from ``checkpoint_id``
and knows only ``FileSystemWriter`` and ``FsspecWriter``. :func:`enable` replaces that
choice (torch's private ``_storage_setup``, where ``state_dict_saver`` and
``state_dict_loader`` use it) so that every ``checkpoint_id`` dcpstore serves (local
paths, ``file://``, ``s3://``, ``gs://``, ``msc://``, plugin schemes) gets
:func:`dcpstore.get_writer` / :func:`dcpstore.get_reader`. A writer or reader passed by
the caller still wins; a scheme no dcpstore backend serves still goes to torch.

Three ways to switch it on:

>>> from dcpstore.integrations import dcp_routing
>>> dcp_routing.enable()                 # for the rest of the process
>>> with dcp_routing.routing(): ...      # for a block
$ DCPSTORE_DCP_ROUTING=1 torchrun train.py   # no code change (a .pth start-up hook)

The hook point is private to torch, so :func:`enable` first checks that it is there and
behaves as expected, and raises :class:`DcpRoutingUnsupportedError` naming the torch
version when it is not. It never falls back silently.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dcpstore import torch_internals
from dcpstore.errors import DcpstoreError, InvalidURIError

if TYPE_CHECKING:
    from dcpstore.storage.resolve import Resolved, Role

__all__ = [
    "ENV_VAR",
    "DcpRoutingUnsupportedError",
    "MangledURIError",
    "check_uri",
    "disable",
    "enable",
    "is_enabled",
    "routing",
    "serves",
]

logger = logging.getLogger(__name__)

ENV_VAR = "DCPSTORE_DCP_ROUTING"

_SAVER = "torch.distributed.checkpoint.state_dict_saver"
_LOADER = "torch.distributed.checkpoint.state_dict_loader"
# DCP's hook point is private to torch: dcpstore.torch_internals names it
_UTILS = torch_internals.STORAGE_SETUP_MODULE
_HOOK = torch_internals.STORAGE_SETUP_NAME
_EXPECTED_PARAMS = torch_internals.STORAGE_SETUP_PARAMS

_lock = threading.RLock()
_original: Callable[..., Any] | None = None
_saved_env: str | None = None
_propagated = False


class DcpRoutingUnsupportedError(DcpstoreError, RuntimeError):
    """This torch's checkpoint internals are not the ones DCP routing knows how to hook."""


class MangledURIError(InvalidURIError):
    """A checkpoint URI lost a slash (``s3://b/x`` became ``s3:/b/x``), e.g. through ``Path``."""


# "s3:/bucket/x", "out/gs:/b/x", "file:/abs": a scheme followed by one slash, as
# pathlib.Path (and os.path.normpath) leave a URL. One-letter schemes are drive letters.
_MANGLED = re.compile(r"(?:^|/)(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]+):/(?!/)")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _known_schemes() -> set[str]:
    from dcpstore.storage.registry import KNOWN_SCHEMES, available_backends

    return {s.lower() for s in (*KNOWN_SCHEMES, *available_backends())}


def check_uri(checkpoint_id: str | os.PathLike[str]) -> None:
    """Raise :class:`MangledURIError` if ``checkpoint_id`` is a URL that lost a slash.

    ``pathlib.Path("s3://bucket/run")`` is ``s3:/bucket/run``; saving there would create a
    local directory named ``s3:``. Any path segment ``<scheme>:`` of a scheme dcpstore
    knows, followed by a single slash, is refused.

    Raises:
        MangledURIError: The path looks like a mangled ``scheme://`` URI.
    """
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str):
        return
    for match in _MANGLED.finditer(text):
        scheme = match.group("scheme").lower()
        if "://" in text[: match.end()]:
            return  # a real URL whose path happens to contain "x:/"
        if scheme in _known_schemes():
            rest = text[match.end():]
            raise MangledURIError(
                f"checkpoint path {text!r} looks like a {scheme}:// URI that lost a slash "
                f"(pathlib.Path or os.path.normpath turn '{scheme}://' into '{scheme}:/'); "
                f"it would be written to a local directory named '{scheme}:'. Pass the URI "
                f"as a string: '{scheme}://{rest}'"
            )


def serves(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether a dcpstore backend serves ``checkpoint_id`` (so routing would take it).

    Raises:
        MangledURIError: ``checkpoint_id`` is a mangled URI (see :func:`check_uri`).
    """
    from dcpstore.storage.registry import backend_class, selected_backend_name
    from dcpstore.storage.uri import parse_uri

    check_uri(checkpoint_id)
    try:
        parsed = parse_uri(checkpoint_id)
        backend_class(selected_backend_name(parsed.scheme))
    except DcpstoreError as exc:
        logger.debug("dcpstore does not serve %r (%s); leaving it to torch", checkpoint_id, exc)
        return False
    return True


def _resolve(checkpoint_id: str | os.PathLike[str], role: Role) -> Resolved | None:
    """``checkpoint_id`` resolved once (routing passes the result on), or ``None`` where
    no dcpstore backend serves it.

    Raises:
        MangledURIError: ``checkpoint_id`` is a mangled URI (see :func:`check_uri`).
    """
    from dcpstore.storage.resolve import resolve

    check_uri(checkpoint_id)
    try:
        return resolve(checkpoint_id, role=role)
    except DcpstoreError as exc:
        logger.debug("dcpstore does not serve %r (%s); leaving it to torch", checkpoint_id, exc)
        return None


def _routed_storage_setup(
    storage: Any, checkpoint_id: Any, reader: bool = False
) -> Any:
    original = _original
    if original is None:  # disabled while a reference to us was kept somewhere
        original = getattr(torch_internals.dcp_storage_setup(), _HOOK)
    if storage or not checkpoint_id or not isinstance(checkpoint_id, str | os.PathLike):
        return original(storage, checkpoint_id, reader=reader)
    resolved = _resolve(checkpoint_id, "reader" if reader else "writer")
    if resolved is None:
        return original(storage, checkpoint_id, reader=reader)
    from dcpstore.dcp.api import get_reader, get_writer

    chosen = get_reader(resolved) if reader else get_writer(resolved)
    logger.debug("DCP routing: %s for %s", type(chosen).__name__, checkpoint_id)
    return chosen


def _check_torch() -> tuple[Any, Any, Any]:
    """Import torch's checkpoint modules and check the hook point; return them."""
    import importlib

    try:
        utils, saver, loader = (importlib.import_module(m) for m in (_UTILS, _SAVER, _LOADER))
    except ImportError as exc:
        raise DcpRoutingUnsupportedError(
            f"DCP routing cannot hook torch {_torch_version()}: {exc}. Pass "
            "storage_writer=dcpstore.get_writer(uri) / storage_reader=dcpstore.get_reader(uri) "
            "to dcp.save / dcp.load instead."
        ) from exc
    problems = []
    setup = getattr(utils, _HOOK, None)
    if not callable(setup):
        problems.append(f"{_UTILS}.{_HOOK} is missing")
    else:
        try:
            params = list(inspect.signature(setup).parameters)
        except (TypeError, ValueError):
            params = []
        if params != _EXPECTED_PARAMS and setup is not _routed_storage_setup:
            problems.append(f"{_HOOK} takes {params}, expected {_EXPECTED_PARAMS}")
    for module in (saver, loader):
        used = getattr(module, _HOOK, None)
        if used is None:
            problems.append(f"{module.__name__} no longer uses {_HOOK}")
        elif used is not setup and used is not _routed_storage_setup:
            problems.append(f"{module.__name__}.{_HOOK} is not {_UTILS}.{_HOOK}")
    if problems:
        raise DcpRoutingUnsupportedError(
            f"DCP routing does not support torch {_torch_version()}: its checkpoint internals "
            f"differ from what dcpstore hooks ({'; '.join(problems)}). Routing is NOT enabled. "
            "Pass storage_writer=dcpstore.get_writer(uri) / "
            "storage_reader=dcpstore.get_reader(uri) to dcp.save / dcp.load instead, or use a "
            "dcpstore integration for your trainer."
        )
    return utils, saver, loader


def enable(*, propagate: bool = True) -> None:
    """Route ``dcp.save`` / ``dcp.load`` / ``dcp.async_save`` by ``checkpoint_id`` to dcpstore.

    Idempotent. Explicit ``storage_writer``/``storage_reader`` arguments still win, and
    ``checkpoint_id``s that no dcpstore backend serves still go to torch's own writers.

    Args:
        propagate: Also set ``DCPSTORE_DCP_ROUTING=1`` in ``os.environ`` so that child
            processes started from now on route too (``dcp.async_save`` with
            ``AsyncCheckpointerType.PROCESS`` saves from a spawned process). Needs the
            start-up hook that ``pip install dcpstore`` ships; :func:`disable` restores
            the variable.

    Raises:
        DcpRoutingUnsupportedError: This torch's internals are not the expected ones.
    """
    global _original, _saved_env, _propagated
    with _lock:
        utils, saver, loader = _check_torch()
        if _original is None:
            _original = getattr(utils, _HOOK)
            for module in (utils, saver, loader):
                setattr(module, _HOOK, _routed_storage_setup)
            logger.info("DCP routing enabled: dcp.save/load by checkpoint_id go to dcpstore")
        if propagate and not _propagated:
            _saved_env = os.environ.get(ENV_VAR)
            os.environ[ENV_VAR] = "1"
            _propagated = True


def disable() -> None:
    """Undo :func:`enable`: torch chooses storage by ``checkpoint_id`` again."""
    global _original, _saved_env, _propagated
    with _lock:
        if _original is not None:
            import importlib

            for name in (_UTILS, _SAVER, _LOADER):
                module = importlib.import_module(name)
                if getattr(module, _HOOK, None) is _routed_storage_setup:
                    setattr(module, _HOOK, _original)
            _original = None
            logger.info("DCP routing disabled")
        if _propagated:
            if _saved_env is None:
                os.environ.pop(ENV_VAR, None)
            else:
                os.environ[ENV_VAR] = _saved_env
            _saved_env = None
            _propagated = False


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect in this process."""
    return _original is not None


@contextmanager
def routing(*, propagate: bool = True) -> Iterator[None]:
    """Enable routing for a ``with`` block; restore the previous state after it.

    Wait for ``dcp.async_save`` futures inside the block: with the default thread
    executor torch picks the writer in its background thread.
    """
    was_enabled = is_enabled()
    enable(propagate=propagate)
    try:
        yield
    finally:
        if not was_enabled:
            disable()
