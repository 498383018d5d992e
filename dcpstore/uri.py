"""Parsing checkpoint URIs and validating object keys.

A URI names a checkpoint *location*: ``/data/ckpt``, ``file:///data/ckpt``,
``s3://bucket/run7/step-1200?region=eu-west-1``. It splits into a scheme, a location
(bucket + path, or an absolute local path) and query options. Keys handed to a backend
are always relative to that location and may never climb out of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from .errors import InvalidURIError, UnsafeKeyError

__all__ = ["ParsedURI", "join_key", "parse_uri", "validate_key"]

LOCAL_SCHEME = "file"


@dataclass(frozen=True)
class ParsedURI:
    """A checkpoint URI split into its parts.

    Attributes:
        scheme: Lower-case scheme; ``"file"`` for bare local paths.
        location: What the backend roots itself at: an absolute path for local URIs,
            ``bucket/prefix`` (no trailing slash) for object stores.
        query: Options given in the URI query string.
        original: The URI as the user wrote it, minus its query string.
    """

    scheme: str
    location: str
    query: dict[str, str] = field(default_factory=dict)
    original: str = ""

    def __str__(self) -> str:
        return self.original


def parse_uri(uri: str | os.PathLike[str]) -> ParsedURI:
    """Split a checkpoint URI into scheme, location and query options.

    Args:
        uri: A bare path, ``file://`` URL or ``scheme://bucket/path[?k=v&...]``.

    Returns:
        The parsed URI.

    Raises:
        InvalidURIError: The URI is empty, has no bucket, or contains ``..`` segments.
    """
    text = os.fspath(uri)
    if not isinstance(text, str):
        raise InvalidURIError(f"checkpoint URI must be a str or path, got {type(uri).__name__}")
    text = text.strip()
    if not text:
        raise InvalidURIError(
            "checkpoint URI is empty; pass a local path or a URI like s3://bucket/run/step-1"
        )
    if "://" not in text:
        return ParsedURI(LOCAL_SCHEME, os.path.abspath(os.path.expanduser(text)), {}, text)

    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    original = text.split("?", 1)[0]
    if scheme == LOCAL_SCHEME:
        if parts.netloc not in ("", "localhost"):
            raise InvalidURIError(
                f"file URI {original!r} names host {parts.netloc!r}; use file:///absolute/path"
            )
        return ParsedURI(LOCAL_SCHEME, os.path.abspath(parts.path or "/"), query, original)
    if not scheme:
        raise InvalidURIError(f"URI {original!r} has no scheme")
    if "@" in parts.netloc:
        raise InvalidURIError(
            f"URI for scheme {scheme!r} carries credentials; credentials never belong in a URI. "
            "Use the store's standard credential chain (environment, profile, config file)."
        )
    if not parts.netloc:
        raise InvalidURIError(f"URI {original!r} has no bucket/host: expected {scheme}://bucket/path")
    segments = [s for s in parts.path.split("/") if s]
    if any(s in ("..", ".") for s in segments):
        raise InvalidURIError(
            f"URI {original!r} contains '.' or '..' segments; write the path without them"
        )
    location = "/".join([parts.netloc, *segments])
    return ParsedURI(scheme, location, query, original)


def validate_key(key: str) -> str:
    """Check that ``key`` stays inside the checkpoint root and return it.

    Raises:
        UnsafeKeyError: The key is empty, absolute, or contains ``.``/``..`` segments or
            backslashes.
    """
    if not isinstance(key, str) or not key:
        raise UnsafeKeyError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key or (len(key) > 1 and key[1] == ":"):
        raise UnsafeKeyError(f"object key {key!r} is absolute; keys are relative to the root")
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        raise UnsafeKeyError(
            f"object key {key!r} contains an empty, '.' or '..' segment and could escape "
            "the checkpoint root; refusing it"
        )
    return key


def join_key(*parts: str) -> str:
    """Join key parts with ``/`` and validate the result."""
    return validate_key("/".join(p.strip("/") for p in parts if p.strip("/")))
