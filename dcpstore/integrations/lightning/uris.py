"""Checkpoint URIs as Lightning hands them over: refusing one that ``pathlib`` or
``normpath`` mangled, and splitting and joining remote URIs and local paths."""

from __future__ import annotations

import os
import re
from pathlib import PurePath

import dcpstore
from dcpstore.errors import InvalidURIError

__all__ = ["checked_uri"]

# Schemes other tools use too: a local path component like "s3:" is a mangled URI.
_URI_SCHEMES = {"s3", "s3a", "s3n", "gs", "gcs", "msc", "az", "abfs", "abfss", "adl", "hdfs",
                "hf", "memory", "http", "https", "file"}
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$", re.S)


def _remote_schemes() -> list[str]:
    """The non-local schemes dcpstore has a backend for."""
    return sorted(s for s in dcpstore.available_backends() if s != "file")


def _is_remote(uri: str) -> bool:
    m = _SCHEME_RE.match(uri)
    return bool(m and m.group(2) == "//" and m.group(1).lower() in _remote_schemes())


def checked_uri(path: str | os.PathLike[str]) -> str:
    """Return ``path`` as a dcpstore URI string, refusing one that was mangled.

    Raises:
        dcpstore.InvalidURIError: ``path`` is a URI squashed by ``pathlib``/``normpath``
            (``s3:/b/x``), or a local path through a directory named like a scheme
            (``./s3:/b/x``), where the checkpoint would silently land on local disk.
    """
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise InvalidURIError(f"checkpoint path must be a non-empty string, got {path!r}")
    m = _SCHEME_RE.match(text)
    if m and m.group(1).lower() in (_URI_SCHEMES | set(_remote_schemes())) and len(m.group(1)) > 1:
        if m.group(2) != "//" or isinstance(path, PurePath):
            raise InvalidURIError(
                f"checkpoint path {text!r} looks like a {m.group(1)}:// URI whose '//' was "
                "collapsed (pathlib.Path or os.path.normpath does that); pass the URI as a plain "
                f"string, e.g. '{m.group(1)}://{m.group(3).lstrip('/')}'"
            )
        return text
    for part in PurePath(text).parts:
        if part.endswith(":") and part[:-1].lower() in (_URI_SCHEMES | set(_remote_schemes())):
            raise InvalidURIError(
                f"checkpoint path {text!r} goes through a local directory named {part!r}: a "
                "mangled URI. Pass the URI itself as a string (e.g. 's3://bucket/run') instead "
                "of a pathlib.Path or a path joined onto a local directory"
            )
    return text


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def _split(uri: str) -> tuple[str, str]:
    """``(parent, name)`` of a URI or local path."""
    uri = uri.rstrip("/")
    if _is_remote(uri):
        scheme, rest = uri.split("://", 1)
        if "/" not in rest:
            raise InvalidURIError(f"{uri!r} names a bucket root, not a checkpoint")
        parent, name = rest.rsplit("/", 1)
        return f"{scheme}://{parent}", name
    parent, name = os.path.split(os.path.abspath(uri))
    return parent, name
