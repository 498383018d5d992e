"""A generic concurrent multipart upload, shared by the object-store backends.

Writes are cut into ``part_size`` parts. Each is copied into a preallocated part buffer
taken from the backend's :class:`PartBuffers` pool; a full buffer is handed to the
backend's worker pool as one part while the caller keeps serializing into the next one,
and the worker puts the buffer back once the part's request is over. A backend-wide
:class:`~dcpstore.storage.concurrency.ConcurrencyLimit` caps the parts in flight: it adapts to
what the store sustains (see :mod:`dcpstore.storage.concurrency`) and never exceeds
``max_concurrency``, so the memory of a save is bounded by
``part_size x (max_concurrency + uploads being filled)`` (each open upload fills one
buffer), and the same buffers are reused part after part: no fresh memory (page faults,
kernel zeroing) per part, no allocator churn. The pool keeps at most
``max_concurrency + 2`` idle buffers until :meth:`~dcpstore.Backend.close`.

That per-backend state (the upload slots and the buffer pools) is a
:class:`MultipartState`, made on first use through the backend's lazy state: it is
dropped when the backend is pickled (an unpickled backend makes a fresh one) and by
``close()``. An upload keeps the state it started with until it ends.

An object that ends smaller than one part is stored with a single request instead, so
small files cost one PUT. A caller that knows about how large the object will be says so
with :meth:`~dcpstore.Upload.expect_size` (the writer does, for every data file): an
object the backend's :meth:`~dcpstore.Backend.upload_memory` says fits is then filled into
one buffer of its own size (pooled by size, the pools of all sizes within ``part_size x
max_concurrency``: see :meth:`MultipartState.whole_buffers`) and sent with a single
request too, where a multipart upload would cost a request per part plus two more.
:func:`first_buffer_bytes` says how large that first buffer is, so a caller can budget
the memory of the uploads it runs at once (:meth:`~dcpstore.Backend.upload_memory`).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import Buffer

from dcpstore.storage.backend import ObjectInfo, Upload
from dcpstore.storage.concurrency import ConcurrencyLimit

if TYPE_CHECKING:
    from dcpstore.storage.backend import Backend

__all__ = [
    "MultipartState",
    "MultipartUpload",
    "PartBuffers",
    "anonymous_buffer",
    "first_buffer_bytes",
]

logger = logging.getLogger(__name__)

#: A whole object's buffer is its announced size rounded up to this (the announcement
#: may fall a little short: item headers, byte items of unknown size).
_WHOLE_ROUNDING = 1 << 20


def first_buffer_bytes(first_part: int, whole_limit: int, size_hint: int | None) -> int:
    """The buffer an upload fills before its first request.

    Args:
        first_part: The size of part 1 (the buffer of an object of unknown size).
        whole_limit: The largest announced object sent in one request.
        size_hint: The object's announced size, if any.

    Returns:
        ``first_part``, or, for an announced object larger than that and at most
        ``whole_limit``, its size rounded up to a MiB (then never below ``first_part``,
        so an object that outgrows it still starts a valid multipart upload).
    """
    if size_hint is None or size_hint <= first_part or size_hint > whole_limit:
        return first_part
    return -(-size_hint // _WHOLE_ROUNDING) * _WHOLE_ROUNDING


def anonymous_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` of anonymous memory: not zero-filled up front (the kernel maps zeroed
    pages on first touch) and returned to the OS as soon as it is dropped, whatever the
    allocator's thresholds."""
    return mmap.mmap(-1, nbytes)


