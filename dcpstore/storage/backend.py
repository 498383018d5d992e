"""The backend contract: a narrow object-store interface every backend implements.

A backend is rooted at one *location* (a local directory, ``bucket/prefix``) and
speaks in keys relative to it. The generic :class:`~dcpstore.Writer` and
:class:`~dcpstore.Reader` only ever call the public methods below, in this order:

Save (every rank)::

    backend.preferred_object_size()                     # the automatic layout's files
    backend.upload_memory(size)                         # each file's buffer, budgeted
    up = backend.open_upload("__0_0.<save>.distcp", size_hint=size)  # one per data file
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

Housekeeping (CLI, Checkpointer, coordinator): ``list(prefix)``, ``list_dirs(prefix)``
(one level, a delimiter listing), ``stat``, ``delete``,
``list_uploads`` / ``abort_uploads``, ``remove_empty_dirs``; ``close`` at the end.

Implementers override the primitives; each public method validates its keys, runs its
primitive through :meth:`Backend._call` (retries, then one translation) and nothing else:

=============================================  ==========================================
primitive                                      public method(s)
=============================================  ==========================================
``_open_upload(key) -> Upload``                ``open_upload``
``_read_into(key, offset, outs)``              ``read_ranges`` (one call per range)
``_put(key, data, *, atomic)``                 ``put``
``_get(key) -> bytes``                         ``get``
``_stat(key) -> ObjectInfo``                   ``stat``, ``exists``
``_list(prefix) -> Iterator[ObjectInfo]``      ``list``
``_list_dirs(prefix, start_after)``          ``list_dirs`` (default: from ``_list``)
``_delete(keys)``                              ``delete``
``_list_uploads(prefix)`` (multipart stores)   ``list_uploads``
``_abort_upload(key, upload_id)`` (idem)       ``abort_uploads`` (one call per upload)
``_classify(exc, key) -> Failure | None``      every one: retry or not, what to raise
``_make_client() -> Any``                      the lazy :attr:`Backend.client`
=============================================  ==========================================

Errors: every exception a primitive raises is classified *once*
(:meth:`Backend._failure`): a :class:`~dcpstore.DcpstoreError` passes unchanged and
is never retried; an ``EOFError`` (a short object) becomes an ``OSError`` (``EIO``);
anything else goes to the backend's :meth:`Backend._classify`, and where that returns
``None``, ``ConnectionError`` / ``TimeoutError`` are retryable and everything else is
raised unchanged. The same :class:`Failure` decides whether tenacity retries (exponential
backoff, full jitter, ``max_attempts``) and, once it stops, what the caller sees.

State: the client (made by ``_make_client`` on first use of :attr:`Backend.client`),
the worker pool and other lazily created per-backend state (the multipart module's
part buffers and upload slots) are dropped when a backend is pickled and by
:meth:`Backend.close`, and made again on use; every ``threading.Lock`` / ``RLock``
attribute is recreated after unpickling. So backends are picklable
(``dcp.async_save`` in process mode) without ``__getstate__`` of their own.
"""

from __future__ import annotations

import abc
import builtins
import errno
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
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

from dcpstore.errors import DcpstoreError, InvalidURIError, StoreThrottledError
from dcpstore.storage.clients import shared_clients
from dcpstore.storage.concurrency import ConcurrencyLimit, learnt_limits
from dcpstore.storage.uri import ParsedURI, validate_key

