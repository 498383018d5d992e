"""Conformance: listing by prefix and deleting."""

from __future__ import annotations

from dcpstore.backend import Backend

from ._base import ConformanceBase

__all__ = ["ListingTests"]


class ListingTests(ConformanceBase):
    """``list(prefix)`` is recursive and sorted; ``delete`` ignores missing keys."""

    def test_list_and_delete(self, backend: Backend) -> None:
        for key in ("a/1", "a/2", "b/1", "c"):
            backend.put(key, key.encode())
        assert [o.key for o in backend.list()] == ["a/1", "a/2", "b/1", "c"]
        assert [o.key for o in backend.list("a/")] == ["a/1", "a/2"]
        assert {o.key: o.size for o in backend.list("b")} == {"b/1": 3}
        backend.delete(["a/1", "c", "does-not-exist"])
        assert [o.key for o in backend.list()] == ["a/2", "b/1"]
