"""File calls on store URIs, for trainers whose own checkpoint code writes its small files
with ``open()``, ``os`` and ``pathlib`` (Megatron's ``metadata.json``, AReaL's recover info).

An integration binds these in place of the trainer's file calls for URIs only: a local
path keeps the trainer's own file I/O. Never a local fallback for a URI: a ``scheme://``
path that no dcpstore backend serves raises :class:`dcpstore.BackendNotFoundError`, and a
URI that lost a slash (``s3:/bucket/run``, from ``pathlib`` or ``os.path.normpath``) raises
:class:`~dcpstore.integrations.dcp_routing.MangledURIError`, where the trainer would have
made a local directory named ``s3:``.

A file opened for writing is stored as one object (an atomic ``put``) when it is closed
without an error; a ``with`` block left by an exception stores nothing.
"""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dcpstore.errors import InvalidURIError
from dcpstore.integrations.dcp_routing import check_uri
from dcpstore.storage.backend import Backend

__all__ = ["StoreFile", "backend", "is_object", "is_store_uri", "keys_under", "open_file",
           "split", "uri_text"]


def uri_text(path: Any) -> str | None:
    """``path`` (a string, bytes or path-like) as a string if it is a ``scheme://`` URI;
    ``None`` for a local path or anything that is no path.

    Raises:
        MangledURIError: ``path`` is a URI that lost a slash.
    """
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str | os.PathLike):
        return None
    text = os.fspath(path)
    if not isinstance(text, str):
        return None
    check_uri(text)
    return text if "://" in text else None


def is_store_uri(path: Any) -> bool:
    """Whether ``path`` is a ``scheme://`` URI, which then goes to the store, rather than a
    local path.

    Raises:
        MangledURIError: ``path`` is a URI that lost a slash.
        BackendNotFoundError: ``path`` is a URI whose scheme no installed backend serves.
    """
    text = uri_text(path)
    if text is None:
        return False
    from dcpstore.storage.resolve import resolve

    resolve(text, role="reader")  # raises for a scheme nothing serves, naming what is installed
    return True


def split(uri: str) -> tuple[str, str]:
    """``(parent, name)`` of an object's URI.

    Raises:
        InvalidURIError: ``uri`` names a bucket or root, not an object below one.
    """
    parent, _, name = uri.rstrip("/").rpartition("/")
    if not name or not parent or parent.endswith(":/"):
        raise InvalidURIError(f"{uri!r} names a bucket or root, not an object below one")
    return parent, name


@contextmanager
def backend(uri: str) -> Iterator[Backend]:
    """``dcpstore.open_backend(uri)``, closed at the end of the block."""
    from dcpstore.storage.resolve import open_backend

    store = open_backend(uri)
    try:
        yield store
    finally:
        store.close()


def keys_under(uri: str) -> list[str]:
    """The keys of every object below ``uri`` (one listing), relative to it."""
    with backend(uri) as store:
        return [info.key for info in store.list()]


def is_object(uri: str) -> bool:
    """Whether an object exists at ``uri`` (not a "directory" of objects below it)."""
    try:
        parent, name = split(uri)
    except InvalidURIError:
        return False
    with backend(parent) as store:
        return bool(store.exists(name))


class StoreFile(io.BytesIO):
    """A file being written to a store: one atomic ``put`` when closed without an error."""

    def __init__(self, uri: str) -> None:
        super().__init__()
        self.uri = uri
        self.failed = False

    def __exit__(self, *exc: Any) -> None:
        self.failed = exc[0] is not None
        super().__exit__(*exc)

    def close(self) -> None:
        if not self.closed and not self.failed:
            parent, name = split(self.uri)
            with backend(parent) as store:
                store.put(name, self.getvalue(), atomic=True)
        super().close()


class _StoreTextFile(io.TextIOWrapper):
    """The text-mode face of a :class:`StoreFile` (``open(uri, "w")``)."""

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None and isinstance(self.buffer, StoreFile):
            self.buffer.failed = True
        super().__exit__(*exc)


def open_file(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    """``open()`` for URIs: read with one ``get``, write as a :class:`StoreFile`; anything
    else (a local path, a file descriptor) goes to the built-in ``open``.

    Raises:
        ValueError: an append or update mode (``"a"``, ``"+"``) for a URI: a store keeps
            whole objects.
        FileNotFoundError: reading a URI where no object exists (as ``open`` would).
    """
    if isinstance(file, int) or not is_store_uri(file):
        return builtins.open(file, mode, *args, **kwargs)
    uri = os.fspath(file)
    if "+" in mode or "a" in mode:
        raise ValueError(f"open({uri!r}, {mode!r}): a store keeps whole objects; only "
                         "'r', 'rb', 'w', 'wb', 'x' and 'xb' are supported for a URI")
    encoding = kwargs.get("encoding") or "utf-8"
    newline = kwargs.get("newline")
    if "w" in mode or "x" in mode:
        raw = StoreFile(uri)
        return raw if "b" in mode else _StoreTextFile(raw, encoding=encoding, newline=newline)
    parent, name = split(uri)
    with backend(parent) as store:
        data = store.get(name)
    return io.BytesIO(data) if "b" in mode else io.StringIO(data.decode(encoding),
                                                            newline=newline)
