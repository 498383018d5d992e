"""Conformance: small objects (put, get, stat, exists) and key validation."""

from __future__ import annotations

import pytest

import dcpstore
from dcpstore import errors
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

    # -- conditional writes (a backend with conditional_writes) ------------------------

    @staticmethod
    def _conditional(backend: Backend) -> None:
        if not backend.conditional_writes:
            pytest.skip(f"{backend.name}: no conditional writes (commits fall back to "
                        "a check before the save; docs/reliability.md)")

    def test_put_if_absent_has_one_winner(self, backend: Backend) -> None:
        self._conditional(backend)
        backend.put("once", b"first", atomic=True, if_absent=True)
        with pytest.raises(errors.PreconditionFailedError):
            backend.put("once", b"second", atomic=True, if_absent=True)
        assert backend.get("once") == b"first"
        assert [o.key for o in backend.list()] == ["once"]  # no temporary left behind

    def test_put_if_match_swaps_only_the_version_read(self, backend: Backend) -> None:
        self._conditional(backend)
        backend.put("ptr", b"v1", atomic=True)
        v1 = backend.stat("ptr").version
        assert v1
        backend.put("ptr", b"v2", atomic=True, if_match=v1)
        v2 = backend.stat("ptr").version
        assert v2 and v2 != v1
        with pytest.raises(errors.PreconditionFailedError):  # a stale compare-and-swap
            backend.put("ptr", b"v3", atomic=True, if_match=v1)
        assert backend.get("ptr") == b"v2"
        backend.put("ptr", b"v2", atomic=True, if_match=v2)  # the same bytes again: new
        assert backend.stat("ptr").version != v2 or backend.get("ptr") == b"v2"

    def test_put_if_match_of_a_missing_object_fails(self, backend: Backend) -> None:
        self._conditional(backend)
        backend.put("gone", b"x", atomic=True)
        version = backend.stat("gone").version
        assert version
        backend.delete(["gone"])
        with pytest.raises((errors.PreconditionFailedError, errors.ObjectNotFoundError)):
            backend.put("gone", b"y", atomic=True, if_match=version)
        assert not backend.exists("gone")

    def test_conditions_refused_without_conditional_writes(self, backend: Backend) -> None:
        if backend.conditional_writes:
            pytest.skip(f"{backend.name} has conditional writes")
        with pytest.raises(errors.ConfigurationError, match="conditional"):
            backend.put("x", b"1", if_absent=True)
        assert not backend.exists("x")
