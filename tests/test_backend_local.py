"""The conformance suite against the local backend."""

from __future__ import annotations

import errno
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore.dcp import layout
from dcpstore.errors import BucketNotFoundError, StoreThrottledError
from dcpstore.storage import local
from dcpstore.storage.backend import Backend, Failure, ReadRange
from dcpstore.storage.local import LocalBackend, LocalOptions
from dcpstore.testing import BackendConformance

MiB = 1024 * 1024


class TestLocalBackend(BackendConformance):
    uploads_visible_before_commit = True

    @pytest.fixture
    def checkpoint_uri(self, tmp_path: Path) -> str:
        return str(tmp_path / "ckpt")

    @pytest.fixture
    def store_faults(self) -> dict[str, BaseException]:
        """What the OS raises: a refused permission, a network file system's timeout."""
        return {"denied": PermissionError(errno.EACCES, "Permission denied"),
                "timeout": TimeoutError(errno.ETIMEDOUT, "Connection timed out"),
                "not_found": FileNotFoundError(errno.ENOENT, "No such file or directory")}


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


def test_writeback_is_skipped_where_the_platform_has_no_sync_file_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(local, "_sync_file_range", lambda: None)  # not Linux
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    backend = LocalBackend(str(tmp_path))
    data = os.urandom(20 * MiB)
    with backend.open_upload("__0_0.x.distcp") as upload:
        upload.write(data)
        upload.commit()
    assert (tmp_path / "__0_0.x.distcp").read_bytes() == data
    assert len(synced) == 1  # all of it left to the fsync of commit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_libc_sync_file_range_is_found_on_linux() -> None:
    assert local._sync_file_range() is not None


# -- the durability sequence of a whole save ------------------------------------------------


