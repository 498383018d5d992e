"""Concurrent scatter reads: how :meth:`Backend.read_ranges` fetches many byte ranges.

Each range is one request (``Backend._read_into`` through ``Backend._call``), filling
either a fresh, uninitialized buffer or the caller's views in order (a scatter read:
e.g. straight into destination tensors). At most the read concurrency limit's ranges are
in flight (:mod:`dcpstore.storage.concurrency`), on the backend's worker pool, and the
results are yielded in completion order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

import crc32c

from dcpstore.storage.types import ReadRange, uninitialized_buffer

if TYPE_CHECKING:
    from dcpstore.storage.backend import Backend

__all__ = ["scatter_reads"]


def scatter_reads(
    backend: Backend,
    ranges: Sequence[ReadRange],
    buffers: Sequence[memoryview | Sequence[memoryview]] | None,
    checksums: Sequence[dict[int, int | None]] | None = None,
) -> Iterator[tuple[int, Any]]:
    """Fetch ``ranges`` with ``backend``'s requests; yield ``(index, data)`` as each
    completes (the work of :meth:`~dcpstore.storage.backend.Backend.read_ranges`, which
    validates the arguments first).

    Args:
        backend: The backend whose requests, pool and read concurrency limit are used.
        ranges: The ranges to fetch (at least one).
        buffers: Optional destinations, one per range: a view of exactly its length, or
            a list of views whose lengths add up to it.
        checksums: Optional, per range: indices of its views whose CRC32C to put in
            the dict (by the backend while reading where it can, else here, after the
            request has given back its slot).

    Yields:
        ``(index, data)``: the range's index and its buffer (``buffers[index]`` where
        given).
    """
    gate = backend._concurrency("read")

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
        want = checksums[i] if checksums is not None else None
        if r.length:
            started = gate.acquire()
            assert started is not None  # a blocking acquire without timeout
            ok = False
            try:
                if want:
                    want.update(dict.fromkeys(want))  # a retried read starts over
                    backend._call(backend._read_into_checksummed, r.key, r.offset, outs,
                                  want, key=r.key, concurrency=gate)
                else:
                    backend._call(backend._read_into, r.key, r.offset, outs, key=r.key,
                                  concurrency=gate)
                ok = True
            finally:
                gate.release(started, r.length if ok else 0, ok=ok)
        if want:
            for j, value in want.items():
                if value is None:
                    want[j] = crc32c.crc32c(outs[j])
        return i, out

    if len(ranges) == 1 or backend.options.max_concurrency == 1:
        for i in range(len(ranges)):
            yield fetch(i)
        return
    pool = backend._executor()
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
