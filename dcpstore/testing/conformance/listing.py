"""Conformance: listing by prefix and deleting."""

from __future__ import annotations

from dcpstore.storage.backend import Backend
from dcpstore.testing.conformance._base import ConformanceBase

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

    def test_list_dirs(self, backend: Backend) -> None:
        """``list_dirs`` is one level (a delimiter listing), sorted, and honours
        ``start_after``; a directory is listed while an object lies below it (one
        emptied since may still be listed where the store keeps directories)."""
        for key in ("step-000000001/.metadata", "step-000000001/__0_0.distcp",
                    "step-000000002/sub/deep", "step-000000010/x", "top", "other/y"):
            backend.put(key, b"x")
        assert backend.list_dirs() == ["other", "step-000000001", "step-000000002",
                                       "step-000000010"]
        assert backend.list_dirs(start_after="step-000000001") == ["step-000000002",
                                                                   "step-000000010"]
        assert backend.list_dirs(start_after="step-000000010") == []
        assert backend.list_dirs("step-000000002/") == ["sub"]
        assert backend.list_dirs("step-000000001/") == []
        assert backend.list_dirs("missing/") == []
        backend.delete(["step-000000010/x", "other/y"])
        backend.remove_empty_dirs()
        assert set(backend.list_dirs()) >= {"step-000000001", "step-000000002"}
        assert backend.list_dirs(start_after="step-000000002") in ([], ["step-000000010"])
