"""The commit protocol on an in-memory store with injected faults (no HTTP, no server).

``MemoryBackend`` holds the objects; ``FaultBackend`` fails chosen primitive calls the way
a store client would (throttling, timeouts, resets, truncated reads, a crash). Each test
checks what is left in the store afterwards: nothing of a failed save, the previous
checkpoint intact, an ambiguous ``.metadata`` PUT resolved by reading it back.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from stores import memory_scheme
from torch.distributed.checkpoint.api import CheckpointException

import dcpstore
from dcpstore.dcp import layout
from dcpstore.errors import BucketNotFoundError, StoreThrottledError
from dcpstore.testing import BackendConformance, MemoryBackend, assert_state_equal
from dcpstore.testing.faults import Fault, FaultBackend, SimulatedCrash
from dcpstore.tools import ops

BUCKET = "commit-protocol"
#: Fast retries: the faults are injected, nothing needs time to recover.
FAST: dict[str, Any] = {"retry_backoff": 0.001, "retry_backoff_max": 0.002}


@pytest.fixture(scope="module", autouse=True)
def _memory_scheme() -> Iterator[None]:
    yield from memory_scheme(BUCKET)


@pytest.fixture
def uri() -> str:
    return f"memory://{BUCKET}/{uuid.uuid4().hex[:12]}/step-1"


def faulty(uri: str, faults: Iterable[Fault]) -> tuple[str, type[FaultBackend]]:
    """``uri`` on the ``faulty://`` scheme: the same memory objects, behind ``faults``."""
    cls = FaultBackend.wrapping(MemoryBackend, faults)
    dcpstore.register_backend("faulty", cls, clobber=True)
    return "faulty://" + uri.removeprefix("memory://"), cls


def state(value: float) -> dict[str, Any]:
    return {"a": torch.full((64, 32), float(value)), "b": torch.arange(1000) + int(value),
            "o": {"step": int(value)}}


def blank() -> dict[str, Any]:
    return {"a": torch.zeros(64, 32), "b": torch.zeros(1000, dtype=torch.int64),
            "o": {"step": -1}}


def load(uri: str) -> dict[str, Any]:
    out = blank()
    dcpstore.load(out, uri)
    return out


def keys(uri: str) -> set[str]:
    return {o.key for o in dcpstore.open_backend(uri).list()}


def uploads(uri: str) -> list[tuple[str, str]]:
    return dcpstore.open_backend(uri).list_uploads()


# -- the memory backend itself -------------------------------------------------------------


class TestMemoryBackend(BackendConformance):
    """MemoryBackend passes the suite every backend passes."""

    @pytest.fixture
    def checkpoint_uri(self, uri: str) -> str:
        return uri

    @pytest.fixture
    def backend_options(self) -> dict[str, Any]:
        return {"part_size": 64 * 1024}

    @pytest.fixture
    def missing_bucket_uri(self) -> str:
        return f"memory://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpt"


def test_memory_backend_counts_requests_and_pickles(uri: str) -> None:
    backend = dcpstore.open_backend(uri)
    MemoryBackend.reset_requests(BUCKET)
    backend.put("k", b"v")
    clone = pickle.loads(pickle.dumps(backend))
    assert clone.get("k") == b"v"
    assert MemoryBackend.requests(BUCKET) == {"put": 1, "get": 1}
    up = backend.open_upload("u")
    up.write(b"x")
    assert backend.list_uploads() == [("u", up.upload_id)]  # type: ignore[attr-defined]
    backend.abort_uploads(backend.list_uploads())
    assert backend.list_uploads() == [] and not backend.exists("u")
    with pytest.raises(BucketNotFoundError, match="create_bucket"):
        dcpstore.open_backend("memory://absent/x").get("k")


# -- failures before the commit point --------------------------------------------------------