class PartBuffers:
    """A free list of upload part buffers of one size, shared by a backend's uploads.

    :meth:`acquire` hands out an idle buffer or allocates one; :meth:`release` takes it
    back, keeping at most ``keep`` idle (the rest are dropped). Get a backend's pool with
    :meth:`of`; :meth:`~dcpstore.Backend.close` drops its pools.

    Attributes:
        size: Bytes of every buffer.
        keep: Most idle buffers kept.
        allocated: Buffers allocated so far.
        outstanding: Buffers acquired and not yet released.
        peak: Most buffers outstanding at once.
    """

    def __init__(self, size: int, keep: int,
                 allocate: Callable[[int], Buffer] = anonymous_buffer) -> None:
        self.size = size
        self.keep = keep
        self.allocated = 0
        self.outstanding = 0
        self.peak = 0
        self._allocate = allocate
        self._free: list[Buffer] = []
        self._lock = threading.Lock()

    @classmethod
    def of(cls, backend: Backend, size: int,
           allocate: Callable[[int], Buffer] = anonymous_buffer) -> PartBuffers:
        """The pool of ``backend`` for buffers of ``size`` made by ``allocate`` (created
        on first use; it keeps ``max_concurrency + 2`` idle buffers at most)."""
        return MultipartState.of(backend).buffers(size, allocate)

    @property
    def free(self) -> int:
        """Idle buffers held."""
        return len(self._free)

    def acquire(self) -> Buffer:
        """An idle buffer of :attr:`size` bytes (contents undefined), or a new one."""
        with self._lock:
            if self._free:
                self._take()
                return self._free.pop()
        buf = self._allocate(self.size)
        with self._lock:
            self.allocated += 1
            self._take()
        return buf

    def _take(self) -> None:
        self.outstanding += 1
        self.peak = max(self.peak, self.outstanding)

    def release(self, buf: Buffer) -> None:
        """Give back a buffer from :meth:`acquire`; nothing may use it any more."""
        with self._lock:
            if any(b is buf for b in self._free):
                raise RuntimeError("part buffer released twice")
            self.outstanding -= 1
            if len(self._free) < self.keep:
                self._free.append(buf)

    @property
    def held(self) -> int:
        """Bytes of the buffers in use and idle."""
        with self._lock:
            return (self.outstanding + len(self._free)) * self.size

    def drop_idle(self) -> None:
        """Drop every idle buffer (its memory goes back to the OS)."""
        with self._lock:
            self._free.clear()


