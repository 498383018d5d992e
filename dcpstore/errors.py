"""Exception types raised by dcpstore: one class per kind of failure, for every backend.

Every error a user can act on has its own type. Where a standard library exception
already names the condition (missing object, permission, timeout), the dcpstore type
subclasses it, so ``except FileNotFoundError`` keeps working.

Store failures (:class:`StoreError` and its kinds) are what a plugin's one error mapper
(:meth:`dcpstore.plugin.ObjectStore.map_error`) returns for its SDK's exceptions, decided
from status and error codes, never from message text. Each kind says whether the
framework retries it (:attr:`StoreError.retryable`) and carries the store's request id
(:attr:`StoreError.request_id`). Errors sent between ranks keep their class, ``errno``
and request id (:func:`encode_error`, :func:`decode_error`).
"""

from __future__ import annotations

import builtins
import errno as _errno
import json
from typing import Any, ClassVar

__all__ = [
    "AccessDeniedError",
    "BackendNotFoundError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "DcpstoreError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "InvalidURIError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PreconditionFailedError",
    "ShardingError",
    "StoreError",
    "StoreThrottledError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "UnsafeCheckpointError",
    "UnsafeKeyError",
    "decode_error",
    "encode_error",
]


class DcpstoreError(Exception):
    """Base class of every error dcpstore raises on its own account."""


class InvalidURIError(DcpstoreError, ValueError):
    """A checkpoint URI is empty, malformed or tries to escape its root."""


class UnsafeKeyError(InvalidURIError):
    """An object key (e.g. a ``relative_path`` stored in ``.metadata``) is absolute or
    contains ``..``; it would read or write outside the checkpoint root."""


class BackendNotFoundError(DcpstoreError, LookupError):
    """No backend is registered for a URI scheme (or the named backend is unknown)."""


class CheckpointNotFoundError(DcpstoreError, FileNotFoundError):
    """There is no checkpoint (no ``.metadata`` and no data files) at a location."""


class IncompleteCheckpointError(DcpstoreError, FileNotFoundError):
    """Data files exist but ``.metadata`` does not: a save that never committed."""


class CheckpointExistsError(DcpstoreError, FileExistsError):
    """A committed checkpoint already exists and overwriting was not asked for."""


class IntegrityError(DcpstoreError, OSError):
    """Bytes read back do not match the integrity manifest (size or CRC32C)."""


class UnsafeCheckpointError(DcpstoreError):
    """A checkpoint holds a pickle that would import or call something not allowed."""


class ShardingError(DcpstoreError, ValueError):
    """Per-rank state is about to be saved in a form that cannot be resharded."""


class CheckpointMismatchError(DcpstoreError, KeyError):
    """The state dict being loaded does not match the checkpoint's keys or shapes."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ConfigurationError(DcpstoreError, ValueError):
    """An option, a credential source, an endpoint or a profile is wrong or missing: the
    request was never worth retrying. The message names the option and what to set."""


class StoreError(DcpstoreError, OSError):
    """A request to the store failed; the base of every store failure kind.

    Raised like ``OSError``: ``StoreError(errno, message)`` or ``StoreError(message)``
    (the kind's own errno). A plugin's :meth:`~dcpstore.plugin.ObjectStore.map_error`
    returns one of its subclasses.

    Attributes:
        request_id: The store's id of the failed request, where it gave one (quote it
            to the store's support); never a secret.
        retryable: Whether the framework retries a request that failed this way: the
            kind's default, or ``retryable=`` given for one failure (an untrusted TLS
            certificate is unavailable but not worth retrying).
    """

    retryable: bool = False
    default_errno: ClassVar[int] = _errno.EIO

    def __init__(self, *args: Any, request_id: str | None = None,
                 retryable: bool | None = None) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (self.default_errno, args[0])
        super().__init__(*args)
        self.request_id = request_id
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        text = self.strerror if self.strerror is not None else super().__str__()
        if self.request_id and self.request_id not in text:
            text = f"{text} (request id {self.request_id})"
        return text


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """The object does not exist (the bucket does)."""

    default_errno = _errno.ENOENT


class BucketNotFoundError(StoreError):
    """The bucket, container or storage profile a URI names does not exist.

    Raised by every backend for the same failure (S3 ``NoSuchBucket``, GCS 404 on the
    bucket, Azure ``ContainerNotFound``, an MSC storage that is missing). Deliberately
    *not* a ``FileNotFoundError``: a missing bucket is a configuration error, and must
    never read as "there is no checkpoint here yet".
    """

    default_errno = _errno.ENOENT


class AccessDeniedError(StoreError, PermissionError):
    """The store refused the request: credentials missing, wrong or without the right
    (HTTP 401/403), or a wrong encryption key."""

    default_errno = _errno.EACCES


class StoreThrottledError(StoreError):
    """The store kept throttling requests (S3 ``SlowDown``, HTTP 429, ...) through every
    attempt. Raised with ``errno.EAGAIN``: lower ``max_concurrency``, raise
    ``max_attempts`` / ``retry_backoff_max``, or spread the keys (S3 ``prefix_strategy``).
    """

    retryable = True
    default_errno = _errno.EAGAIN


class StoreTimeoutError(StoreError, TimeoutError):
    """A storage request did not complete within its timeout (after retries)."""

    retryable = True
    default_errno = _errno.ETIMEDOUT


class StoreUnavailableError(StoreError, ConnectionError):
    """The store could not be reached or answered with a server error (HTTP 5xx, a
    dropped connection) through every attempt."""

    retryable = True
    default_errno = _errno.ECONNRESET


class ObjectTooLargeError(StoreError):
    """An object exceeds what the store accepts (its size limit, or its most parts per
    upload): raise ``part_size`` or save more, smaller files (``files_per_rank``)."""

    default_errno = _errno.EFBIG


class PreconditionFailedError(StoreError, FileExistsError):
    """A conditional write lost: the object exists already (``if_absent``) or changed
    since it was read (``if_match``)."""

    default_errno = _errno.EEXIST


def encode_error(exc: BaseException) -> bytes:
    """``exc`` as bytes to send to other ranks: its class (a dcpstore or builtin
    exception's), ``errno``, message and request id; :func:`decode_error` rebuilds it."""
    return json.dumps({
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "errno": getattr(exc, "errno", None),
        "message": getattr(exc, "strerror", None) or str(exc),
        "request_id": getattr(exc, "request_id", None),
    }).encode()


def decode_error(data: bytes, note: str = "") -> BaseException:
    """The exception :func:`encode_error` encoded: the same class where it is a dcpstore
    error or a builtin exception (another class becomes a :class:`DcpstoreError` that
    names it), with its ``errno`` and request id.

    Args:
        data: What :func:`encode_error` returned.
        note: Appended to the message (e.g. which rank saw the error first).
    """
    fields = json.loads(data)
    name, message = str(fields.get("type")), str(fields.get("message", "")) + note
    number, request_id = fields.get("errno"), fields.get("request_id")
    cls: Any = None
    if fields.get("module") == __name__:
        cls = globals().get(name)
    elif fields.get("module") == "builtins":
        cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return DcpstoreError(f"{name}: {message}")
    try:
        if issubclass(cls, StoreError):
            return cls(number, message, request_id=request_id) if number is not None \
                else cls(message, request_id=request_id)
        if issubclass(cls, OSError) and number is not None:
            return cls(number, message)
        return cls(message)
    except Exception:  # a class whose constructor wants more
        return DcpstoreError(f"{name}: {message}")
