"""An in-memory backend with request counters, for protocol tests without a server.

``memory://<bucket>/<prefix>`` addresses objects held in this process. Buckets must be
created first (like S3), so a missing bucket behaves as on a real store::

    from dcpstore import register_backend
    from dcpstore.testing import MemoryBackend

    register_backend("memory", MemoryBackend)
    MemoryBackend.create_bucket("ckpt")
    dcpstore.save(state, "memory://ckpt/run/step-1")
    MemoryBackend.requests("ckpt")     # Counter({'put': 2, 'create_upload': 1, ...})

Every instance for the same bucket sees the same objects (a writer, a reader and a
pickled copy in this process). Uploads become visible only when committed; unfinished
ones are listed by ``list_uploads`` like S3 multipart uploads.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from typing_extensions import Buffer

from dcpstore.errors import BucketNotFoundError, InvalidURIError, PreconditionFailedError
from dcpstore.storage.backend import Backend, BackendOptions, ObjectInfo, Upload

__all__ = ["MemoryBackend", "MemoryOptions"]


@dataclass
class MemoryOptions(BackendOptions):
    """Options of :class:`MemoryBackend` (the common ones; ``part_size`` only sets how
    many ``upload_part`` requests an upload counts)."""


@dataclass
class _Bucket:
    objects: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    uploads: dict[str, str] = field(default_factory=dict)  # upload id -> object name
    requests: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _MemoryUpload(Upload):
    def __init__(self, backend: MemoryBackend, key: str, upload_id: str) -> None:
        self.backend = backend
        self.key = key
        self.upload_id = upload_id
        self._data = bytearray()
        self._done = False

    def write(self, data: Buffer) -> int:
        if self._done:
            raise ValueError(f"upload of {self.key!r} is already finished")
        view = memoryview(data).cast("B")
        self._data += view
        return len(view)

    def commit(self) -> ObjectInfo:
        if self._done:
            raise ValueError(f"upload of {self.key!r} is already finished")
        bucket = self.backend._bucket()
        name = self.backend._name(self.key)
        parts = max(1, math.ceil(len(self._data) / self.backend.options.part_size))
        with bucket.lock:
            bucket.requests["upload_part"] += parts
            bucket.requests["complete_upload"] += 1
            if bucket.uploads.pop(self.upload_id, None) is None:
                raise FileNotFoundError(f"upload {self.upload_id} of {name!r} was aborted")
            bucket.objects[name] = (bytes(self._data), time.time())
        self._done = True
        return ObjectInfo(self.key, len(self._data))

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._data = bytearray()
        bucket = MemoryBackend._buckets.get(self.backend.bucket)
        if bucket is not None:
            with bucket.lock:
                bucket.requests["abort_upload"] += 1
                bucket.uploads.pop(self.upload_id, None)


class MemoryBackend(Backend):
    """Objects in a dict of this process, under ``memory://<bucket>/<prefix>``.

    Args:
        location: ``bucket`` or ``bucket/prefix``.
        options: :class:`MemoryOptions`.
    """

    Options: ClassVar[type[BackendOptions]] = MemoryOptions
    name: ClassVar[str] = "memory"
    schemes: ClassVar[tuple[str, ...]] = ("memory",)

    _buckets: ClassVar[dict[str, _Bucket]] = {}
    _ids: ClassVar[Iterator[int]] = itertools.count(1)

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        super().__init__(location, options)
        bucket, _, prefix = location.strip("/").partition("/")
        if not bucket:
            raise InvalidURIError(f"memory:// URI without a bucket: {location!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    # -- the store, for tests ------------------------------------------------------------

    @classmethod
    def create_bucket(cls, bucket: str) -> None:
        """Create ``bucket`` (no error if it exists)."""
        cls._buckets.setdefault(bucket, _Bucket())

    @classmethod
    def delete_bucket(cls, bucket: str) -> None:
        """Drop ``bucket`` and everything in it."""
        cls._buckets.pop(bucket, None)

    @classmethod
    def requests(cls, bucket: str) -> Counter[str]:
        """Requests made to ``bucket`` so far, by kind (a copy)."""
        store = cls._buckets.get(bucket)
        if store is None:
            return Counter()
        with store.lock:
            return Counter(store.requests)

    @classmethod
    def reset_requests(cls, bucket: str) -> None:
        """Zero the request counters of ``bucket``."""
        store = cls._buckets.get(bucket)
        if store is not None:
            with store.lock:
                store.requests.clear()

    # -- primitives ----------------------------------------------------------------------

    def _bucket(self) -> _Bucket:
        store = self._buckets.get(self.bucket)
        if store is None:
            raise BucketNotFoundError(
                f"memory bucket {self.bucket!r} does not exist; create it first with "
                f"MemoryBackend.create_bucket({self.bucket!r})")
        return store

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _object(self, store: _Bucket, key: str) -> bytes:
        found = store.objects.get(self._name(key))
        if found is None:
            raise FileNotFoundError(f"no such object {key!r} under {self.uri}")
        return found[0]

    def _open_upload(self, key: str) -> Upload:
        store = self._bucket()
        upload_id = f"upload-{next(self._ids)}"
        with store.lock:
            store.requests["create_upload"] += 1
            store.uploads[upload_id] = self._name(key)
        return _MemoryUpload(self, key, upload_id)

    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        store = self._bucket()
        with store.lock:
            store.requests["range_get"] += 1
            data = self._object(store, key)
        end = offset + sum(len(o) for o in outs)
        if end > len(data):
            raise EOFError(f"{key!r} holds {len(data)} bytes; asked for {offset}..{end}")
        pos = offset
        for out in outs:
            out[:] = data[pos : pos + len(out)]
            pos += len(out)

    @property
    def conditional_writes(self) -> bool:
        return True

    def _put(self, key: str, data: bytes, *, atomic: bool, if_absent: bool = False,
             if_match: str | None = None) -> None:
        store = self._bucket()
        name = self._name(key)
        with store.lock:
            store.requests["put"] += 1
            found = store.objects.get(name)
            if if_absent and found is not None:
                raise PreconditionFailedError(f"{key!r} exists under {self.uri}")
            if if_match is not None and (found is None or _version(found) != if_match):
                raise PreconditionFailedError(f"{key!r} under {self.uri} is not version "
                                              f"{if_match}")
            store.objects[name] = (bytes(data), time.time())

    def _get(self, key: str) -> bytes:
        store = self._bucket()
        with store.lock:
            store.requests["get"] += 1
            return self._object(store, key)

    def _stat(self, key: str) -> ObjectInfo:
        store = self._bucket()
        with store.lock:
            store.requests["head"] += 1
            found = store.objects.get(self._name(key))
        if found is None:
            raise FileNotFoundError(f"no such object {key!r} under {self.uri}")
        return ObjectInfo(key, len(found[0]), found[1], _version(found))

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        store = self._bucket()
        root = f"{self.prefix}/" if self.prefix else ""
        with store.lock:
            store.requests["list"] += 1
            items = [(name[len(root):], data, mtime) for name, (data, mtime)
                     in store.objects.items() if name.startswith(root + prefix)]
        for key, data, mtime in items:
            yield ObjectInfo(key, len(data), mtime)

    def _list_dirs(self, prefix: str, start_after: str) -> Iterable[str]:
        store = self._bucket()
        root = f"{self.prefix}/" if self.prefix else ""
        with store.lock:
            store.requests["list"] += 1  # one delimiter listing
            names = [name[len(root + prefix):] for name in store.objects
                     if name.startswith(root + prefix)]
        heads = {n.partition("/")[0] for n in names if "/" in n}
        return {h for h in heads if h > start_after}

    def _delete(self, keys: Sequence[str]) -> None:
        store = self._bucket()
        with store.lock:
            store.requests["delete"] += 1
            for key in keys:
                store.objects.pop(self._name(key), None)

    def _list_uploads(self, prefix: str) -> Iterable[tuple[str, str]]:
        store = self._bucket()
        root = f"{self.prefix}/" if self.prefix else ""
        with store.lock:
            store.requests["list_uploads"] += 1
            return [(name[len(root):], upload_id) for upload_id, name in store.uploads.items()
                    if name.startswith(root + prefix)]

    def _abort_upload(self, key: str, upload_id: str) -> None:
        store = self._bucket()
        with store.lock:
            store.requests["abort_upload"] += 1
            store.uploads.pop(upload_id, None)


def _version(found: tuple[bytes, float]) -> str:
    """An object's version: its content and time (a rewrite of the same bytes is new)."""
    data, mtime = found
    return f"{zlib.crc32(data):08x}-{mtime!r}"
