"""The object-store contract: what a storage plugin implements.

A plugin is one class, a subclass of :class:`ObjectStore` (or of :class:`MultipartStore`
where the store has multipart uploads), registered under a URI scheme through the
``dcpstore.backends`` entry-point group. It implements **8 methods** at most, none of
them private:

=====================================  ==================================================
method                                 what it does (one request each)
=====================================  ==================================================
:meth:`ObjectStore.read`               a byte range scattered into buffers, or a whole
                                       object
:meth:`ObjectStore.put`                store an object whole (atomic: old or new),
                                       optionally only if absent or unchanged
:meth:`ObjectStore.head`               size, mtime and version of one object
:meth:`ObjectStore.list`               objects under a prefix, or one level of it
:meth:`ObjectStore.delete`             a batch of objects
:meth:`ObjectStore.map_error`          the SDK's exceptions to dcpstore's failure kinds
:meth:`MultipartStore.upload_part`     one part of a multipart upload
:meth:`MultipartStore.complete_upload` assemble the parts into the object
=====================================  ==================================================

A store whose multipart upload holds state on the server (S3) also overrides the three
hooks that have working defaults: :meth:`MultipartStore.start_upload`,
:meth:`MultipartStore.abort_upload` and :meth:`MultipartStore.list_uploads`. A store
without multipart uploads stores each object with one :meth:`~ObjectStore.put` (declare
the largest in :attr:`ObjectStore.limits`); one that can write a stream straight to its
final place (POSIX files) may offer :meth:`ObjectStore.open_stream` instead. A store
whose writes can be conditional (S3 ``If-None-Match`` / ``If-Match``, GCS
``ifGenerationMatch``, Azure's access conditions, a POSIX hard link) sets
:attr:`ObjectStore.conditional_writes` and takes ``if_absent`` / ``if_match`` in
:meth:`~ObjectStore.put`: commits then have one winner when two jobs write one step
(``docs/reliability.md``). A store whose read fills buffers piece by piece may
override :meth:`ObjectStore.read_checksummed` to checksum each piece while it is in the
CPU's cache (the local and S3 stores do).

Everything else is the framework's (:mod:`dcpstore.storage.store_backend`), the same for
every plugin: key validation, retries with backoff and jitter, deadlines, the worker pool,
adaptive concurrency, pooled part buffers and the uploads' byte window, client sharing,
pickling for process-mode saves, and sharing a failure with the other ranks. A plugin
never calls a private name of the framework.

Keys are ``/``-separated, relative to the store's :attr:`~ObjectStore.location` (its
root: ``bucket/prefix``, ``container/prefix`` or an absolute directory), already
validated (no ``..``, no leading ``/``, never empty). Methods are called from several
threads at once. They raise the SDK's own exceptions (or an ``EOFError`` for a short
object); :meth:`~ObjectStore.map_error` translates them once, and the framework retries
the kinds that say so.

The call order, for one checkpoint::

    save, every rank:   [start_upload] upload_part x N complete_upload   (or put)
                        abort_upload on failure
    save, coordinator:  head(".metadata")  put(manifest)
                        put(".metadata", if_absent=True)     (conditional_writes;
                        or if_match=<the version replaced>    else a plain put)
    load, every rank:   read(".metadata")  read(manifest)  read(key, offset, buffers) x N
    housekeeping:       list(prefix)  list(prefix, delimiter="/")  delete(keys)
                        list_uploads(prefix)  abort_upload(key, upload_id)
"""

from __future__ import annotations

import abc
import threading
import uuid
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dcpstore.errors import ConfigurationError, InvalidURIError, StoreError
from dcpstore.storage.backend import BackendOptions, ObjectInfo
from dcpstore.storage.clients import shared_clients
from dcpstore.storage.uri import ParsedURI

__all__ = [
    "MultipartStore",
    "ObjectInfo",
    "ObjectStore",
    "StoreLimits",
    "StoreOptions",
]

#: The options every store understands (subclass it for a store's own).
StoreOptions = BackendOptions


@dataclass(frozen=True)
class StoreLimits:
    """What a store accepts; the framework sizes files, parts and buffers by it.

    Attributes:
        max_put_size: Largest object one :meth:`ObjectStore.put` stores (``None``: no
            limit). Without multipart uploads, also the largest object at all: the
            writer's automatic layout keeps data files below it.
        max_parts: Most parts of one multipart upload (``None``: no limit).
        min_part_size: Smallest part but the last (S3: 5 MiB).
        max_part_size: Largest part (``None``: no limit).
    """

    max_put_size: int | None = None
    max_parts: int | None = None
    min_part_size: int = 1
    max_part_size: int | None = None


