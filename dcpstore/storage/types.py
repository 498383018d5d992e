"""The value types of the storage layer: objects, ranges, failures, options, uploads.

:class:`ObjectInfo` (what a listing or ``stat`` returns), :class:`ReadRange` (one byte
range a reader asks for), :class:`Failure` (how one exception of a request is handled),
:class:`BackendOptions` (the options every backend understands) and :class:`Upload` (a
streaming upload of one object). :mod:`dcpstore.storage.backend` re-exports them all.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy
from typing_extensions import Buffer

__all__ = [
    "BackendOptions",
    "Failure",
    "ObjectInfo",
    "ReadRange",
    "Upload",
    "uninitialized_buffer",
]


@dataclass(frozen=True)
class ObjectInfo:
    """What a backend knows about one stored object.

    Attributes:
        key: Key relative to the backend root.
        size: Size in bytes.
        mtime: Last modification time (seconds since the epoch) if known.
        version: What identifies this version of the object, where the store has it
            (S3 and Azure: the ETag; GCS: the generation; a file: its inode, mtime and
            size): what a conditional put's ``if_match`` compares. ``None`` where the
            store does not say (a listing usually does not).
    """

    key: str
    size: int
    mtime: float | None = None
    version: str | None = None


@dataclass(frozen=True)
class ReadRange:
    """One byte range to fetch: ``length`` bytes of ``key`` starting at ``offset``."""

    key: str
    offset: int
    length: int


@dataclass(frozen=True)
class Failure:
    """How one exception raised by a primitive is handled (see
    :meth:`~dcpstore.storage.backend.Backend._classify`).

    Attributes:
        error: What the caller sees once retrying stops: a Python exception
            (``FileNotFoundError``, ``PermissionError``, ``FileExistsError``,
            ``ConnectionError``, ``OSError``) or a dcpstore one
            (:class:`~dcpstore.errors.BucketNotFoundError`,
            :class:`~dcpstore.errors.StoreTimeoutError`,
            :class:`~dcpstore.errors.StoreThrottledError`), with the store's request id in
            the message and never a secret; the original exception itself to re-raise it
            unchanged. It is raised ``from`` the original.
        retryable: Whether the failure is transient (throttling, 5xx, timeouts, dropped
            connections): the request is tried again, up to ``max_attempts``.
    """

    error: BaseException
    retryable: bool = False


@dataclass
class BackendOptions:
    """Options every backend understands. Backends subclass this with their own.

    Attributes:
        max_concurrency: Most requests in flight at once per process, for upload parts
            and for ranged reads each: the ceiling of the adaptive limit and what the
            memory bound is computed from.
        adaptive_concurrency: Adapt the requests in flight to what the store sustains,
            between 1 and ``max_concurrency`` (see :mod:`dcpstore.storage.concurrency`): grow
            while throughput grows, back off on latency growth and throttling. ``False``:
            always ``max_concurrency`` in flight (the fixed behaviour).
        part_size: Bytes per upload part / write chunk.
        multipart_threshold: An object of unknown size up to this many bytes (and at
            least ``part_size``) is stored with one request, from one buffer; larger
            ones go up in parts. 0: ``part_size``.
        timeout: Seconds before a single request is abandoned (then retried).
        max_attempts: Attempts per request, the first included.
        retry_backoff: Base of the exponential backoff between attempts, in seconds.
        retry_backoff_max: Cap of a single backoff sleep, in seconds.
    """

    max_concurrency: int = 8
    adaptive_concurrency: bool = True
    part_size: int = 32 * 1024 * 1024
    multipart_threshold: int = 0
    timeout: float = 60.0
    max_attempts: int = 5
    retry_backoff: float = 0.2
    retry_backoff_max: float = 10.0

    def validate(self) -> None:
        """Raise ``ValueError`` for values that make no sense."""
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.part_size < 1:
            raise ValueError(f"part_size must be >= 1, got {self.part_size}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


class Upload(abc.ABC):
    """A streaming upload of one object.

    Call :meth:`write` any number of times, then exactly one of :meth:`commit` or
    :meth:`abort`. Until ``commit`` returns, the object is not visible under its key
    (object stores) or is visible only under its final, unique name with no reader
    referencing it (local files). ``write`` may block while earlier parts are in flight
    (that is the memory bound); it never keeps a reference to ``data`` after returning.
    """

    key: str

    @abc.abstractmethod
    def write(self, data: Buffer) -> int:
        """Append ``data``; return the number of bytes taken (always ``len(data)``)."""

    def expect_size(self, nbytes: int) -> None:
        """Announce, before the first :meth:`write`, that the object will hold about
        ``nbytes``: a backend may then store it with fewer requests (see
        :meth:`~dcpstore.storage.backend.Backend.upload_memory`). A hint only: more or
        fewer bytes may follow. The default ignores it."""
        return None

    @abc.abstractmethod
    def commit(self) -> ObjectInfo:
        """Finish the upload durably and return what was stored."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written; safe to call more than once and after errors."""

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


def uninitialized_buffer(nbytes: int) -> memoryview:
    """A writable byte buffer of ``nbytes`` that is not zero-filled first (it is about
    to be overwritten; ``bytearray(n)`` would write every byte twice)."""
    return numpy.empty(nbytes, dtype=numpy.uint8).data.cast("B")