class MultipartState:
    """The multipart machinery's state of one backend: the limit on parts in flight (the
    backend's upload :class:`~dcpstore.storage.concurrency.ConcurrencyLimit`, at most
    ``max_concurrency``) and the part-buffer pools, one per size and allocator. Get it
    with :meth:`of`.

    Whole announced objects' buffers (:meth:`whole_buffers`) come in varied sizes; their
    pools together hold at most ``window`` bytes (in use and idle) where the uploads in
    use allow: a new buffer drops the idle ones of other sizes first.

    Attributes:
        slots: Parts in flight at once, across every upload of the backend.
        pools: The :class:`PartBuffers` by ``(size, allocate)``.
        whole_pools: The pools of whole objects' buffers, by ``(size, allocate)``.
    """

    _KEY = "multipart"

    def __init__(self, slots: ConcurrencyLimit, keep: int, window: int = 0) -> None:
        self.slots = slots
        self.pools: dict[tuple[int, Callable[[int], Buffer]], PartBuffers] = {}
        self.whole_pools: dict[tuple[int, Callable[[int], Buffer]], PartBuffers] = {}
        self._keep = keep
        self._window = window
        self._lock = threading.Lock()

    @classmethod
    def of(cls, backend: Backend) -> MultipartState:
        """The state of ``backend``, made on first use (dropped when the backend is
        pickled and by its ``close()``)."""
        o = backend.options
        return backend._lazy(cls._KEY, lambda: cls(backend._concurrency("upload"),
                                                    o.max_concurrency + 2,
                                                    o.part_size * o.max_concurrency))

    @classmethod
    def peek(cls, backend: Backend) -> MultipartState | None:
        """The state of ``backend`` if it has one now (made by nothing)."""
        state: MultipartState | None = backend._resources.get(cls._KEY)
        return state

    def buffers(self, size: int,
                allocate: Callable[[int], Buffer] = anonymous_buffer) -> PartBuffers:
        """The pool of buffers of ``size`` made by ``allocate`` (created on first use)."""
        with self._lock:
            pool = self.pools.get((size, allocate))
            if pool is None:
                pool = self.pools[(size, allocate)] = PartBuffers(size, self._keep, allocate)
            return pool

    def whole_buffers(self, size: int,
                      allocate: Callable[[int], Buffer] = anonymous_buffer) -> PartBuffers:
        """The pool of whole objects' buffers of ``size``, with room made for one more
        of them: idle buffers of other sizes are dropped while the whole pools would
        hold more than the window (a model's equal layers reuse one size)."""
        with self._lock:
            pool = self.whole_pools.get((size, allocate))
            if pool is None:
                keep = max(1, self._window // size)
                pool = self.whole_pools[(size, allocate)] = PartBuffers(size, keep, allocate)
            others = [p for p in self.whole_pools.values() if p is not pool]
            held = sum(p.held for p in self.whole_pools.values())
            for other in sorted(others, key=lambda p: p.size, reverse=True):
                if held + size <= self._window:
                    break
                before = other.held
                other.drop_idle()
                held -= before - other.held
            return pool


class MultipartUpload(Upload):
    """Base class of part-based streaming uploads.

    Subclasses implement four requests; each is retried by the backend:

    - :meth:`_create` starts the multipart upload (called lazily, when the first part
      is full) and returns its id,
    - :meth:`_upload_part` uploads part ``number`` (1-based) and returns its tag,
    - :meth:`_complete` assembles the parts,
    - :meth:`_abort_multipart` discards them,

    and :meth:`_put_whole` stores an object of one buffer in one request (a small one,
    or one announced by :meth:`expect_size`). ``_upload_part`` and
    ``_put_whole`` get a view of just the filled bytes of a pooled part buffer: it must
    not be used after they return (the buffer is reused). A full part's view spans its
    whole buffer (made by :meth:`_allocate_buffer`), which lets a client that only takes
    whole objects send it without a copy.
    """

    #: Part-size growth, ``(after part, factor)`` pairs: a part numbered above ``after``
    #: is ``factor`` x ``part_size`` (the largest such factor applies; none: one fixed
    #: size). A store with a part-count limit (S3: 10,000, GCS: 1,024 components) can
    #: then take a small first part size, which keeps small objects' uploads pipelined,
    #: and still store large objects.
    part_growth: ClassVar[tuple[tuple[int, int], ...]] = ()

    def __init__(self, backend: Backend, key: str, part_size: int | None = None) -> None:
        self.backend = backend
        self.key = key
        self.part_size = part_size or backend.options.part_size
        self.upload_id: str | None = None
        self._state = MultipartState.of(backend)  # kept until this upload ends
        # the part being filled: a pooled buffer, a view of it, the bytes in it
        self._buffer: Buffer | None = None
        self._buffer_pool: PartBuffers | None = None
        self._view: memoryview | None = None
        self._fill = 0
        self._parts: dict[int, Any] = {}
        self._futures: list[Future[None]] = []
        self._next_part = 1
        self._size = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._expected: int | None = None

    @staticmethod
    def _allocate_buffer(nbytes: int) -> Buffer:
        """Allocate one part buffer (pooled per backend and size, so allocated rarely).

        Anonymous memory by default; override where the client wants another type.
        """
        return anonymous_buffer(nbytes)

    def first_buffer(self) -> int:
        """The size of the buffer filled before the first request: what the backend's
        :meth:`~dcpstore.Backend.upload_memory` says an upload of the announced size
        holds (S3: :func:`first_buffer_bytes`), never less than part 1."""
        return max(self.part_bytes(1), self.backend.upload_memory(self._expected))

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

    def expect_size(self, nbytes: int) -> None:
        """Announce about ``nbytes`` before the first write: an object that fits the
        buffer :meth:`first_buffer` then sizes is sent in one request (one
        that outgrows the buffer goes on as a multipart upload, its first part that
        buffer). Ignored once writing began."""
        if self._next_part == 1 and self._buffer is None:
            self._expected = max(0, int(nbytes))

    def write(self, data: Buffer) -> int:
        if self._closed:
            raise ValueError(f"upload of {self.key!r} is already closed")
        self._raise_if_failed()
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        while pos < n:
            out = self._view
            if out is None:
                out = self._take_buffer()
            take = min(len(out) - self._fill, n - pos)
            out[self._fill : self._fill + take] = view[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == len(out):
                self._submit_part()
        self._size += n
        return n

    def commit(self) -> ObjectInfo:
        if self._closed:
            raise ValueError(f"upload of {self.key!r} is already closed")
        try:
            if self.upload_id is None:
                data = self._view[: self._fill] if self._view is not None else memoryview(b"")
                self.backend._call(self._put_whole, data, key=self.key)
            else:
                if self._fill:
                    self._submit_part()
                self._drain()
                parts = sorted(self._parts.items())
                self.backend._call(self._complete, self.upload_id, parts, key=self.key)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._drop_buffer()
        self._futures = []  # their callbacks hold the part buffers
        return ObjectInfo(self.key, self._size)

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_buffer()
        for fut in self._futures:
            fut.cancel()  # one that never ran gives its buffer back (_on_part_done)
        for fut in self._futures:
            with contextlib.suppress(BaseException):
                fut.result()
        self._futures = []
        if self.upload_id is not None:
            try:
                self.backend._call(self._abort_multipart, self.upload_id, key=self.key)
            except Exception as exc:
                logger.warning("could not abort multipart upload of %s: %s", self.key, exc)

    # -- machinery ---------------------------------------------------------------------

    def _take_buffer(self) -> memoryview:
        """Start filling a pooled buffer of the next part's size (a whole announced
        object's: one of its size)."""
        size = self.part_bytes(self._next_part)
        whole = self.first_buffer() if self._next_part == 1 else size
        if whole != size:
            pool = self._state.whole_buffers(whole, type(self)._allocate_buffer)
        else:
            pool = self._state.buffers(size, type(self)._allocate_buffer)
        buf = pool.acquire()
        self._buffer, self._buffer_pool = buf, pool
        self._view = memoryview(buf).cast("B")
        self._fill = 0
        return self._view

    def part_bytes(self, number: int) -> int:
        """The size of part ``number`` (1-based; the last part may be shorter)."""
        factor = max((f for after, f in self.part_growth if number > after), default=1)
        return self.part_size * factor

    def _hand_over(self) -> tuple[Buffer, PartBuffers, int]:
        """Take the buffer being filled (and its pool and fill level) off this upload."""
        buf, pool, n = self._buffer, self._buffer_pool, self._fill
        assert buf is not None and pool is not None
        self._buffer = self._buffer_pool = self._view = None
        self._fill = 0
        return buf, pool, n

    def _drop_buffer(self) -> None:
        """Give the buffer being filled, if any, back to its pool."""
        if self._buffer is not None:
            buf, pool, _ = self._hand_over()
            pool.release(buf)

    def _submit_part(self) -> None:
        if self.upload_id is None:
            self.upload_id = self.backend._call(self._create, key=self.key)
        number = self._next_part
        self._next_part += 1
        buf, pool, n = self._hand_over()
        slots = self._state.slots
        try:
            started = slots.acquire()  # blocks while the limit's parts are in flight
        except BaseException:
            pool.release(buf)
            raise
        assert started is not None  # a blocking acquire without timeout
        try:
            fut = self.backend._executor().submit(self._run_part, number, buf, pool, n,
                                                  started)
        except BaseException:
            pool.release(buf)
            slots.release(started, ok=False)
            raise
        fut.add_done_callback(lambda f: self._on_part_done(f, buf, pool, started))
        self._futures.append(fut)

    def _run_part(self, number: int, buf: Buffer, pool: PartBuffers, n: int,
                  started: float) -> None:
        slots = self._state.slots
        ok = False
        try:
            if self._error is not None:
                return
            assert self.upload_id is not None
            view = memoryview(buf).cast("B")
            data = view if n == len(view) else view[:n]
            tag = self.backend._call(self._upload_part, self.upload_id, number, data,
                                     key=self.key, concurrency=slots)
            with self._lock:
                self._parts[number] = tag
            ok = True
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
            raise
        finally:
            # the request is over (it ran in this thread): the buffer is free again,
            # before the slot, so the next part finds it idle
            try:
                pool.release(buf)
            finally:
                slots.release(started, n if ok else 0, ok=ok)

    def _on_part_done(self, fut: Future[None], buf: Buffer, pool: PartBuffers,
                      started: float) -> None:
        """A part cancelled before it ran never reached :meth:`_run_part`'s cleanup."""
        if fut.cancelled():
            try:
                pool.release(buf)
            finally:
                self._state.slots.release(started, ok=False)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        for fut in self._futures:
            fut.result()
        self._raise_if_failed()
