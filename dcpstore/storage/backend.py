"""The framework's internal base of every backend: the object-store view the DCP adapter uses.

:class:`Backend` is not what a storage plugin implements: plugins implement the public
contract of :mod:`dcpstore.storage.contract` (import it from :mod:`dcpstore.plugin`; see
``docs/writing-a-backend.md``), and the framework wraps each in a ``Backend``
(:class:`~dcpstore.storage.store_backend.StoreBackend`). This module is that framework
base: what the generic :class:`~dcpstore.Writer` and :class:`~dcpstore.Reader`, the
Checkpointer and the tools see of any store.

A backend is rooted at one *location* (a local directory, ``bucket/prefix``) and
speaks in keys relative to it. The DCP adapter only ever calls the public methods below,
in this order:

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

Inside the framework, each public method validates its keys and runs one private
primitive (``_open_upload``, ``_read_into``, ``_put``, ``_get``, ``_stat``, ``_list``,
``_list_dirs``, ``_delete``, ``_list_uploads``, ``_abort_upload``) through
:meth:`Backend._call`: retries, then the one error classification
(:mod:`dcpstore.storage.retry`, with the subclass's ``_classify``). The framework's
subclasses fill the primitives in: :class:`~dcpstore.storage.store_backend.StoreBackend`
from a plugin's :class:`~dcpstore.storage.contract.ObjectStore`, and the test doubles of
:mod:`dcpstore.testing`. ``read_ranges``' concurrent scatter reads are
:mod:`dcpstore.storage.reads`; the lazy per-process state (client, worker pool,
concurrency limits), pickling and ``close`` are :mod:`dcpstore.storage.lifecycle`; the
value types (:class:`ObjectInfo`, :class:`ReadRange`, :class:`Failure`,
:class:`BackendOptions`, :class:`Upload`) are :mod:`dcpstore.storage.types`, re-exported
here.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from dcpstore.errors import ConfigurationError, InvalidURIError
from dcpstore.storage.concurrency import ConcurrencyLimit
from dcpstore.storage.lifecycle import BackendLifecycle
from dcpstore.storage.reads import scatter_reads
from dcpstore.storage.retry import call_with_retries, classify_failure
from dcpstore.storage.types import (
    BackendOptions,
    Failure,
    ObjectInfo,
    ReadRange,
    Upload,
    uninitialized_buffer,
)
from dcpstore.storage.uri import ParsedURI, validate_key

# the types re-exported: this was their module before the split
__all__ = ["Backend", "BackendOptions", "Failure", "ObjectInfo", "ReadRange", "Upload",
           "uninitialized_buffer"]

T = TypeVar("T")


class Backend(BackendLifecycle):
    """The framework's base of every backend (see the module docstring); plugins
    implement :mod:`dcpstore.plugin`'s contract instead.

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
        super().__init__()

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

    # -- primitives (the framework's subclasses fill them in) ------------------------

    @abc.abstractmethod
    def _open_upload(self, key: str) -> Upload:
        """A streaming upload of ``key`` (see :class:`Upload`)."""

    @abc.abstractmethod
    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fill ``outs`` in order with consecutive bytes of ``key`` from ``offset``, in
        one request (a scatter read: e.g. item head, payload straight into a tensor,
        tail). Their total length is > 0. A short object is an ``EOFError``."""

    def _read_into_checksummed(self, key: str, offset: int, outs: Sequence[memoryview],
                               checksums: dict[int, int | None]) -> None:
        """:meth:`_read_into`, also filling ``checksums[j]`` with the CRC32C of
        ``outs[j]`` where the backend can compute it while the bytes are still in the
        CPU's cache (each piece right after it lands). What it leaves ``None`` is
        computed after the request (:func:`~dcpstore.storage.reads.scatter_reads`).
        This default leaves them all."""
        self._read_into(key, offset, outs)

    @abc.abstractmethod
    def _put(self, key: str, data: bytes, *, atomic: bool) -> None:
        """Store a small object in one request (``atomic``: old or new, never partial).
        A backend with :attr:`conditional_writes` also takes ``if_absent`` and
        ``if_match`` keywords (see :meth:`put`); they are passed only when set."""

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

    @property
    def conditional_writes(self) -> bool:
        """Whether :meth:`put` takes a precondition (``if_absent`` / ``if_match``) that
        the store itself enforces, atomically with the write."""
        return False

    def put(self, key: str, data: bytes, *, atomic: bool = False, if_absent: bool = False,
            if_match: str | None = None) -> None:
        """Store a small object in one request. ``atomic=True`` promises readers see the
        old object or the new one, never a partial one (local: temp file + rename).

        Args:
            key: The object.
            data: Its bytes.
            atomic: Old or new, never partial.
            if_absent: Store it only if there is no object ``key`` (S3 ``If-None-Match:
                *``, GCS ``ifGenerationMatch=0``, a hard link on POSIX).
            if_match: Store it only if ``key`` is still the version
                :meth:`stat` returned (:attr:`ObjectInfo.version`).

        Raises:
            PreconditionFailedError: A condition did not hold. A retried request can
                fail so after its first attempt did store the object (the answer was
                lost): a caller that must know reads the object back.
            ConfigurationError: A condition on a backend without
                :attr:`conditional_writes`.
        """
        validate_key(key)
        conditions: dict[str, Any] = {}
        if if_absent:
            conditions["if_absent"] = True
        if if_match is not None:
            conditions["if_match"] = if_match
        if conditions and not self.conditional_writes:
            raise ConfigurationError(
                f"{self.uri} cannot write conditionally ({', '.join(conditions)}): the "
                f"{self.name} backend has no conditional writes; check "
                "Backend.conditional_writes first")
        self._call(self._put, key, data, atomic=atomic, key=key, **conditions)

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
        checksums: Sequence[dict[int, int | None]] | None = None,
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
            checksums: Optional, one dict per range (with ``buffers``): the keys are
                indices into that range's list of views, whose CRC32C the read puts
                there by the time the range is yielded (computed while the bytes are in
                the CPU's cache where the backend can: a second pass over them from
                memory is about half the cost of a warm local read).
        """
        for r in ranges:
            validate_key(r.key)
        if buffers is not None and len(buffers) != len(ranges):
            raise ValueError("read_ranges: one buffer per range is required")
        if checksums is not None and (buffers is None or len(checksums) != len(ranges)):
            raise ValueError("read_ranges: checksums need buffers, one dict per range")
        if not ranges:
            return iter(())
        return scatter_reads(self, ranges, buffers, checksums)

    # -- machinery -------------------------------------------------------------------

    def _failure(self, exc: Exception, key: str | None) -> Failure:
        """Classify ``exc`` once (see :func:`~dcpstore.storage.retry.classify_failure`)."""
        return classify_failure(exc, key, self._classify)

    def _call(self, fn: Callable[..., T], *args: Any, key: str | None = None,
              concurrency: ConcurrencyLimit | None = None, **kwargs: Any) -> T:
        """Run one request with retries, then raise what its classification says (see
        :func:`~dcpstore.storage.retry.call_with_retries`).

        ``concurrency``: the limit whose slot the request holds; every attempt the store
        throttled (a :class:`~dcpstore.errors.StoreThrottledError` by the backend's one
        classification) is reported to it.
        """
        return call_with_retries(fn, args, kwargs, options=self.options, uri=self.uri,
                                 failure=lambda exc: self._failure(exc, key),
                                 concurrency=concurrency)