def test_failed_upload_commits_nothing_and_removes_this_saves_files(uri: str) -> None:
    dcpstore.save(state(1), uri)
    before = keys(uri)
    target, cls = faulty(uri, [Fault("commit", nth=2, error=PermissionError("denied"))])
    with pytest.raises(PermissionError, match="denied"):
        dcpstore.save(state(2), target, overwrite=True, files_per_rank=2)
    assert sum(f.injected for f in cls.shared.faults) == 1
    assert keys(uri) == before, "files of the failed save were left behind"
    assert uploads(uri) == []
    assert_state_equal(load(uri), state(1))


def test_failed_first_save_leaves_nothing(uri: str) -> None:
    target, _ = faulty(uri, [Fault("write", nth=1, error=OSError("disk on fire"))])
    with pytest.raises(OSError, match="disk on fire"):
        dcpstore.save(state(1), target)
    assert keys(uri) == set() and uploads(uri) == []
    with pytest.raises(dcpstore.CheckpointNotFoundError):
        load(uri)


def test_failed_metadata_put_keeps_previous_checkpoint(uri: str) -> None:
    dcpstore.save(state(1), uri)
    before = keys(uri)
    target, _ = faulty(uri, [Fault("put", key=layout.METADATA_KEY,
                                   error=PermissionError("metadata refused"))])
    with pytest.raises(PermissionError, match="metadata refused"):
        dcpstore.save(state(2), target, overwrite=True)
    assert keys(uri) == before
    assert_state_equal(load(uri), state(1))
    assert ops.verify_checkpoint(uri).ok


# -- the ambiguous commit ---------------------------------------------------------------------


def test_metadata_put_that_landed_is_read_back_as_committed(
        uri: str, caplog: pytest.LogCaptureFixture) -> None:
    dcpstore.save(state(1), uri)
    old = keys(uri)
    # every .metadata PUT lands, and every answer is lost
    target, _ = faulty(uri, [Fault("put", key=layout.METADATA_KEY, error="connection",
                                   after=True, times=0)])
    dcpstore.save(state(2), target, overwrite=True, max_attempts=3, **FAST)
    assert "holds this save's .metadata: committed" in caplog.text
    assert_state_equal(load(uri), state(2))
    new = keys(uri)
    assert not (old & new) - {layout.METADATA_KEY}, "stale files of the old save remain"
    assert ops.verify_checkpoint(uri).ok


def test_metadata_put_that_cannot_be_read_back_keeps_files(uri: str) -> None:
    dcpstore.save(state(1), uri)
    old = keys(uri)
    target, cls = faulty(uri, [
        Fault("put", key=layout.METADATA_KEY, error="connection", after=True, times=0),
        # the overwrite check reads .metadata twice (on a store with conditional
        # writes: its bytes, its version, its bytes again); every later read fails
        Fault("get", key=layout.METADATA_KEY, nth=3, error="connection", times=0),
    ])
    with pytest.raises(ConnectionError):
        dcpstore.save(state(2), target, overwrite=True, max_attempts=2, **FAST)
    # the PUT did land: the new checkpoint is whole; whether it had could not be told,
    # so nothing was deleted (neither its files nor the old save's)
    assert_state_equal(load(uri), state(2))
    now = keys(uri)
    assert old <= now
    assert any(k.endswith(".distcp") for k in now - old) and any(
        k.startswith(".dcpstore-") for k in now - old)
    assert ops.verify_checkpoint(uri).ok
    assert sum(f.injected for f in cls.shared.faults if f.op == "get") >= 1


def test_crash_before_commit_leaves_old_checkpoint_and_orphans_gc_removes(uri: str) -> None:
    dcpstore.save(state(1), uri)
    before = keys(uri)
    target, cls = faulty(uri, [Fault("put", key=layout.METADATA_KEY, error="crash")])
    with pytest.raises((SimulatedCrash, CheckpointException)):
        dcpstore.save(state(2), target, overwrite=True)
    assert cls.shared.crashed
    orphans = keys(uri) - before
    assert orphans and all(layout.save_id_of(k) or k.startswith(".dcpstore-")
                           for k in orphans), orphans
    assert_state_equal(load(uri), state(1))
    root = uri.rsplit("/", 1)[0]
    ops.gc(root, min_age=0)
    assert keys(uri) == before
    assert_state_equal(load(uri), state(1))