__all__ = [
    "Backend",
    "BackendOptions",
    "Failure",
    "ObjectInfo",
    "ReadRange",
    "Upload",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LOCK_TYPES: dict[type, Callable[[], Any]] = {
    type(threading.Lock()): threading.Lock,
    type(threading.RLock()): threading.RLock,
}
#: Key of the client in ``Backend._resources``.
_CLIENT = "client"
#: Key of the shared client's cache key in ``Backend._resources``.
_CLIENT_KEY = "client-key"


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


@dataclass(frozen=True)
class Failure:
    """How one exception raised by a primitive is handled (see :meth:`Backend._classify`).

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
        :meth:`Backend.upload_memory`). A hint only: more or fewer bytes may follow.
        The default ignores it."""
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


class Backend(abc.ABC):
    """Base class of storage backends. See the module docstring for the contract.

    Args:
        location: Where the backend is rooted (absolute path or ``bucket/prefix``).
        options: The backend's options dataclass instance.
    """

    #: Options dataclass of this backend; ``get_writer(**options)`` fills it.
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    #: Name used in error messages, ``DCPSTORE_<BACKEND>_<OPTION>`` variables and the registry.
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
        self._state_lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        #: State made on first use (the client, the multipart module's part buffers
        #: and upload slots): dropped when pickled and by :meth:`close`.
        self._resources: dict[str, Any] = {}

    # -- description -----------------------------------------------------------------

    @property
    def uri(self) -> str:
        """URI of the root, without credentials or options."""
        return f"{self.name}://{self.location}"

    def child(self, key: str) -> Backend:
        """A backend of the same kind and options rooted at ``key`` under this root."""
        return self.at(self.location.rstrip("/") + "/" + validate_key(key))

    def at(self, location: str) -> Backend:
        """A backend of the same kind and options rooted at ``location`` (a wrapper
        backend overrides this to wrap the new one too)."""
        return type(self)(location, self.options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # -- lifecycle: lazy state, pickling, close ----------------------------------------

    @property
    def client(self) -> Any:
        """The store's client, made by :meth:`_make_client` on first use (thread-safe),
        shared by the backend's threads; dropped when pickled and by :meth:`close`.
        Backends with equal :meth:`_client_key` share one client per process
        (:mod:`dcpstore.storage.clients`)."""
        return self._lazy(_CLIENT, self._acquire_client)

    def _client_key(self) -> Any:
        """What makes this backend's client interchangeable with another's: backends
        whose keys are equal share one client per process. ``None`` (the default): a
        client of its own. A key holds everything the client is made from (endpoint,
        client settings, the credential environment, hashed), never a secret."""
        return None

    def _acquire_client(self) -> Any:
        key = self._client_key()
        if key is None:
            return self._make_client()
        key = (type(self), key)
        client = shared_clients.acquire(key, self._make_client, self._close_client)
        self._resources[_CLIENT_KEY] = key  # called under _state_lock, by _lazy
        return client

    def _lazy(self, name: str, factory: Callable[[], T]) -> T:
        """The per-backend state ``name``, made by ``factory`` on first use (double-checked
        locking); dropped when the backend is pickled and by :meth:`close`."""
        value = self._resources.get(name)
        if value is None:
            with self._state_lock:
                value = self._resources.get(name)
                if value is None:
                    value = self._resources[name] = factory()
        return value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_resources"] = {}
        locks = {name: kind for name, value in state.items()
                 if (kind := type(value)) in _LOCK_TYPES}
        for name in locks:
            del state[name]
        state["__dcpstore_locks__"] = {name: _LOCK_TYPES[kind] is threading.RLock
                                       for name, kind in locks.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        locks: dict[str, bool] = state.pop("__dcpstore_locks__", {})
        self.__dict__.update(state)
        for name, reentrant in locks.items():
            setattr(self, name, threading.RLock() if reentrant else threading.Lock())

    def close(self) -> None:
        """Release threads, the client and idle upload buffers; the backend stays usable
        (they are made again on use). A shared client goes back to the process's cache
        (:mod:`dcpstore.storage.clients`), and where the adaptive concurrency limits settled is
        kept for the next backend on the same store."""
        with self._state_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._state_lock:
            resources, self._resources = self._resources, {}
        key = resources.get(_CLIENT_KEY)
        if key is not None:  # the next backend on this store starts where these settled
            for direction in ("upload", "read"):
                limit = resources.get(f"concurrency-{direction}")
                if limit is not None:
                    learnt_limits.remember(key, direction, limit)
        client = resources.get(_CLIENT)  # buffers still in use go back to dropped pools
        if client is not None and (key is None or not shared_clients.release(key, client)):
            try:
                self._close_client(client)
            except Exception as exc:  # closing must never fail a caller
                logger.debug("%s: closing the client failed: %s", self.uri, exc)

    # -- primitives (override) -----------------------------------------------------

    @abc.abstractmethod
    def _open_upload(self, key: str) -> Upload:
        """A streaming upload of ``key`` (see :class:`Upload`)."""

    @abc.abstractmethod
    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fill ``outs`` in order with consecutive bytes of ``key`` from ``offset``, in
        one request (a scatter read: e.g. item head, payload straight into a tensor,
        tail). Their total length is > 0. A short object is an ``EOFError``."""

    @abc.abstractmethod
    def _put(self, key: str, data: bytes, *, atomic: bool) -> None:
        """Store a small object in one request (``atomic``: old or new, never partial)."""

    @abc.abstractmethod
    def _get(self, key: str) -> bytes:
        """A whole (small) object."""

    @abc.abstractmethod
    def _stat(self, key: str) -> ObjectInfo:
        """Size and mtime of ``key``; ``FileNotFoundError`` (or an error classified as
        one) when absent."""

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursively), any order."""

    @abc.abstractmethod
    def _delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys``; missing keys are not an error."""

    def _classify(self, exc: Exception, key: str | None) -> Failure | None:
        """Classify an exception of the store's client, once: what to raise and whether
        to retry (see :class:`Failure`). ``key`` is the key the request was about.

        Return ``None`` for the default: ``ConnectionError`` and ``TimeoutError`` are
        retried, anything else is raised unchanged. ``DcpstoreError`` and ``EOFError``
        never reach this method.
        """
        return None

    def _make_client(self) -> Any:
        """Create the store's client (called once, under a lock, by :attr:`client`)."""
        raise NotImplementedError(f"{type(self).__name__} uses no client")

    def _close_client(self, client: Any) -> None:
        """Release a client :meth:`close` dropped (default: nothing; it is garbage)."""
        return None

    def _list_dirs(self, prefix: str, start_after: str) -> Iterable[str]:
        """Names of the directories directly under ``prefix`` (``""`` or ending in
        ``/``): the first path segment after ``prefix`` of every key that has one more
        ``/``, each once, any order; only names greater than ``start_after`` are needed
        (more are filtered out by the caller).

        The default derives them from a full :meth:`_list`; a store with delimiter
        listings (S3 ``Delimiter="/"``, GCS ``delimiter``) overrides it with one so the
        cost is one request per 1,000 directories, not per 1,000 objects below them.
        """
        seen: set[str] = set()
        for obj in self._list(prefix):
            head, sep, _ = obj.key[len(prefix):].partition("/")
            if sep and head and head > start_after:
                seen.add(head)
        return seen

    def _list_uploads(self, prefix: str) -> Iterable[tuple[str, str]]:
        """Unfinished multipart uploads whose key starts with ``prefix``, as
        ``(key, upload_id)`` (stores without multipart uploads: none)."""
        return ()

    def _abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one unfinished multipart upload; one already gone is not an error."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def preferred_object_size(self) -> int | None:
        """The data-file size the writer's automatic layout (``files_per_rank=None``)
        aims for: the largest object this backend stores with a single request (and
        whose streaming upload stays within its memory bound), less headroom for the
        archive headers of the items. ``None`` (the default; local disk): one data file
        per rank, as torch's ``FileSystemWriter`` writes.

        Object stores want it: one request per object on save and one whole-object
        read per file on a same-world-size load, where a multipart upload costs its
        parts plus an assembly that some stores (moto) do slowly, and a ranged read of
        a large object costs some stores (moto) a copy of the whole object."""
        return None

    def remove_empty_dirs(self) -> None:
        """Remove the root and its sub-directories if they hold no objects: a hook for
        stores with real directories (local files); object stores have none."""
        return None

    # -- public API ------------------------------------------------------------------

    def open_upload(self, key: str, *, size_hint: int | None = None) -> Upload:
        """Start a streaming upload of ``key`` (see :class:`Upload`).

        Args:
            key: The object's key.
            size_hint: About how many bytes the object will hold, where the caller
                knows (passed to :meth:`Upload.expect_size`).
        """
        upload = self._call(self._open_upload, validate_key(key), key=key)
        if size_hint is not None:
            upload.expect_size(size_hint)
        return upload

    def upload_memory(self, size_hint: int | None = None) -> int:
        """Bytes an upload of an object of about ``size_hint`` bytes holds while it is
        written, besides the parts in flight that ``max_concurrency`` bounds: the
        buffer an object store's upload fills before its first request (an object that
        fits is sent from it in one request). A writer running several uploads at once
        budgets them with it. Default ``0``: the upload keeps nothing (local files are
        written through)."""
        return 0

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

    def list_uploads(self, prefix: str = "") -> list[tuple[str, str]]:
        """Unfinished multipart uploads under ``prefix`` as ``(key, upload_id)``, sorted
        (what a crashed save left behind; ``dcpstore gc`` aborts them)."""
        if prefix:
            validate_key(prefix.rstrip("/") or "x")
        found = self._call(lambda: list(self._list_uploads(prefix)), key=prefix or None)
        return sorted(set(found))

    def abort_uploads(self, uploads: Iterable[tuple[str, str]]) -> None:
        """Abort unfinished multipart uploads returned by :meth:`list_uploads`."""
        for key, upload_id in uploads:
            self._call(self._abort_upload, validate_key(key), upload_id, key=key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects under the root whose key starts with ``prefix``, sorted by key."""
        if prefix:
            validate_key(prefix.rstrip("/") or "x")
        return sorted(self._call(lambda: list(self._list(prefix)), key=prefix or None),
                      key=lambda o: o.key)

    def list_dirs(self, prefix: str = "", *, start_after: str = "") -> builtins.list[str]:
        """The directories directly under ``prefix``, sorted: for every key
        ``prefix + name + "/" + rest``, ``name`` once. Only names greater than
        ``start_after`` are returned. A directory whose objects were all deleted may
        still be listed where the store keeps directories (local disk, SeaweedFS's
        filer): callers check what they need inside (``.metadata``).

        Args:
            prefix: ``""`` (the root) or a key prefix ending in ``/``.
            start_after: Return only names that sort after this one (a store may skip
                listing the others, as S3's ``StartAfter`` does).
        """
        if prefix:
            if not prefix.endswith("/"):
                raise ValueError(f"list_dirs prefix must be '' or end with '/', got {prefix!r}")
            validate_key(prefix.rstrip("/"))
        found = self._call(lambda: list(self._list_dirs(prefix, start_after)),
                           key=prefix or None)
        return sorted({d for d in found if d > start_after and "/" not in d})

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

        At most ``max_concurrency`` ranges are in flight (fewer while the backend's
        adaptive read limit is lower, see :mod:`dcpstore.storage.concurrency`), and at most twice
        that many
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
        gate = self._concurrency("read")

        def fetch(i: int) -> tuple[int, Any]:
            r = ranges[i]
            out = buffers[i] if buffers is not None else uninitialized_buffer(r.length)
            if isinstance(out, memoryview):
                if len(out) != r.length:
                    raise ValueError(f"read_ranges: buffer {i} holds {len(out)} bytes, "
                                     f"range is {r.length}")
                outs: Sequence[memoryview] = (out,)
            else:
                if sum(len(o) for o in out) != r.length:
                    raise ValueError(f"read_ranges: buffers {i} do not add up to {r.length}")
                outs = out
            if r.length:
                started = gate.acquire()
                assert started is not None  # a blocking acquire without timeout
                ok = False
                try:
                    self._call(self._read_into, r.key, r.offset, outs, key=r.key,
                               concurrency=gate)
                    ok = True
                finally:
                    gate.release(started, r.length if ok else 0, ok=ok)
            return i, out

        if len(ranges) == 1 or self.options.max_concurrency == 1:
            for i in range(len(ranges)):
                yield fetch(i)
            return
        pool = self._executor()
        pending: set[Future[tuple[int, Any]]] = set()
        next_index = 0
        try:
            while next_index < len(ranges) or pending:
                while next_index < len(ranges) and len(pending) < gate.limit:
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

    def _concurrency(self, direction: str) -> ConcurrencyLimit:
        """The limit on requests in flight of ``direction`` (``"upload"``: multipart
        parts, ``"read"``: ranged reads), shared by the backend's uploads or reads, made
        on first use (dropped when pickled and by :meth:`close`)."""
        o = self.options

        def make() -> ConcurrencyLimit:
            key = self._client_key() if o.adaptive_concurrency else None
            start = None if key is None else learnt_limits.recall((type(self), key),
                                                                   direction)
            if start is None and direction == "read":
                # no slow start for reads: the ceiling bounds their buffers either way
                start = o.max_concurrency
            return ConcurrencyLimit(o.max_concurrency, adaptive=o.adaptive_concurrency,
                                    initial=start, name=f"{self.uri} {direction}")

        return self._lazy(f"concurrency-{direction}", make)

    def concurrency_figures(self) -> dict[str, dict[str, Any]]:
        """What the concurrency limits did since they were made (see
        :meth:`~dcpstore.storage.concurrency.ConcurrencyLimit.figures`), by direction
        (``"upload"``, ``"read"``); a direction not used yet is absent."""
        out: dict[str, dict[str, Any]] = {}
        for direction in ("upload", "read"):
            limit = self._resources.get(f"concurrency-{direction}")
            if limit is not None:
                out[direction] = limit.figures()
        return out

    def _executor(self) -> ThreadPoolExecutor:
        """Shared worker pool of this backend (created on first use)."""
        with self._state_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.options.max_concurrency,
                    thread_name_prefix=f"dcpstore-{self.name}",
                )
            return self._pool

    def _failure(self, exc: Exception, key: str | None) -> Failure:
        """Classify ``exc`` once (see the module docstring)."""
        if isinstance(exc, DcpstoreError):
            return Failure(exc)
        if isinstance(exc, EOFError):
            message = str(exc) or "the object ends before the requested range"
            if key is not None and key not in message:
                message = f"{key}: {message}"
            return Failure(OSError(errno.EIO, message))
        failure = self._classify(exc, key)
        if failure is not None:
            return failure
        return Failure(exc, retryable=isinstance(exc, (ConnectionError, TimeoutError)))

    def _call(self, fn: Callable[..., T], *args: Any, key: str | None = None,
              concurrency: ConcurrencyLimit | None = None, **kwargs: Any) -> T:
        """Run one request with retries, then raise what its classification says.

        ``concurrency``: the limit whose slot the request holds; every attempt the store
        throttled (a :class:`~dcpstore.errors.StoreThrottledError` by the backend's one
        classification) is reported to it.
        """
        o = self.options
        last: dict[str, tuple[BaseException, Failure]] = {}  # the retry predicate's

        def failure_of(exc: BaseException) -> Failure:
            seen = last.get("exc")
            if seen is not None and seen[0] is exc:
                return seen[1]
            failure = self._failure(exc, key) if isinstance(exc, Exception) else Failure(exc)
            last["exc"] = (exc, failure)
            if concurrency is not None and isinstance(failure.error, StoreThrottledError):
                concurrency.throttled()
            return failure

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.warning(
                "%s: attempt %d/%d failed (%s); retrying", self.uri, state.attempt_number,
                o.max_attempts, _describe(exc),
            )

        retrying = Retrying(
            stop=stop_after_attempt(o.max_attempts),
            wait=wait_random_exponential(multiplier=o.retry_backoff, max=o.retry_backoff_max),
            retry=retry_if_exception(lambda exc: failure_of(exc).retryable),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            return retrying(fn, *args, **kwargs)
        except Exception as exc:
            error = failure_of(exc).error
            if error is exc:
                raise
            raise error from exc


def uninitialized_buffer(nbytes: int) -> memoryview:
    """A writable byte buffer of ``nbytes`` that is not zero-filled first (it is about
    to be overwritten; ``bytearray(n)`` would write every byte twice)."""
    return numpy.empty(nbytes, dtype=numpy.uint8).data.cast("B")


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