class ObjectStore(abc.ABC):
    """Base class of a storage plugin: an object store rooted at one location.

    The framework makes one per checkpoint location with ``Store(location, options)``
    (``location`` is the URI without scheme and query: ``bucket/prefix``, or an absolute
    path for ``scheme:///abs/path``), calls its methods from several threads, and
    pickles it for process-mode saves (the client is dropped and made again).

    Attributes:
        name: The store's name: in messages, the registry and
            ``DCPSTORE_<NAME>_<OPTION>`` variables.
        schemes: URI schemes it serves.
        Options: Its options dataclass (a subclass of :class:`StoreOptions`); the
            framework fills it from keywords, the URI query and the environment.
        limits: What the store accepts (:class:`StoreLimits`).
        conditional_writes: Whether :meth:`put` enforces ``if_absent`` / ``if_match``
            (atomically, on the store's side) and :meth:`head` returns a version.
        location: The root, as given.
        options: The options instance.
    """

    name: ClassVar[str] = "store"
    schemes: ClassVar[tuple[str, ...]] = ()
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    limits: ClassVar[StoreLimits] = StoreLimits()
    conditional_writes: ClassVar[bool] = False

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        self.location = location
        self.options = options if options is not None else self.Options()
        self._client: Any = None
        self._client_lock = threading.Lock()

    # -- the contract ----------------------------------------------------------------

    @abc.abstractmethod
    def read(self, key: str, offset: int = 0,
             buffers: Sequence[memoryview] | None = None) -> bytes | None:
        """Read bytes of ``key`` from ``offset``, in one request.

        Args:
            key: The object.
            offset: The first byte.
            buffers: Where the bytes go: consecutive ranges filled in order (a scatter
                read: an item's header, then its payload straight into a tensor). Their
                total length is > 0. ``None``: read to the end of the object.

        Returns:
            ``None`` when ``buffers`` were given (they are full); else the bytes.

        Raises:
            EOFError: The object ends before ``buffers`` are full (never return a
                short read).
        """

    @abc.abstractmethod
    def put(self, key: str, data: memoryview, *, if_absent: bool = False,
            if_match: str | None = None) -> None:
        """Store ``data`` as ``key`` in one request, replacing an object there.

        Atomic: readers see the old object or the new one, never a part. ``data`` is a
        view of a buffer the framework reuses: do not keep it after returning.
        Idempotent: a retried put stores the same object.

        A store with :attr:`conditional_writes` honours the two conditions (the
        framework passes them only to such a store, and only when set; a store without
        may declare ``put(self, key, data)``):

        Args:
            key: The object.
            data: Its bytes.
            if_absent: Store only if there is no object ``key``.
            if_match: Store only if ``key`` is still the version :meth:`head` returned
                (:attr:`ObjectInfo.version`).

        Raises:
            Exception: The SDK's error for a condition that did not hold, which
                :meth:`map_error` maps to :class:`~dcpstore.errors.PreconditionFailedError`.
        """

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size, mtime and (with :attr:`conditional_writes`) version of ``key``
        (``ObjectInfo.key`` is ``key``).

        Raises:
            Exception: The SDK's not-found error when there is no such object (which
                :meth:`map_error` maps to :class:`~dcpstore.errors.ObjectNotFoundError`).
        """

    @abc.abstractmethod
    def list(self, prefix: str, *, start_after: str = "",
             delimiter: str | None = None) -> Iterable[ObjectInfo | str]:
        """The objects whose key starts with ``prefix``, in any order.

        Args:
            prefix: ``""`` or a key prefix (not necessarily ending in ``/``).
            start_after: Only keys greater than this one are needed (the store may
                return more; the framework filters).
            delimiter: ``None``: every object below ``prefix``, recursively, as
                :class:`ObjectInfo`. ``"/"``: one level: the objects directly under
                ``prefix`` as :class:`ObjectInfo`, and for each deeper key its first
                level below ``prefix``, without the prefix or the trailing ``/``, as a
                ``str`` (each name once).
        """

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` (at most 1,000 per call); a missing key is not an error.
        Idempotent."""

    @abc.abstractmethod
    def map_error(self, exc: Exception,
                  key: str | None) -> StoreError | ConfigurationError | None:
        """Translate an exception one of the methods raised, once.

        Decide from the SDK's status and error codes, never from the message text.
        Return an instance of one of the :class:`~dcpstore.errors.StoreError` kinds
        (:class:`~dcpstore.errors.ObjectNotFoundError`,
        :class:`~dcpstore.errors.BucketNotFoundError`,
        :class:`~dcpstore.errors.AccessDeniedError`,
        :class:`~dcpstore.errors.StoreThrottledError`,
        :class:`~dcpstore.errors.StoreTimeoutError`,
        :class:`~dcpstore.errors.StoreUnavailableError`,
        :class:`~dcpstore.errors.ObjectTooLargeError`,
        :class:`~dcpstore.errors.PreconditionFailedError`) with a message that names
        the object and what to do, and the store's request id; or a
        :class:`~dcpstore.errors.ConfigurationError`; or ``None`` for an exception it
        does not know (the framework retries ``ConnectionError`` / ``TimeoutError`` and
        raises anything else unchanged). Never put a secret in a message.

        Args:
            exc: What the method raised (never a dcpstore error or an ``EOFError``).
            key: The key of the request, if it had one.
        """

    # -- optional hooks --------------------------------------------------------------

    @classmethod
    def location_for(cls, uri: ParsedURI) -> str:
        """The root for a parsed URI: ``uri.location`` (``bucket/prefix``; the absolute
        path of ``scheme:///abs/path``). A URI of a scheme the store does not serve is
        refused; a store that serves any URI the feature flag routes to it (MSC)
        overrides this, keeping what it needs of the scheme.

        Raises:
            InvalidURIError: The scheme is not one of :attr:`schemes`.
        """
        if cls.schemes and uri.scheme not in cls.schemes:
            raise InvalidURIError(
                f"backend {cls.name!r} cannot serve {uri.scheme}:// URIs (it serves "
                f"{', '.join(s + '://' for s in cls.schemes)}); unset DCPSTORE_BACKEND or "
                "pick another backend=")
        return uri.location

    def connect(self) -> Any:
        """Make the SDK client (default: none). The framework calls it once, on first
        use of :attr:`client`, and shares the client between the stores of a process
        whose :meth:`client_key` is equal."""
        return None

    def client_key(self) -> Hashable | None:
        """What makes two stores' clients interchangeable (endpoint, client settings,
        a hash of the credential environment; never a secret itself). ``None`` (the
        default): each store makes its own."""
        return None

    def read_checksummed(self, key: str, offset: int, buffers: Sequence[memoryview],
                         checksums: dict[int, int | None]) -> None:
        """:meth:`read` into ``buffers``, also putting in ``checksums[j]`` the CRC32C of
        ``buffers[j]`` (``crc32c.crc32c``) for each key ``j`` it holds, computed piece by
        piece as the bytes land, while they are in the CPU's cache. The default reads
        and leaves them ``None``: the framework then checksums those buffers after the
        request, a second pass over their bytes from memory. A store whose read fills
        buffers in pieces (a socket, ``preadv`` steps) overrides it to save that pass."""
        self.read(key, offset, buffers)

    def open_stream(self, key: str) -> Any:
        """A store that writes a stream straight to its final place (POSIX files)
        returns an :class:`~dcpstore.storage.backend.Upload` here; the default
        ``None`` lets the framework upload with :class:`MultipartStore`'s methods or
        one :meth:`put`."""
        return None

    @property
    def client(self) -> Any:
        """The SDK client (made by :meth:`connect` on first use, shared; see there)."""
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    key = self.client_key()
                    self._client = (self.connect() if key is None else shared_clients.acquire(
                        (type(self), key), self.connect, _close))
                client = self._client
        return client

    def release(self) -> None:
        """Give the client back (the framework's ``close``); it is made again on use."""
        with self._client_lock:
            client, self._client = self._client, None
        if client is None:
            return
        key = self.client_key()
        if key is None or not shared_clients.release((type(self), key), client):
            _close(client)

    @property
    def uri(self) -> str:
        """The root as a URI (in messages)."""
        return f"{self.schemes[0] if self.schemes else self.name}://{self.location}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        del state["_client_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client_lock = threading.Lock()


