"""Conformance: streaming uploads (multipart, empty, aborted, failed)."""

from __future__ import annotations

import random

import pytest

from dcpstore.storage.backend import Backend
from dcpstore.testing.conformance._base import ConformanceBase, payload

__all__ = ["UploadTests"]


class UploadTests(ConformanceBase):
    """``open_upload`` / ``write`` / ``commit`` / ``abort``: nothing visible until commit."""

    def test_stream_roundtrip_multipart(self, backend: Backend) -> None:
        part = backend.options.part_size
        data = payload(2 * part + 12345)
        with backend.open_upload("big.distcp") as up:
            pos = 0
            rng = random.Random(3)
            while pos < len(data):
                step = rng.choice([1, 17, 4096, part // 3, part + 5])
                up.write(memoryview(data)[pos : pos + step])
                pos += step
            info = up.commit()
        assert info.size == len(data)
        assert backend.stat("big.distcp").size == len(data)
        assert backend.get("big.distcp") == data

    def test_small_stream_roundtrip(self, backend: Backend) -> None:
        with backend.open_upload("tiny") as up:
            up.write(b"abc")
            up.write(bytearray(b"def"))
            up.commit()
        assert backend.get("tiny") == b"abcdef"

    def test_empty_stream(self, backend: Backend) -> None:
        up = backend.open_upload("empty")
        assert up.commit().size == 0
        assert backend.get("empty") == b""

    def test_aborted_upload_leaves_nothing(self, backend: Backend) -> None:
        part = backend.options.part_size
        up = backend.open_upload("aborted.distcp")
        up.write(payload(part + 10))
        if not self.uploads_visible_before_commit:
            assert not backend.exists("aborted.distcp")
        up.abort()
        up.abort()  # idempotent
        assert not backend.exists("aborted.distcp")
        assert backend.list_uploads() == []

    def test_failed_write_leaves_nothing(self, backend: Backend) -> None:
        with pytest.raises(RuntimeError, match="serializer"), backend.open_upload("f") as up:
            up.write(b"x" * 1000)
            raise RuntimeError("serializer broke")
        assert not backend.exists("f")
