"""Conformance: small objects (put, get, stat, exists) and key validation."""

from __future__ import annotations

import pytest

import dcpstore
from dcpstore.storage.backend import Backend
from dcpstore.testing.conformance._base import ConformanceBase

__all__ = ["ObjectTests"]


class ObjectTests(ConformanceBase):
    """``put`` / ``get`` / ``stat`` of whole objects; unsafe keys refused."""

    def test_put_get_roundtrip(self, backend: Backend) -> None:
        backend.put("small.bin", b"hello world")
        assert backend.get("small.bin") == b"hello world"
        assert backend.stat("small.bin").size == 11
        assert backend.exists("small.bin")

    def test_atomic_put_replaces(self, backend: Backend) -> None:
        backend.put("m", b"old", atomic=True)
        backend.put("m", b"new!", atomic=True)
        assert backend.get("m") == b"new!"
        assert [o.key for o in backend.list()] == ["m"]

    @pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b", "a//b", "./x", ""])
    def test_unsafe_keys_refused(self, backend: Backend, key: str) -> None:
        with pytest.raises(dcpstore.UnsafeKeyError):
            backend.put(key, b"x")
        with pytest.raises(dcpstore.UnsafeKeyError):
            backend.get(key)