class MultipartStore(ObjectStore):
    """An :class:`ObjectStore` with multipart uploads: large objects go up in parts,
    several at once, and are assembled by :meth:`complete_upload`.

    Call order for one object: :meth:`start_upload` once, :meth:`upload_part` for parts
    1..N (concurrently, any order), then :meth:`complete_upload` with every part, or
    :meth:`abort_upload`. An object that fits one buffer is one :meth:`put` instead.
    """

    def start_upload(self, key: str) -> str:
        """Begin a multipart upload of ``key``; return its id.

        The default returns a fresh random id, for stores whose parts need no upload
        made first (Azure's staged blocks, with ids the client chooses)."""
        return uuid.uuid4().hex

    @abc.abstractmethod
    def upload_part(self, key: str, upload_id: str, number: int, data: memoryview) -> str:
        """Upload part ``number`` (1-based) of ``key``; return its tag (S3's ETag, a
        block id), which :meth:`complete_upload` gets back.

        ``data`` is a view of a pooled buffer: do not keep it after returning. Every
        part but the last is at least :attr:`StoreLimits.min_part_size`. Idempotent: a
        retried part replaces the earlier attempt.
        """

    @abc.abstractmethod
    def complete_upload(self, key: str, upload_id: str,
                        parts: Sequence[tuple[int, str]]) -> None:
        """Assemble ``parts`` (``(number, tag)``, sorted by number, every part
        :meth:`upload_part` returned) into the object ``key``, atomically.

        A retried call (the first one's answer was lost) must not fail because the
        first one succeeded: treat "no such upload" after an earlier attempt as done
        where the object is there with its parts.
        """

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Discard an unfinished upload's parts; one already gone is not an error.
        The default does nothing (stores whose uncommitted parts expire by
        themselves)."""
        return None

    def list_uploads(self, prefix: str) -> Iterable[tuple[str, str]]:
        """Unfinished uploads whose key starts with ``prefix``, as ``(key,
        upload_id)`` (what a crashed save left; ``dcpstore gc`` aborts them). The
        default: none."""
        return ()


def _close(client: Any) -> None:
    close = getattr(client, "close", None)
    if callable(close):
        close()
