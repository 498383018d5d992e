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

from dcpstore.errors import InvalidURIError, UnsafeKeyError

__all__ = [
    "ParsedURI",
    "is_reference",
    "join_key",
    "parse_uri",
    "validate_key",
    "validate_reference",
    "validate_storage_path",
]

LOCAL_SCHEME = "file"


@dataclass(frozen=True)
class ParsedURI:
    """A checkpoint URI split into its parts.

    Attributes:
        scheme: Lower-case scheme; ``"file"`` for bare local paths.
        location: What the backend roots itself at: an absolute path for local URIs
            and for ``scheme:///abs/path`` (any scheme: a path-based store),
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
        uri: A bare path, ``file://`` URL, ``scheme://bucket/path[?k=v&...]`` or
            ``scheme:///abs/path`` (location ``/abs/path``, for path-based stores).

    Returns:
        The parsed URI.

    Raises:
        InvalidURIError: The URI is empty, has neither a bucket nor an absolute path,
            or contains ``..`` segments.
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
    segments = [s for s in parts.path.split("/") if s]
    if not parts.netloc and not (segments and parts.path.startswith("/")):
        raise InvalidURIError(
            f"URI {original!r} has no bucket/host: expected {scheme}://bucket/path (or "
            f"{scheme}:///absolute/path for a store rooted at a path)")
    if any(s in ("..", ".") for s in segments):
        raise InvalidURIError(
            f"URI {original!r} contains '.' or '..' segments; write the path without them"
        )
    if not parts.netloc:  # scheme:///abs/path: a path-based store's absolute root
        return ParsedURI(scheme, "/" + "/".join(segments), query, original)
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


#: How a ``relative_path`` that points into a sibling step begins.
REFERENCE_PREFIX = "../"


def is_reference(path: str) -> bool:
    """Whether a ``relative_path`` points into a sibling checkpoint (``../step-x/...``)."""
    return isinstance(path, str) and path.startswith(REFERENCE_PREFIX)


def validate_reference(path: str) -> tuple[str, str]:
    """Check a reference into a sibling checkpoint; return ``(sibling, file name)``.

    A reference is exactly ``../<sibling>/<data file>.distcp``: one level up, one
    directory down, one file. It can reach the run root's direct sub-directories and
    nothing else.

    Raises:
        UnsafeKeyError: The path has any other form.
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (len(parts) != 3 or parts[0] != ".." or not parts[2].endswith(".distcp")
            or "\\" in path or "\x00" in path
            or any(seg in ("", ".", "..") or seg.startswith("/") for seg in parts[1:])):
        raise UnsafeKeyError(
            f"object key {path!r} contains '..' segments and could escape the checkpoint "
            "root: it is not a reference of the form ../<sibling step>/<data file>.distcp; "
            "refusing it"
        )
    return parts[1], parts[2]


def validate_storage_path(path: str) -> str:
    """Check a ``relative_path`` of ``.metadata``: a key inside the checkpoint, or a
    reference into a sibling (see :func:`validate_reference`); return it.

    Raises:
        UnsafeKeyError: It is neither.
    """
    if is_reference(path):
        validate_reference(path)
        return path
    return validate_key(path)


def join_key(*parts: str) -> str:
    """Join key parts with ``/`` and validate the result."""
    return validate_key("/".join(p.strip("/") for p in parts if p.strip("/")))
