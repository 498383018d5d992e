"""A generic concurrent multipart upload, shared by the object-store backends.

Writes are cut into ``part_size`` parts. Each full part is handed to the backend's
worker pool while the caller keeps serializing the next one; a backend-wide semaphore
caps the parts in flight (the memory bound: ``part_size x max_concurrency`` plus the
part being filled). An object that ends smaller than one part is stored with a single
request instead, so small files cost one PUT.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from typing_extensions import Buffer

from .backend import ObjectInfo, Upload

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["MultipartUpload"]

logger = logging.getLogger(__name__)


class MultipartUpload(Upload):
    """Base class of part-based streaming uploads.

    Subclasses implement four requests; each is retried by the backend:

    - :meth:`_create` starts the multipart upload (called lazily, when the first part
      is full) and returns its id,
    - :meth:`_upload_part` uploads part ``number`` (1-based) and returns its tag,
    - :meth:`_complete` assembles the parts,
    - :meth:`_abort_multipart` discards them,

    and :meth:`_put_whole` stores a small object in one request.
    """

    def __init__(self, backend: Backend, key: str, part_size: int | None = None) -> None:
        self.backend = backend
        self.key = key
        self.part_size = part_size or backend.options.part_size
        self.upload_id: str | None = None
        self._buffer = bytearray()
        self._parts: dict[int, Any] = {}
        self._futures: list[Future[None]] = []
        self._next_part = 1
        self._size = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False

    # -- requests (override) -----------------------------------------------------------

    @abc.abstractmethod
    def _create(self) -> str: ...

    @abc.abstractmethod
    def _upload_part(self, upload_id: str, number: int, data: memoryview) -> Any: ...

    @abc.abstractmethod
    def _complete(self, upload_id: str, parts: list[tuple[int, Any]]) -> None: ...

    @abc.abstractmethod
    def _abort_multipart(self, upload_id: str) -> None: ...

    @abc.abstractmethod
    def _put_whole(self, data: memoryview) -> None: ...

    # -- Upload ----------------------------------------------------------------------

    def write(self, data: Buffer) -> int:
        if self._closed:
            raise ValueError(f"upload of {self.key!r} is already closed")
        self._raise_if_failed()
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        while pos < n:
            room = self.part_size - len(self._buffer)
            take = min(room, n - pos)
            self._buffer += view[pos : pos + take]
            pos += take
            if len(self._buffer) >= self.part_size:
                self._submit_part()
        self._size += n
        return n

    def commit(self) -> ObjectInfo:
        if self._closed:
            raise ValueError(f"upload of {self.key!r} is already closed")
        try:
            if self.upload_id is None:
                data = memoryview(self._buffer)
                self.backend._call(self._put_whole, data, key=self.key)
            else:
                if self._buffer:
                    self._submit_part()
                self._drain()
                parts = sorted(self._parts.items())
                self.backend._call(self._complete, self.upload_id, parts, key=self.key)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._buffer = bytearray()
        return ObjectInfo(self.key, self._size)

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buffer = bytearray()
        for fut in self._futures:
            fut.cancel()
        for fut in self._futures:
            with contextlib.suppress(BaseException):
                fut.result()
        if self.upload_id is not None:
            try:
                self.backend._call(self._abort_multipart, self.upload_id, key=self.key)
            except Exception as exc:
                logger.warning("could not abort multipart upload of %s: %s", self.key, exc)

    # -- machinery ---------------------------------------------------------------------

    def _submit_part(self) -> None:
        if self.upload_id is None:
            self.upload_id = self.backend._call(self._create, key=self.key)
        number = self._next_part
        self._next_part += 1
        data, self._buffer = self._buffer, bytearray()
        slots = self.backend._upload_slots
        slots.acquire()  # blocks while max_concurrency parts are in flight
        try:
            fut = self.backend._executor().submit(self._run_part, number, data)
        except BaseException:
            slots.release()
            raise
        self._futures.append(fut)

    def _run_part(self, number: int, data: bytearray) -> None:
        try:
            if self._error is not None:
                return
            assert self.upload_id is not None
            tag = self.backend._call(
                self._upload_part, self.upload_id, number, memoryview(data), key=self.key
            )
            with self._lock:
                self._parts[number] = tag
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
            raise
        finally:
            self.backend._upload_slots.release()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        for fut in self._futures:
            fut.result()
        self._raise_if_failed()
