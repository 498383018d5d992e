"""The conformance suite against the local backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dcpstore import local
from dcpstore.local import LocalBackend, LocalOptions
from dcpstore.testing import BackendConformance

MiB = 1024 * 1024


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


# -- write-back while writing ---------------------------------------------------------------


@pytest.mark.parametrize(("fsync", "writeback", "kicks"),
                         [(True, 16 * MiB, [(0, 16 * MiB), (16 * MiB, 16 * MiB)]),
                          (True, 0, []), (False, 16 * MiB, [])])
def test_data_files_start_writeback_as_they_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool, writeback: int,
    kicks: list[tuple[int, int]],
) -> None:
    calls: list[tuple[int, int]] = []

    def record(fd: int, offset: int, nbytes: int, flags: int) -> int:
        assert flags == 2  # SYNC_FILE_RANGE_WRITE: start write-back, do not wait
        calls.append((offset, nbytes))
        return 0

    monkeypatch.setattr(local, "_sync_file_range", lambda: record)
    backend = LocalBackend(str(tmp_path), LocalOptions(fsync=fsync, writeback=writeback))
    data = os.urandom(40 * MiB + 5)
    with backend.open_upload("__0_0.x.distcp") as upload:
        upload.write(data[:1000])
        upload.write(data[1000:])  # one large write, written and kicked in 16 MiB steps
        upload.commit()
    assert (tmp_path / "__0_0.x.distcp").read_bytes() == data
    assert calls == kicks  # the last 8 MiB are left to the fsync of commit


def test_writeback_option_is_validated() -> None:
    with pytest.raises(ValueError, match="writeback"):
        LocalOptions(writeback=-1).validate()