class _Journal:
    """What a save asks of the disk, in order: write-back started (``kick``), ``fsync``
    (of a file or a directory), ``rename`` and ``link`` (a conditional put's
    publication), with paths relative to ``root``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.events: list[tuple[Any, ...]] = []
        real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

        def kick(fd: int, offset: int, nbytes: int, flags: int) -> int:
            assert flags == 2  # SYNC_FILE_RANGE_WRITE: start write-back, do not wait
            self.events.append(("kick", self._name(fd), offset, nbytes))
            return 0

        def fsync(fd: int) -> None:
            self.events.append(("fsync", self._name(fd)))
            real_fsync(fd)

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("rename", self._rel(src), self._rel(dst)))
            real_replace(src, dst, *args, **kwargs)

        def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("link", self._rel(src), self._rel(dst)))
            real_link(src, dst, *args, **kwargs)

        monkeypatch.setattr(local, "_sync_file_range", lambda: kick)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "link", link)

    def _rel(self, path: Any) -> str:
        return os.path.relpath(os.fspath(path), self.root)

    def _name(self, fd: int) -> str:
        return self._rel(os.readlink(f"/proc/self/fd/{fd}"))

    def index(self, event: tuple[Any, ...]) -> int:
        return self.events.index(event)


def _big_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(1024, 1024, generator=g),  # 4 MiB
            "b": torch.randn(1000, generator=g), "step": 3}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_save_starts_writeback_and_syncs_data_before_the_commit_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Data files: write-back started every ``writeback`` bytes as they are written, then
    ``fsync``; only then the manifest and the temporary ``.metadata`` are written and
    ``fsync``-ed, linked as ``.metadata`` (the commit point: a hard link fails where
    another save committed first) and the directory ``fsync``-ed."""
    uri = tmp_path / "ckpt"
    journal = _Journal(uri, monkeypatch)
    state = _big_state()
    dcpstore.save(state, str(uri), writeback=MiB)

    (data,) = [f for f in os.listdir(uri) if f.endswith(".distcp")]
    size = (uri / data).stat().st_size
    kicks = [e[2:] for e in journal.events if e[0] == "kick" and e[1] == data]
    # every whole MiB, in order, as written; the tail is left to the fsync
    assert kicks == [(i * MiB, MiB) for i in range(size // MiB)]
    assert journal.index(("kick", data, *kicks[-1])) < journal.index(("fsync", data))
    manifest = next(f for f in os.listdir(uri) if f.startswith(".dcpstore-"))
    # every put is atomic: a temporary name, fsync, rename (.metadata: link), fsync of
    # the directory
    (put_manifest,) = [e for e in journal.events if e[0] == "rename"]
    (put_metadata,) = [e for e in journal.events if e[0] == "link"]
    assert put_manifest[2] == manifest and put_metadata[2] == layout.METADATA_KEY
    order = [journal.index(("fsync", data)), journal.index(("fsync", put_manifest[1])),
             journal.index(put_manifest), journal.index(("fsync", put_metadata[1])),
             journal.index(put_metadata)]
    assert order == sorted(order), journal.events
    assert journal.events[order[-1] + 1] == ("fsync", "."), journal.events
    out = {"w": torch.zeros(1024, 1024), "b": torch.zeros(1000), "step": 0}
    dcpstore.load(out, str(uri))
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["step"] == 3


# -- the base class: one classification, lazy client, pickling ------------------------------


class _Scripted(LocalBackend):
    """A local backend whose ``get`` raises a script of exceptions first (and whose
    client is the framework ``Backend``'s lazy one, made by ``_make_client``)."""

    client = Backend.client

    def __init__(self, location: str, options: LocalOptions | None = None) -> None:
        super().__init__(location, options)
        self.script: list[Exception] = []
        self.classified: list[Exception] = []
        self.clients = 0
        self.closed: list[object] = []
        self.guard = threading.Lock()

    def _get(self, key: str) -> bytes:
        if self.script:
            raise self.script.pop(0)
        return super()._get(key)

    def _classify(self, exc: Exception, key: str | None) -> Failure | None:
        self.classified.append(exc)
        if isinstance(exc, KeyError):  # e.g. a client's "throttled"
            return Failure(StoreThrottledError(errno.EAGAIN, f"throttled on {key}"),
                           retryable=True)
        return super()._classify(exc, key)

    def _make_client(self) -> object:
        time.sleep(0.05)  # let the other threads pile up on the lock
        self.clients += 1
        return object()

    def _close_client(self, client: object) -> None:
        self.closed.append(client)


def _scripted(tmp_path: Path, attempts: int = 3) -> _Scripted:
    backend = _Scripted(str(tmp_path), LocalOptions(max_attempts=attempts, retry_backoff=0.001,
                                                    retry_backoff_max=0.001))
    backend.put("k", b"value")
    return backend


def test_each_failure_is_classified_once_and_decides_retry_and_error(tmp_path: Path) -> None:
    backend = _scripted(tmp_path)
    first, second = KeyError("a"), KeyError("b")
    backend.script = [first, second]
    assert backend.get("k") == b"value"  # retried twice
    assert backend.classified == [first, second]

    backend.classified.clear()
    backend.script = [KeyError(n) for n in "abc"]
    with pytest.raises(StoreThrottledError, match="throttled on k") as info:
        backend.get("k")
    assert info.value.errno == errno.EAGAIN and isinstance(info.value.__cause__, KeyError)
    assert len(backend.classified) == 3  # one per attempt, none twice

    backend.classified.clear()
    backend.script = [ConnectionResetError("reset")]  # the default: retried
    assert backend.get("k") == b"value" and len(backend.classified) == 1
    backend.script = [ValueError("bad")]  # the default: raised as is, at once
    with pytest.raises(ValueError, match="bad"):
        backend.get("k")


def test_dcpstore_errors_pass_and_eof_is_an_os_error(tmp_path: Path) -> None:
    backend = _scripted(tmp_path)
    bucket = BucketNotFoundError(errno.ENOENT, "no bucket")
    backend.script = [bucket]
    with pytest.raises(BucketNotFoundError) as info:
        backend.get("k")
    assert info.value is bucket and backend.classified == []  # never classified, not retried
    backend.script = [EOFError("ends at byte 3")]
    with pytest.raises(OSError, match="k: ends at byte 3") as eof:
        backend.get("k")
    assert eof.value.errno == errno.EIO and not isinstance(eof.value, EOFError)
    with pytest.raises(OSError, match="truncated") as short:
        list(backend.read_ranges([ReadRange("k", 2, 10)]))
    assert short.value.errno == errno.EIO


def test_lazy_client_made_once_dropped_by_pickle_and_close(tmp_path: Path) -> None:
    backend = _scripted(tmp_path)
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(backend.client)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.clients == 1 and len({id(c) for c in seen}) == 1
    clone = pickle.loads(pickle.dumps(backend))
    assert clone.clients == 1 and clone._resources == {}
    assert clone.client is not seen[0] and clone.clients == 2
    assert type(clone.guard) is type(threading.Lock()) and clone.guard is not backend.guard
    assert clone.guard.acquire(blocking=False)  # a fresh lock, not a copy of a held one
    backend.close()
    assert backend.closed == [seen[0]] and backend.client is not seen[0]


def test_remove_empty_dirs_is_a_hook_of_every_backend(tmp_path: Path) -> None:
    assert Backend.remove_empty_dirs is not LocalBackend.remove_empty_dirs
    backend = LocalBackend(str(tmp_path / "root"))
    backend.put("a/b/c", b"1")
    backend.delete(["a/b/c"])
    backend.remove_empty_dirs()
    assert not (tmp_path / "root").exists()


# -- the store on the plugin contract ------------------------------------------------------


def test_local_backend_is_a_plugin_store(tmp_path: Path) -> None:
    from dcpstore.storage.store_backend import StoreBackend

    backend = dcpstore.open_backend(str(tmp_path / "c"))
    assert isinstance(backend, LocalBackend) and isinstance(backend, StoreBackend)
    assert isinstance(backend.store, local.LocalStore)
    assert backend.uri == str(tmp_path / "c")  # the plain path
    assert LocalBackend(str(tmp_path)).uri == str(tmp_path)
    clone = pickle.loads(pickle.dumps(backend))
    assert type(clone) is LocalBackend and clone.store.location == str(tmp_path / "c")


def test_every_put_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    backend.put("a/b", b"one")
    backend.put("a/b", b"two", atomic=False)  # atomic all the same
    assert (tmp_path / "a" / "b").read_bytes() == b"two"
    assert os.listdir(tmp_path / "a") == ["b"]


def test_list_walks_only_the_prefixs_directories(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LocalBackend(str(tmp_path))
    for key in ("step-1/x", "step-1/sub/y", "step-2/z", "other/deep/w", "step-10/v"):
        backend.put(key, b"1")
    scanned: list[str] = []
    real = os.scandir

    def scandir(path: Any) -> Any:
        scanned.append(os.path.relpath(path, tmp_path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert [o.key for o in backend.list("step-1/")] == ["step-1/sub/y", "step-1/x"]
    assert set(scanned) == {"step-1", "step-1/sub"}
    scanned.clear()
    assert [o.key for o in backend.list("step-1")] == ["step-1/sub/y", "step-1/x",
                                                       "step-10/v"]
    assert "other" not in scanned and "step-2" not in scanned


def test_location_that_is_a_file_is_not_a_directory_and_a_configuration_error(
    tmp_path: Path,
) -> None:
    target = tmp_path / "afile"
    target.write_text("x")
    backend = LocalBackend(str(target))
    for op in (lambda: backend.put("k", b"1"), lambda: backend.stat("k"),
               lambda: backend.open_upload("k")):
        with pytest.raises(NotADirectoryError, match="is a file, not a directory") as info:
            op()
        assert isinstance(info.value, dcpstore.errors.ConfigurationError)
        assert info.value.errno == errno.ENOTDIR


def test_missing_object_is_object_not_found(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    with pytest.raises(dcpstore.errors.ObjectNotFoundError, match="'nope'"):
        backend.get("nope")


def test_disk_full_stays_an_os_error_and_is_not_retried(tmp_path: Path) -> None:
    store = local.LocalStore(str(tmp_path))
    assert store.map_error(OSError(errno.ENOSPC, "No space left on device"), "k") is None
    assert store.map_error(OSError(errno.EDQUOT, "Disk quota exceeded"), "k") is None


def test_scheme_with_an_absolute_path_roots_a_path_based_store() -> None:
    from dcpstore.storage.uri import parse_uri

    parsed = parse_uri("sqlite:///var/data/ckpt.db?timeout=3")
    assert (parsed.scheme, parsed.location, parsed.query) == (
        "sqlite", "/var/data/ckpt.db", {"timeout": "3"})
    assert parse_uri("mystore://bucket/a/b").location == "bucket/a/b"
    for bad in ("mystore://", "mystore:///", "mystore:///a/../b"):
        with pytest.raises(dcpstore.errors.InvalidURIError):
            parse_uri(bad)


def test_head_of_a_file_deleted_meanwhile_is_never_called_a_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A HEAD racing a delete (another process's retention) sees the file or finds it
    missing; the file removed right after the stat must not come back as a directory."""
    backend = LocalBackend(str(tmp_path))
    backend.put("step-1/.metadata", b"m")
    store = backend.store
    real_stat = os.stat

    deleted: list[str] = []

    def stat_then_delete(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_stat(path, *args, **kwargs)
        if str(path).endswith(".metadata") and not deleted:
            deleted.append(str(path))
            os.unlink(path)  # the concurrent delete lands between the stat and any re-check
        return result

    monkeypatch.setattr(local.os, "stat", stat_then_delete)
    assert store.head("step-1/.metadata").size == 1
    with pytest.raises(FileNotFoundError):
        store.head("step-1/.metadata")
    (tmp_path / "step-2").mkdir()
    with pytest.raises(IsADirectoryError):
        store.head("step-2")
