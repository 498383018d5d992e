"""The conformance suite against the local backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpstore.testing import BackendConformance


class TestLocalBackend(BackendConformance):
    uploads_visible_before_commit = True

    @pytest.fixture
    def checkpoint_uri(self, tmp_path: Path) -> str:
        return str(tmp_path / "ckpt")


class TestLocalBackendFileURI(BackendConformance):
    uploads_visible_before_commit = True

    @pytest.fixture
    def checkpoint_uri(self, tmp_path: Path) -> str:
        return (tmp_path / "ckpt").as_uri()

    @pytest.fixture
    def backend_options(self) -> dict[str, object]:
        return {"fsync": False, "part_size": 4096}
