"""The backend contract: a narrow object-store interface every backend implements.

A backend is rooted at one *location* (a local directory, ``bucket/prefix``) and
speaks in keys relative to it. The generic :class:`~dcpstore.Writer` and
:class:`~dcpstore.Reader` only ever call the public methods below, in this order:

Save (every rank)::

    up = backend.open_upload("__0_0.<save>.distcp")   # one per data file
    up.write(buf); up.write(buf); ...                   # streamed, parts in flight
    info = up.commit()                                  # or up.abort() on failure

Save (coordinator only)::

    backend.exists(".metadata")                         # overwrite check, once
    backend.put(".dcpstore-<save>.json", manifest)      # small objects: one request
    backend.put(".metadata", pickled, atomic=True)      # the commit point
    backend.delete([...stale keys...])

Load (every rank)::

    backend.get(".metadata"); backend.get(manifest)
    for index, view in backend.read_ranges([ReadRange(key, off, len), ...]):
        ...                                             # completion order, bounded memory

Housekeeping (CLI, Checkpointer, coordinator): ``list(prefix)``, ``stat``, ``delete``,
``list_uploads`` / ``abort_uploads``.

Implementers override the underscore primitives (``_open_upload``, ``_read_into``,
``_put``, ``_get``, ``_stat``, ``_list``, ``_delete``) and, for object stores,
``_translate_error`` / ``_is_retryable``. The base class adds key validation,
retries with exponential backoff and jitter, error translation to Python's exceptions
(``FileNotFoundError``, ``PermissionError``, ``FileExistsError``, ``TimeoutError``,
``OSError``) and bounded concurrency for ranged reads. Backends must be picklable:
create clients lazily and drop them in ``__getstate__``.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)
from typing_extensions import Buffer

from .errors import InvalidURIError, StoreTimeoutError
from .uri import ParsedURI, validate_key

__all__ = [
    "Backend",
    "BackendOptions",
    "ObjectInfo",
    "ReadRange",
    "Upload",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """What a backend knows about one stored object.

    Attributes:
        key: Key relative to the backend root.
        size: Size in bytes.
        mtime: Last modification time (seconds since the epoch) if known.
    """

    key: str
    size: int
    mtime: float | None = None


@dataclass(frozen=True)
class ReadRange:
    """One byte range to fetch: ``length`` bytes of ``key`` starting at ``offset``."""

    key: str
    offset: int
    length: int


@dataclass
class BackendOptions:
    """Options every backend understands. Backends subclass this with their own.

    Attributes:
        max_concurrency: Requests in flight at once per process (reads, upload parts).
        part_size: Bytes per upload part / write chunk.
        timeout: Seconds before a single request is abandoned (then retried).
        max_attempts: Attempts per request, the first included.
        retry_backoff: Base of the exponential backoff between attempts, in seconds.
        retry_backoff_max: Cap of a single backoff sleep, in seconds.
    """

    max_concurrency: int = 8
    part_size: int = 32 * 1024 * 1024
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


class Backend(abc.ABC):
    """Base class of storage backends. See the module docstring for the call order.

    Args:
        location: Where the backend is rooted (absolute path or ``bucket/prefix``).
        options: The backend's options dataclass instance.
    """

    #: Options dataclass of this backend; ``get_writer(**options)`` fills it.
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    #: Name used in error messages, ``DCPSTORE_<NAME>_*`` variables and the registry.
    name: ClassVar[str] = "backend"
    #: URI schemes this backend serves natively (empty: any scheme it is routed).
    schemes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_uri(cls, uri: ParsedURI, options: BackendOptions) -> Backend:
        """Create a backend for a parsed URI. Backends that accept URIs of other schemes
        (the feature flag routes any URI to them) override this."""
        if cls.schemes and uri.scheme not in cls.schemes:
            raise InvalidURIError(
                f"backend {cls.name!r} cannot serve {uri.scheme}:// URIs (it serves "
                f"{', '.join(s + '://' for s in cls.schemes)}); unset DCPSTORE_BACKEND or "
                "pick another backend="
            )
        return cls(uri.location, options)

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        self.location = location
        self.options = options if options is not None else self.Options()
        self.options.validate()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._upload_slots = threading.BoundedSemaphore(self.options.max_concurrency)
        #: Upload part buffers, reused across parts (``dcpstore.multipart.PartBuffers``).
        self._part_buffers: dict[Any, Any] = {}

    # -- description -----------------------------------------------------------------

    @property
    def uri(self) -> str:
        """URI of the root, without credentials or options."""
        return f"{self.name}://{self.location}"

    def child(self, key: str) -> Backend:
        """A backend of the same kind and options rooted at ``key`` under this root."""
        return type(self)(self.location.rstrip("/") + "/" + validate_key(key), self.options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state.pop("_pool_lock", None)
        state.pop("_upload_slots", None)
        state.pop("_part_buffers", None)
        for name in self._lazy_attributes():
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool_lock = threading.Lock()
        self._upload_slots = threading.BoundedSemaphore(self.options.max_concurrency)
        self._part_buffers = {}

    def _lazy_attributes(self) -> Sequence[str]:
        """Attributes holding clients or sessions, dropped when pickling."""
        return ()

    def close(self) -> None:
        """Release threads, clients and idle upload buffers; the backend stays usable
        (they are recreated)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._pool_lock:
            self._part_buffers = {}  # buffers still in use go back to the dropped pools

    # -- primitives (override) -----------------------------------------------------

    @abc.abstractmethod
    def _open_upload(self, key: str) -> Upload: ...

    @abc.abstractmethod
    def _read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``key`` from ``offset``; a short
        object is an ``EOFError``."""

    def _read_into_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fill ``outs`` in order with consecutive bytes of ``key`` from ``offset``.

        One request for the whole span. This default stages it in one buffer and copies
        it out; backends whose client can read into several buffers override it.
        """
        staged = memoryview(bytearray(sum(len(o) for o in outs)))
        self._read_into(key, offset, staged)
        pos = 0
        for out in outs:
            out[:] = staged[pos : pos + len(out)]
            pos += len(out)

    @abc.abstractmethod
    def _put(self, key: str, data: bytes, *, atomic: bool) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def _stat(self, key: str) -> ObjectInfo: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursively), any order."""

    @abc.abstractmethod
    def _delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys``; missing keys are not an error."""

    def _translate_error(self, exc: BaseException, key: str | None) -> BaseException | None:
        """Map a client exception to a Python one (keep request ids in the message).

        Return ``None`` to re-raise ``exc`` unchanged.
        """
        return None

    def _is_retryable(self, exc: BaseException) -> bool:
        """Whether an (untranslated) exception is transient: throttling, 5xx, resets."""
        return isinstance(exc, (ConnectionError, TimeoutError)) and not isinstance(
            exc, StoreTimeoutError
        )

    def list_uploads(self, prefix: str = "") -> list[tuple[str, str]]:
        """Unfinished multipart uploads under ``prefix`` as ``(key, upload_id)``."""
        return []

    def abort_uploads(self, uploads: Iterable[tuple[str, str]]) -> None:
        """Abort unfinished multipart uploads returned by :meth:`list_uploads`."""
        for _ in uploads:
            raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    # -- public API ------------------------------------------------------------------

    def open_upload(self, key: str) -> Upload:
        """Start a streaming upload of ``key`` (see :class:`Upload`)."""
        return self._call(self._open_upload, validate_key(key), key=key)

    def put(self, key: str, data: bytes, *, atomic: bool = False) -> None:
        """Store a small object in one request. ``atomic=True`` promises readers see the
        old object or the new one, never a partial one (local: temp file + rename)."""
        validate_key(key)
        self._call(self._put, key, data, atomic=atomic, key=key)

    def get(self, key: str) -> bytes:
        """Read a whole (small) object."""
        return self._call(self._get, validate_key(key), key=key)

    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of ``key``; ``FileNotFoundError`` when absent."""
        return self._call(self._stat, validate_key(key), key=key)

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""
        try:
            self.stat(key)
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects under the root whose key starts with ``prefix``, sorted by key."""
        if prefix:
            validate_key(prefix.rstrip("/") or "x")
        return sorted(self._call(lambda: list(self._list(prefix)), key=prefix or None),
                      key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects; keys that do not exist are ignored."""
        batch = [validate_key(k) for k in keys]
        if batch:
            self._call(self._delete, batch, key=batch[0])

    def read_ranges(
        self,
        ranges: Sequence[ReadRange],
        buffers: Sequence[memoryview | Sequence[memoryview]] | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """Fetch many byte ranges concurrently; yield ``(index, data)`` as each completes.

        At most ``max_concurrency`` ranges are in flight, and at most twice that many
        completed-but-unconsumed buffers are held, so memory stays bounded however many
        ranges are asked for.

        Args:
            ranges: The ranges to fetch.
            buffers: Optional destinations, one per range: a view of exactly its length,
                or a list of views whose lengths add up to it, filled in order from one
                request (a scatter read: e.g. straight into destination tensors).
                Without it each range gets a fresh, uninitialized buffer.
        """
        for r in ranges:
            validate_key(r.key)
        if buffers is not None and len(buffers) != len(ranges):
            raise ValueError("read_ranges: one buffer per range is required")
        if not ranges:
            return iter(())
        return self._read_ranges(ranges, buffers)

    def _read_ranges(
        self,
        ranges: Sequence[ReadRange],
        buffers: Sequence[memoryview | Sequence[memoryview]] | None,
    ) -> Iterator[tuple[int, Any]]:
        def fetch(i: int) -> tuple[int, Any]:
            r = ranges[i]
            out = buffers[i] if buffers is not None else uninitialized_buffer(r.length)
            if isinstance(out, memoryview):
                if len(out) != r.length:
                    raise ValueError(f"read_ranges: buffer {i} holds {len(out)} bytes, "
                                     f"range is {r.length}")
                if r.length:
                    self._call(self._read_into, r.key, r.offset, out, key=r.key)
            else:
                if sum(len(o) for o in out) != r.length:
                    raise ValueError(f"read_ranges: buffers {i} do not add up to {r.length}")
                if len(out) == 1:
                    self._call(self._read_into, r.key, r.offset, out[0], key=r.key)
                elif r.length:
                    self._call(self._read_into_scatter, r.key, r.offset, out, key=r.key)
            return i, out

        if len(ranges) == 1 or self.options.max_concurrency == 1:
            for i in range(len(ranges)):
                yield fetch(i)
            return
        pool = self._executor()
        limit = self.options.max_concurrency
        pending: set[Future[tuple[int, Any]]] = set()
        next_index = 0
        try:
            while next_index < len(ranges) or pending:
                while next_index < len(ranges) and len(pending) < limit:
                    pending.add(pool.submit(fetch, next_index))
                    next_index += 1
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()
        finally:
            for fut in pending:
                fut.cancel()
            wait(pending)

    # -- machinery -------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        """Shared worker pool of this backend (created on first use)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.options.max_concurrency,
                    thread_name_prefix=f"dcpstore-{self.name}",
                )
            return self._pool

    def _retrying(self) -> Retrying:
        o = self.options

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.warning(
                "%s: attempt %d/%d failed (%s); retrying", self.uri, state.attempt_number,
                o.max_attempts, _describe(exc),
            )

        return Retrying(
            stop=stop_after_attempt(o.max_attempts),
            wait=wait_random_exponential(multiplier=o.retry_backoff, max=o.retry_backoff_max),
            retry=retry_if_exception(self._is_retryable),
            before_sleep=log_retry,
            reraise=True,
        )

    def _call(self, fn: Any, *args: Any, key: str | None = None, **kwargs: Any) -> Any:
        """Run one request with retries, then translate what escaped."""
        try:
            return self._retrying()(fn, *args, **kwargs)
        except Exception as exc:
            translated = self._translate_error(exc, key)
            if translated is None or translated is exc:
                raise
            raise translated from exc


def uninitialized_buffer(nbytes: int) -> memoryview:
    """A writable byte buffer of ``nbytes`` that is not zero-filled first (it is about
    to be overwritten; ``bytearray(n)`` would write every byte twice)."""
    return numpy.empty(nbytes, dtype=numpy.uint8).data.cast("B")


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
