"""Exception types raised by dcpstore.

Every error a user can act on has its own type. Where a standard library exception
already names the condition (missing object, permission, timeout), the dcpstore type
subclasses it, so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "BackendNotFoundError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "DcpstoreError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "InvalidURIError",
    "ShardingError",
    "StoreThrottledError",
    "StoreTimeoutError",
    "UnsafeCheckpointError",
    "UnsafeKeyError",
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


class BucketNotFoundError(DcpstoreError, OSError):
    """The bucket, container or storage profile a URI names does not exist.

    Raised by every backend for the same failure (S3 ``NoSuchBucket``, GCS 404 on the
    bucket, an MSC storage that is missing). Deliberately *not* a ``FileNotFoundError``:
    a missing bucket is a configuration error, and must never read as "there is no
    checkpoint here yet" (which a ``FileNotFoundError`` from ``exists``/``stat`` means).
    """


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


class StoreTimeoutError(DcpstoreError, TimeoutError):
    """A storage request did not complete within its timeout (after retries)."""


class StoreThrottledError(DcpstoreError, OSError):
    """The store kept throttling requests (S3 ``SlowDown``, HTTP 429, ...) through every
    attempt. Raised with ``errno.EAGAIN``: lower ``max_concurrency``, raise
    ``max_attempts`` / ``retry_backoff_max``, or spread the keys (S3 ``prefix_strategy``).
    """
