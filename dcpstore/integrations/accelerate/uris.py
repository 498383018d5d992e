"""Checkpoint URIs: refusing a ``scheme://`` collapsed by ``os.path`` or ``pathlib``, and
joining key segments onto a URI."""

from __future__ import annotations

import os
import re

import dcpstore
from dcpstore.errors import InvalidURIError

__all__ = ["check_uri", "is_remote", "join_uri"]

_REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "msc"})


def _schemes() -> frozenset[str]:
    return _REMOTE_SCHEMES | {s for s in dcpstore.available_backends() if s != "file"}


def check_uri(uri: str | os.PathLike[str]) -> str:
    """Return ``uri`` as a string, refusing one whose ``scheme://`` was collapsed.

    ``os.path.join`` / ``pathlib`` turn ``s3://b/x`` into ``s3:/b/x``; handed to a local
    file API that becomes a directory named ``s3:``. Such a string is an error here.

    Raises:
        dcpstore.InvalidURIError: ``uri`` is ``scheme:/...`` (or ``scheme:`` alone) for a
            scheme dcpstore serves.
    """
    text = os.fspath(uri)
    match = re.match(r"^(?:\./)?([A-Za-z][A-Za-z0-9+.-]*):(/?)(?!/)", text)
    if match and match.group(1).lower() in _schemes() and not text.startswith(
            f"{match.group(1)}://"):
        raise InvalidURIError(
            f"{text!r} looks like a {match.group(1)}:// URI whose '//' was collapsed (by "
            f"os.path or pathlib); it would become a local directory named "
            f"'{match.group(1)}:'. Pass the URI as a string, e.g. "
            f"'{match.group(1)}://bucket/prefix'.")
    return text


def join_uri(root: str | os.PathLike[str], *parts: str) -> str:
    """Join key segments onto a URI or local path, keeping ``scheme://`` and ``?query``."""
    text = check_uri(root)
    base, sep, query = text.partition("?")
    for part in parts:
        base = base.rstrip("/") + "/" + part.strip("/") if base else part
    return base + sep + query


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an object store rather than a local path."""
    scheme, sep, _ = uri.partition("://")
    return bool(sep) and scheme.lower() != "file"
