"""Conformance: concurrent ranged reads, into buffers and scattered."""

from __future__ import annotations

import pytest

from dcpstore.dcp.checksum import crc32c
from dcpstore.storage.backend import Backend, ReadRange
from dcpstore.testing.conformance._base import ConformanceBase, payload

__all__ = ["RangeTests"]


class RangeTests(ConformanceBase):
    """``read_ranges``: every range, exact bytes, into caller buffers, short reads fail."""

    def test_read_ranges(self, backend: Backend) -> None:
        data = payload(300_000, seed=5)
        backend.put("r", data)
        ranges = [ReadRange("r", 0, 10), ReadRange("r", 299_990, 10), ReadRange("r", 5, 0),
                  ReadRange("r", 1000, 123_456)] + [ReadRange("r", i * 997, 513) for i in range(40)]
        got = dict(backend.read_ranges(ranges))
        assert sorted(got) == list(range(len(ranges)))
        for i, r in enumerate(ranges):
            assert bytes(got[i]) == data[r.offset : r.offset + r.length]

    def test_read_ranges_into_buffers(self, backend: Backend) -> None:
        data = payload(4096, seed=6)
        backend.put("r", data)
        bufs = [memoryview(bytearray(100)), memoryview(bytearray(50))]
        list(backend.read_ranges([ReadRange("r", 0, 100), ReadRange("r", 4046, 50)], bufs))
        assert bytes(bufs[0]) == data[:100] and bytes(bufs[1]) == data[4046:]

    def test_scatter_read(self, backend: Backend) -> None:
        """One range filled into several buffers in order (reads into tensors)."""
        data = payload(1_000_000, seed=7)
        backend.put("s", data)
        sizes = [3, 0, 700_000, 1, 99_996]
        bufs = [memoryview(bytearray(n)) for n in sizes]
        done = list(backend.read_ranges([ReadRange("s", 200_000, sum(sizes))], [bufs]))
        assert [i for i, _ in done] == [0]
        assert b"".join(bytes(b) for b in bufs) == data[200_000 : 200_000 + sum(sizes)]
        with pytest.raises(ValueError):
            list(backend.read_ranges([ReadRange("s", 0, 10)], [[memoryview(bytearray(9))]]))

    def test_scatter_read_checksums(self, backend: Backend) -> None:
        """``checksums``: the CRC32C of each named buffer, whether the store computes it
        while reading (``read_checksummed``) or the framework after the request."""
        data = payload(3_000_000, seed=8)
        backend.put("c", data)
        sizes = [1_500, 2_000_000, 0, 700, 900_000]
        ranges = [ReadRange("c", 1_000, sum(sizes)), ReadRange("c", 0, 1_000)]
        bufs = [[memoryview(bytearray(n)) for n in sizes], [memoryview(bytearray(1_000))]]
        checksums: list[dict[int, int | None]] = [{1: None, 2: None, 4: None}, {0: None}]
        list(backend.read_ranges(ranges, bufs, checksums))
        assert b"".join(bytes(b) for b in bufs[0]) == data[1_000 : 1_000 + sum(sizes)]
        for buffers, crcs in zip(bufs, checksums, strict=True):
            assert crcs == {j: crc32c(buffers[j]) for j in crcs}, crcs
        with pytest.raises(ValueError, match="checksums"):
            list(backend.read_ranges(ranges, None, checksums))

    def test_read_past_end_fails(self, backend: Backend) -> None:
        backend.put("short", b"0123456789")
        with pytest.raises((OSError, EOFError)):
            list(backend.read_ranges([ReadRange("short", 5, 100)]))