# -- retries -----------------------------------------------------------------------------------


def test_throttling_is_retried_then_succeeds(uri: str) -> None:
    target, cls = faulty(uri, [
        Fault("put", key=layout.METADATA_KEY, error="throttle", times=2),
        Fault("open_upload", error="timeout", times=1),
        Fault("read", error="throttle", times=2),
        Fault("get", key=".dcpstore-*", error="connection", times=1),
    ])
    dcpstore.save(state(3), target, max_attempts=4, **FAST)
    assert_state_equal(load(target), state(3))
    assert [f.injected for f in cls.shared.faults] == [2, 1, 2, 1]
    assert cls.shared.calls["put"] >= 4  # manifest + 3 tries of .metadata


def test_exhausted_throttling_is_a_clear_error_and_commits_nothing(uri: str) -> None:
    target, _ = faulty(uri, [Fault("put", key=layout.METADATA_KEY, error="throttle",
                                   times=0)])
    with pytest.raises(StoreThrottledError, match="SlowDown"):
        dcpstore.save(state(1), target, max_attempts=2, **FAST)
    assert keys(uri) == set() and uploads(uri) == []


def test_truncated_reads_are_retried_never_short(uri: str) -> None:
    dcpstore.save(state(4), uri, files_per_rank=2)
    target, cls = faulty(uri, [Fault("read", error="truncate", times=3)])
    out = blank()
    dcpstore.load(out, target, max_attempts=5, **FAST)
    assert_state_equal(out, state(4))
    assert cls.shared.faults[0].injected == 3


# -- request counts ---------------------------------------------------------------------------


@pytest.mark.parametrize("files_per_rank", [1, 2])
def test_requests_per_save_and_load(uri: str, files_per_rank: int) -> None:
    MemoryBackend.reset_requests(BUCKET)
    dcpstore.save(state(5), uri, files_per_rank=files_per_rank, part_size=8 * 1024)
    saved = MemoryBackend.requests(BUCKET)
    assert saved["create_upload"] == saved["complete_upload"] == files_per_rank
    assert saved["put"] == 2  # manifest, then .metadata: the commit point
    assert saved["get"] <= 1  # the overwrite check
    assert saved["abort_upload"] == 0 and saved["range_get"] == 0
    assert saved["upload_part"] >= (64 * 32 * 4 + 1000 * 8) // (8 * 1024)
    MemoryBackend.reset_requests(BUCKET)
    assert_state_equal(load(uri), state(5))
    loaded = MemoryBackend.requests(BUCKET)
    assert loaded["put"] == loaded["create_upload"] == loaded["delete"] == 0
    assert loaded["get"] == 2  # .metadata and the manifest
    assert 1 <= loaded["range_get"] <= 2 * files_per_rank


def test_retention_that_fails_leaves_the_save_committed(
        uri: str, caplog: pytest.LogCaptureFixture) -> None:
    """Retention runs after the commit: a store refusing its deletes is a warning, the new
    step stands, and the next save's retention catches up."""
    root, cls = faulty(uri.removesuffix("/step-1"), [])
    ckpt = dcpstore.Checkpointer(root, keep_last=1)
    ckpt.save(1, state(1))
    cls.shared.faults.append(Fault("delete", times=0, error=PermissionError("denied")))
    with caplog.at_level("WARNING", logger="dcpstore.training.checkpointer"):
        ckpt.save(2, state(2))
    assert "retention under" in caplog.text and "denied" in caplog.text
    assert [int(s) for s in ckpt.steps()] == [1, 2]
    cls.shared.faults.clear()
    ckpt.save(3, state(3))
    assert [int(s) for s in ckpt.steps()] == [3]
    out = blank()
    ckpt.load(out)
    assert out["o"]["step"] == 3
    ckpt.close()
