"""The framework every storage plugin gets: an :class:`ObjectStore` made a :class:`Backend`.

A plugin implements the small public contract of :mod:`dcpstore.storage.contract`; this
module wraps it in the framework's :class:`~dcpstore.storage.backend.Backend`, which the
DCP adapter, the Checkpointer and the tools use. The wrapper owns, for every plugin alike:

- key validation, retries (backoff with jitter, ``max_attempts``) and the one error
  translation (the store's :meth:`~ObjectStore.map_error`; its kinds say what is retried);
- the worker pool, adaptive concurrency and the client shared per process;
- uploads: concurrent parts from pooled buffers (:class:`StoreUpload`) for a
  :class:`MultipartStore`, one ``put`` for an object that fits a buffer, and part sizes
  that grow so that :attr:`StoreLimits.max_parts` parts still hold a large object;
- the automatic layout's object size and the uploads' memory budget, from the store's
  :class:`StoreLimits` and the options;
- pickling for process-mode saves.

:func:`backend_class` makes (once per store class) the ``Backend`` subclass that the
registry hands out for a store class.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

from typing_extensions import Buffer

from dcpstore.errors import ObjectTooLargeError
from dcpstore.storage.backend import Backend, BackendOptions, Failure, ObjectInfo, Upload
from dcpstore.storage.contract import MultipartStore, ObjectStore
from dcpstore.storage.multipart import MultipartUpload, first_buffer_bytes
from dcpstore.storage.uri import ParsedURI

__all__ = ["StoreBackend", "StoreUpload", "WholeUpload", "backend_class"]


class StoreBackend(Backend):
    """The framework's :class:`Backend` over one plugin :class:`ObjectStore`.

    Args:
        location: The root (``bucket/prefix``, a directory).
        options: The store's options.
    """

    #: The plugin class this backend class wraps (set by :func:`backend_class`).
    Store: type[ObjectStore]

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        super().__init__(location, options)
        self.store = self.Store(location, self.options)

    @classmethod
    def from_uri(cls, uri: ParsedURI, options: BackendOptions) -> Backend:
        return cls(cls.Store.location_for(uri), options)

    def __reduce__(self) -> Any:
        # the class is made at run time: rebuild it from the (importable) store class
        return (_rebuild, (self.Store, self.__getstate__()))

    @property
    def uri(self) -> str:
        return self.store.uri

    @property
    def client(self) -> Any:
        return self.store.client

    def _client_key(self) -> Hashable | None:
        return self.store.client_key()

    def close(self) -> None:
        super().close()
        self.store.release()

    # -- sizes -------------------------------------------------------------------------

    def first_part(self) -> int:
        """Part 1's size: the buffer an object of unknown size fills before its first
        request (an object that ends within it is one ``put``)."""
        o = self.options
        size = max(o.multipart_threshold, o.part_size)
        cap = self.Store.limits.max_part_size
        return min(size, cap) if cap else size

    def whole_object_limit(self) -> int:
        """The largest announced object sent with one ``put``: ``part_size x
        max_concurrency`` (the bytes the parts in flight may hold), within the store's
        ``max_put_size``."""
        o = self.options
        limit = o.part_size * o.max_concurrency
        cap = self.Store.limits.max_put_size
        return min(limit, cap) if cap else limit

    def upload_memory(self, size_hint: int | None = None) -> int:
        if not isinstance(self.store, MultipartStore):
            return self.preferred_object_size() or 0
        return first_buffer_bytes(self.first_part(), self.whole_object_limit(), size_hint)

    def preferred_object_size(self) -> int | None:
        """15/16 of part 1 (room for the items' archive headers): each file the
        automatic layout makes is one ``put``. A store without multipart uploads: 15/16
        of ``max_put_size`` (``None`` without one: one file per rank)."""
        if isinstance(self.store, MultipartStore):
            size: int | None = self.first_part()
        else:
            size = self.Store.limits.max_put_size
        return None if size is None else size - size // 16

    # -- the framework's primitives, on the store's public methods ----------------------

    def _open_upload(self, key: str) -> Upload:
        stream = self.store.open_stream(key)
        if stream is not None:
            return stream
        if isinstance(self.store, MultipartStore):
            return StoreUpload(self, key)
        return WholeUpload(self, key)

    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        self.store.read(key, offset, outs)

    def _read_into_checksummed(self, key: str, offset: int, outs: Sequence[memoryview],
                               checksums: dict[int, int | None]) -> None:
        self.store.read_checksummed(key, offset, outs, checksums)

    @property
    def conditional_writes(self) -> bool:
        return self.store.conditional_writes

    def _put(self, key: str, data: bytes, *, atomic: bool, **conditions: Any) -> None:
        # every put is atomic; conditions are passed only when set, so a store without
        # conditional writes keeps the two-argument put
        self.store.put(key, memoryview(data).cast("B"), **conditions)

    def _get(self, key: str) -> bytes:
        data = self.store.read(key)
        if data is None:
            raise TypeError(f"{type(self.store).__name__}.read({key!r}) without buffers "
                            "returned None; it must return the object's bytes")
        return data

    def _stat(self, key: str) -> ObjectInfo:
        return self.store.head(key)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        for entry in self.store.list(prefix):
            if isinstance(entry, ObjectInfo):
                yield entry

    def _list_dirs(self, prefix: str, start_after: str) -> Iterable[str]:
        return [entry for entry in self.store.list(prefix, start_after=start_after,
                                                   delimiter="/")
                if isinstance(entry, str)]

    def _delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 1000):
            self.store.delete(keys[start:start + 1000])

    def _list_uploads(self, prefix: str) -> Iterable[tuple[str, str]]:
        if isinstance(self.store, MultipartStore):
            return self.store.list_uploads(prefix)
        return ()

    def _abort_upload(self, key: str, upload_id: str) -> None:
        if isinstance(self.store, MultipartStore):
            self.store.abort_upload(key, upload_id)

    def _classify(self, exc: Exception, key: str | None) -> Failure | None:
        error = self.store.map_error(exc, key)
        if error is None:
            return None
        return Failure(error, retryable=bool(getattr(error, "retryable", False)))


class StoreUpload(MultipartUpload):
    """A streaming upload through a :class:`MultipartStore`'s methods.

    Parts start at :meth:`StoreBackend.first_part` and grow (2x after a tenth of the
    store's ``max_parts``, 4x after a fifth), so a small first part keeps small objects'
    uploads pipelined while ``max_parts`` parts still hold large objects.
    """

    backend: StoreBackend

    def __init__(self, backend: StoreBackend, key: str) -> None:
        super().__init__(backend, key)
        self.store: MultipartStore = backend.store  # type: ignore[assignment]
        max_parts = backend.Store.limits.max_parts
        self._growth = ((max_parts // 10, 2), (max_parts // 5, 4)) if max_parts else ()

    def part_bytes(self, number: int) -> int:
        if number == 1:
            size = self.backend.first_part()
        else:
            factor = max((f for after, f in self._growth if number > after), default=1)
            size = self.part_size * factor
        cap = self.backend.Store.limits.max_part_size
        return min(size, cap) if cap else size

    def largest_object(self) -> int | None:
        """The largest object this upload can store (``None``: no part limit)."""
        max_parts = self.backend.Store.limits.max_parts
        if not max_parts:
            return None
        return sum(self.part_bytes(n) for n in range(1, max_parts + 1))

    def _create(self) -> str:
        return self.store.start_upload(self.key)

    def _upload_part(self, upload_id: str, number: int, data: memoryview) -> Any:
        max_parts = self.backend.Store.limits.max_parts
        if max_parts and number > max_parts:
            raise ObjectTooLargeError(
                f"{self.backend.uri}/{self.key}: more than {max_parts} parts, the most "
                f"one upload to {self.backend.name} may have; with part_size="
                f"{self.part_size} the largest object is {self.largest_object()} bytes: "
                "raise part_size or files_per_rank")
        return self.store.upload_part(self.key, upload_id, number, data)

    def _complete(self, upload_id: str, parts: list[tuple[int, Any]]) -> None:
        self.store.complete_upload(self.key, upload_id, parts)

    def _abort_multipart(self, upload_id: str) -> None:
        self.store.abort_upload(self.key, upload_id)

    def _put_whole(self, data: memoryview) -> None:
        self.store.put(self.key, data)


class WholeUpload(Upload):
    """An upload to a store without multipart uploads: the object is kept in memory and
    stored with one ``put`` at commit (at most the store's ``max_put_size``)."""

    def __init__(self, backend: StoreBackend, key: str) -> None:
        self.backend = backend
        self.key = key
        self._data: bytearray | None = bytearray()
        self._limit = backend.Store.limits.max_put_size

    def write(self, data: Buffer) -> int:
        if self._data is None:
            raise ValueError(f"upload of {self.key!r} is already closed")
        view = memoryview(data).cast("B")
        if self._limit is not None and len(self._data) + len(view) > self._limit:
            self._data = None
            raise ObjectTooLargeError(
                f"{self.backend.uri}/{self.key}: over {self._limit} bytes, the largest "
                f"object {self.backend.name} stores; save more, smaller files "
                "(files_per_rank) or keep the automatic layout")
        self._data += view
        return len(view)

    def commit(self) -> ObjectInfo:
        if self._data is None:
            raise ValueError(f"upload of {self.key!r} is already closed")
        data, self._data = self._data, None
        self.backend._call(self.backend.store.put, self.key, memoryview(data), key=self.key)
        return ObjectInfo(self.key, len(data))

    def abort(self) -> None:
        self._data = None


_classes: dict[type[ObjectStore], type[StoreBackend]] = {}
_classes_lock = threading.Lock()


def backend_class(store: type[ObjectStore]) -> type[StoreBackend]:
    """The framework's ``Backend`` class for plugin class ``store`` (made once)."""
    with _classes_lock:
        cls = _classes.get(store)
        if cls is None:
            cls = _classes[store] = type(f"{store.__name__}Backend", (StoreBackend,), {
                "Store": store, "name": store.name, "schemes": store.schemes,
                "Options": store.Options, "__module__": __name__,
                # pickle finds it by this path, in any process (see _Made)
                "__qualname__": f"made.{store.__module__.replace('.', '/')}:"
                                f"{store.__qualname__.replace('.', '/')}",
                "__doc__": f"The framework's backend over :class:`{store.__qualname__}`.",
            })
        return cls


class _Made:
    """Where pickle finds the backend classes made at run time: a writer or reader in a
    process-mode save or a spawned rank carries its backend's class, which pickle names
    ``dcpstore.storage.store_backend.made.<store module>:<store class>``; another
    process makes it again from the store class."""

    def __getattr__(self, name: str) -> type[StoreBackend]:
        module, sep, qualname = name.partition(":")
        if not sep:
            raise AttributeError(name)
        found: Any = importlib.import_module(module.replace("/", "."))
        for part in qualname.split("/"):
            found = getattr(found, part)
        return backend_class(found)


made = _Made()


def _rebuild(store: type[ObjectStore], state: dict[str, Any]) -> StoreBackend:
    backend = backend_class(store).__new__(backend_class(store))
    backend.__setstate__(state)
    return backend
