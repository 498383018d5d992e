"""The MSC backend: MSC profiles on a local S3 server (moto) and on a local directory.

Runs the conformance suite through both profiles, the feature flag (plain ``s3://``,
``gs://`` and local paths routed through MSC exactly as MSC resolves them), interop
with MSC's own ``MultiStorageFileSystemWriter``/``Reader``, clear errors for bad
configuration and unreachable/forbidden/missing storage, a multi-process reshard, and
ranged reads fetched in ``read_chunk`` pieces straight into scatter buffers (request
counts and bytes on the wire through a counting proxy, on moto and SeaweedFS).
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import math
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore.errors import BucketNotFoundError
from dcpstore.storage.backend import ReadRange
from dcpstore.testing import (
    BackendConformance,
    HTTPEndpoint,
    assert_state_equal,
    many_dtypes_state,
)
from dcpstore.testing.faultproxy import FaultPlan, FaultProxy

msc = pytest.importorskip("multistorageclient")

from dcpstore_msc import (  # noqa: E402
    MSCBackend,
    MSCConfigError,
    ProfileNotFoundError,
    StorageNotFoundError,
)
from dcpstore_msc.config import _one_attempt  # noqa: E402

from dcpstore.testing.servers import S3Server, moto_server  # noqa: E402
from dcpstore.testing.stores import (  # noqa: E402
    RunningStore,
    msc_store_profile,
    write_msc_config,
)

BUCKET = "dcpstore-msc"
S3_PROFILE = "dcpstore-s3"
LOCAL_PROFILE = "dcpstore-local"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MSCEnv(RunningStore):
    """This module's MSC store: profile :data:`S3_PROFILE` over moto's bucket
    :data:`BUCKET`, whose configuration (:attr:`msc_config`, in :attr:`env` as
    ``MSC_CONFIG``) also holds a POSIX profile, a missing bucket, an unreachable
    endpoint and path mappings.

    Attributes:
        local_dir: Directory of the POSIX profile :data:`LOCAL_PROFILE`.
        config: The MSC configuration written to :attr:`msc_config`.
    """

    local_dir: Path
    config: dict[str, Any]

    @classmethod
    def write(cls, s3: S3Server, root: Path) -> MSCEnv:
        """Write the configuration under ``root`` for the profiles over ``s3``."""
        local_dir = root / "local-profile"
        local_dir.mkdir()
        config: dict[str, Any] = {
            "profiles": {
                S3_PROFILE: msc_store_profile(s3, BUCKET),
                LOCAL_PROFILE: {"storage_provider": {
                    "type": "file", "options": {"base_path": str(local_dir)}}},
                "no-bucket": msc_store_profile(s3, "no-such-bucket-msc"),
                "unreachable": msc_store_profile(s3, BUCKET, endpoint="http://127.0.0.1:9"),
            },
            "path_mapping": {
                f"s3://{BUCKET}-mapped/": f"msc://{S3_PROFILE}/",
                "gs://pretend-gcs-bucket/": f"msc://{LOCAL_PROFILE}/",
            },
        }
        path = write_msc_config(root / "msc_config.yaml", config)
        return cls("msc", f"msc://{S3_PROFILE}", {}, {"MSC_CONFIG": path}, s3,
                   s3.endpoint_url, bucket=BUCKET, region=s3.region, msc_config=path,
                   local_dir=local_dir, config=config)


@pytest.fixture(scope="module")
def msc_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MSCEnv]:
    with moto_server() as s3, pytest.MonkeyPatch.context() as mp:
        s3.create_bucket(BUCKET)
        env = MSCEnv.write(s3, tmp_path_factory.mktemp("msc"))
        for name, value in env.env.items():
            mp.setenv(name, value)
        mp.delenv("DCPSTORE_BACKEND", raising=False)
        yield env


def fresh(prefix: str = "ckpt") -> str:
    return f"{prefix}/{uuid.uuid4().hex[:12]}"


class TestMSCOnS3(BackendConformance):
    """msc://<profile on moto S3>/..., config found through MSC_CONFIG."""

    @pytest.fixture
    def checkpoint_uri(self, msc_env: MSCEnv) -> str:
        return f"msc://{S3_PROFILE}/{fresh()}"

    @pytest.fixture
    def backend_options(self, msc_env: MSCEnv) -> dict[str, Any]:
        return {"part_size": 64 * 1024}  # larger objects take the spool + upload_file path

    @pytest.fixture
    def missing_bucket_uri(self, msc_env: MSCEnv) -> str:
        return f"msc://no-bucket/{fresh()}"

    @pytest.fixture
    def denied_backend_options(self, msc_env: MSCEnv, forbidden_endpoint: str
                               ) -> dict[str, Any]:
        return {"part_size": 64 * 1024, **msc_env.via(forbidden_endpoint).options}

    @pytest.fixture
    def http_endpoint(self, msc_env: MSCEnv) -> HTTPEndpoint:
        return HTTPEndpoint(str(msc_env.upstream), lambda url: msc_env.via(url).options)


class TestMSCOnLocalDirectory(BackendConformance):
    """msc://<POSIX profile>/..., config passed as a dict option."""

    @pytest.fixture
    def checkpoint_uri(self, msc_env: MSCEnv) -> str:
        return f"msc://{LOCAL_PROFILE}/{fresh()}"

    @pytest.fixture
    def backend_options(self, msc_env: MSCEnv) -> dict[str, Any]:
        return {"config": msc_env.config, "fsync": False}


# -- feature flag: plain URIs resolved as MSC resolves them ---------------------------------


def test_feature_flag_resolves_like_msc(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    state = {"w": torch.randn(16, 4), "step": 3}
    s3_url = f"s3://{BUCKET}-mapped/{fresh('flag')}"  # path_mapping -> the S3 profile
    gs_url = f"gs://pretend-gcs-bucket/{fresh('flag')}"  # path_mapping -> the local profile
    local = str(tmp_path / "plain")  # MSC's implicit __filesystem__ profile
    for url in (s3_url, gs_url, local):
        writer = dcpstore.get_writer(url, backend="msc")
        assert isinstance(writer.backend, MSCBackend)
        client, path = msc.resolve_storage_client(url)
        store = writer.backend.store
        assert (store.profile, store.root) == (client.profile, path.rstrip("/"))
        dcp.save(state, storage_writer=writer)
        out = {"w": torch.zeros(16, 4), "step": 0}
        dcpstore.load(out, url, backend="msc")
        assert_state_equal(out, state)
    # the bytes really are where MSC maps them
    s3 = msc_env.server.client()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=s3_url.split("/", 3)[3] + "/")
    assert any(o["Key"].endswith("/.metadata") for o in listed.get("Contents", []))
    assert (msc_env.local_dir / gs_url.split("/", 3)[3] / ".metadata").is_file()
    assert (Path(local) / ".metadata").is_file()
    # the environment flag does the same; explicit backend= beats it
    monkeypatch.setenv("DCPSTORE_BACKEND", "msc")
    assert isinstance(dcpstore.open_backend(s3_url), MSCBackend)
    assert type(dcpstore.open_backend(local, backend="file")).__name__ == "LocalBackend"


def test_config_option_path_and_dict(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MSC_CONFIG")
    url = f"s3://{BUCKET}-mapped/{fresh('opt')}"
    be = dcpstore.open_backend(url, backend="msc", config=str(msc_env.msc_config))
    assert (be.store.profile, be.store.root) == (S3_PROFILE, url.split("/", 3)[3])
    be.put("x", b"1")
    monkeypatch.setenv("DCPSTORE_MSC_CONFIG", str(msc_env.msc_config))
    assert dcpstore.open_backend(f"msc://{S3_PROFILE}/{be.store.root}").get("x") == b"1"


# -- interop with MSC's own DCP integration -------------------------------------------------


def test_interop_with_msc_filesystem_writer_and_reader(msc_env: MSCEnv) -> None:
    from multistorageclient.contrib.torch import (
        MultiStorageFileSystemReader,
        MultiStorageFileSystemWriter,
    )

    state = many_dtypes_state(seed=3)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    theirs = f"msc://{S3_PROFILE}/{fresh('interop-msc')}"
    dcp.save(tensors, storage_writer=MultiStorageFileSystemWriter(theirs), no_dist=True)
    out = {k: torch.zeros_like(v.contiguous()) for k, v in tensors.items()}
    dcpstore.load(out, theirs)
    assert_state_equal(out, tensors)

    ours = f"msc://{S3_PROFILE}/{fresh('interop-dcpstore')}"
    dcpstore.save(tensors, ours)
    back = {k: torch.zeros_like(v.contiguous()) for k, v in tensors.items()}
    dcp.load(back, storage_reader=MultiStorageFileSystemReader(ours), no_dist=True)
    assert_state_equal(back, tensors)


# -- bad input ------------------------------------------------------------------------------


def test_unknown_profile_lists_known_ones(msc_env: MSCEnv) -> None:
    with pytest.raises(ProfileNotFoundError, match=rf"'nope'.*msc_config.yaml.*{S3_PROFILE}"):
        dcpstore.get_writer("msc://nope/run")
    with pytest.raises(ProfileNotFoundError, match=LOCAL_PROFILE):
        dcpstore.get_reader("msc://nope/run", config=msc_env.config)
    assert issubclass(ProfileNotFoundError, LookupError)


def test_missing_config(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch,
                        tmp_path: Path) -> None:
    for var in ("MSC_CONFIG", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    with pytest.raises(MSCConfigError, match="no MSC configuration found.*MSC_CONFIG"):
        dcpstore.get_writer(f"msc://{S3_PROFILE}/run")
    with pytest.raises(MSCConfigError, match="does not exist"):
        dcpstore.get_writer(f"msc://{S3_PROFILE}/run", config=str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "broken.yaml"))
    (tmp_path / "broken.yaml").write_text("profiles: {x: {storage_provider: 7}}\n")
    with pytest.raises(MSCConfigError, match="invalid MSC configuration"):
        dcpstore.get_writer("msc://x/run")


def test_missing_bucket_commits_nothing(msc_env: MSCEnv) -> None:
    with pytest.raises(BucketNotFoundError, match="does not exist"):
        dcpstore.save({"w": torch.ones(4)}, "msc://no-bucket/run")
    with pytest.raises(BucketNotFoundError):
        dcpstore.load({"w": torch.ones(4)}, "msc://no-bucket/run")
    assert not isinstance(BucketNotFoundError("x"), FileNotFoundError)
    assert StorageNotFoundError is BucketNotFoundError  # the old name still imports


def test_unreachable_endpoint_fails_fast(msc_env: MSCEnv) -> None:
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot reach the storage.*'unreachable'"):
        dcpstore.save({"w": torch.ones(4)}, "msc://unreachable/run")
    assert time.monotonic() - started < 20


class _Forbidden(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that refuses everything, with a request id."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                b"<Message>Access Denied</Message><RequestId>req-5678</RequestId></Error>")
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", "req-5678")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def forbidden_endpoint() -> Iterator[str]:
    """An S3 endpoint on 127.0.0.1 that refuses every request (403 with a request id)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidden)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_permission_denied_keeps_request_id(msc_env: MSCEnv, forbidden_endpoint: str) -> None:
    config = {"profiles": {"forbidden": msc_store_profile(msc_env.server, BUCKET,
                                                          endpoint=forbidden_endpoint)}}
    with pytest.raises(PermissionError, match=r"permission denied.*req-5678"):
        dcpstore.save({"w": torch.ones(4)}, "msc://forbidden/run", config=config)
    be = dcpstore.open_backend("msc://forbidden/run", config=config)
    with pytest.raises(PermissionError, match="forbidden"):
        be.stat("x")


# -- multi-process ----------------------------------------------------------------------------


def _bad_input_on_every_rank(rank: int, world_size: int) -> list[str]:
    names = []
    for uri in ("msc://nope/run", "msc://no-bucket/run"):
        try:
            dcpstore.save({"w": torch.full((4,), float(rank))}, uri)
        except Exception as exc:
            names.append(type(exc).__name__)
    return names


@pytest.mark.multiprocess
def test_fsdp2_reshard_2_to_1_and_errors_on_every_rank(msc_env: MSCEnv) -> None:
    from fsdp_workers import load_fsdp, save_fsdp
    from mp import run_ranks

    uri = f"msc://{S3_PROFILE}/{fresh('fsdp')}/step-2"
    options = {"part_size": 256 * 1024}
    saved = run_ranks(save_fsdp, 2, uri, options)[0]
    loaded = run_ranks(load_fsdp, 1, uri, options)[0]
    assert_state_equal(loaded["model"], saved["model"])
    assert_state_equal(loaded["optim"], saved["optim"])
    names = run_ranks(_bad_input_on_every_rank, 2)
    assert names == [["ProfileNotFoundError", "BucketNotFoundError"]] * 2


@pytest.mark.multiprocess
def test_reshard_matrix_msc(msc_env: MSCEnv) -> None:
    """Save at 1, 2, 4 ranks, load at 1, 2, 3, 4 through the S3 profile."""
    from reshard_workers import run_matrix

    run_matrix(f"msc://{S3_PROFILE}/{fresh('matrix')}", {})


# -- chunked ranged reads (bounded memory per range in flight) -------------------------------

CHUNK = 64 * 1024
#: Scatter pieces of one range: an item head, an empty piece, payloads that straddle chunk
#: boundaries, one byte, and a tail (12 * CHUNK + 2_500 bytes in all).
PIECES = (3, 0, 5 * CHUNK + 17, 1, 2 * CHUNK - 21, 5 * CHUNK, 2_500)


def _payload(n: int, seed: int) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_store(request: pytest.FixtureRequest, msc_env: MSCEnv) -> tuple[S3Server, str]:
    """An S3 server and a bucket on it: moto (this module's) or SeaweedFS (the session's)."""
    if request.param == "moto":
        return msc_env.server, BUCKET
    return request.getfixturevalue("seaweedfs_s3"), "dcpstore-test"


def _counting_backend(s3: S3Server, bucket: str, proxy: FaultProxy, **options: Any
                      ) -> MSCBackend:
    config = {"profiles": {"counted": msc_store_profile(s3, bucket,
                                                        endpoint=proxy.endpoint_url)}}
    be = dcpstore.open_backend(f"msc://counted/{fresh('chunks')}", config=config, **options)
    assert isinstance(be, MSCBackend)
    return be


@pytest.mark.parametrize("read_chunk", [CHUNK, 3 * CHUNK + 1, 64 * 1024 * 1024])
def test_range_is_read_in_chunks_straight_into_scatter_pieces(
        s3_store: tuple[S3Server, str], read_chunk: int) -> None:
    """A range longer than read_chunk, spread over several pieces, comes back byte-exact
    from ceil(L / read_chunk) GETs on the wire, and not one byte more is downloaded."""
    s3, bucket = s3_store
    data = _payload(16 * CHUNK, seed=11)
    with FaultProxy(s3.endpoint_url) as proxy:
        be = _counting_backend(s3, bucket, proxy, read_chunk=read_chunk, max_concurrency=4)
        be.put("obj", data)
        offset, length = 3 * CHUNK - 7, sum(PIECES)
        bufs = [memoryview(bytearray(n)) for n in PIECES]
        proxy.reset_stats()
        done = list(be.read_ranges([ReadRange("obj", offset, length)], [bufs]))
        assert [i for i, _ in done] == [0]
        assert b"".join(bytes(b) for b in bufs) == data[offset:offset + length]
        stats = proxy.snapshot()
        assert dict(stats.requests) == {"GET": math.ceil(length / read_chunk)}
        assert stats.bytes_down == length

        # single-buffer ranges and several ranges in flight: each one chunked on its own
        ranges = [ReadRange("obj", 0, 16 * CHUNK), ReadRange("obj", 5, 2 * CHUNK),
                  ReadRange("obj", 7 * CHUNK, 1)]
        outs = [memoryview(bytearray(r.length)) for r in ranges]
        proxy.reset_stats()
        assert sorted(i for i, _ in be.read_ranges(ranges, outs)) == [0, 1, 2]
        for r, out in zip(ranges, outs, strict=True):
            assert bytes(out) == data[r.offset:r.offset + r.length]
        stats = proxy.snapshot()
        assert stats.requests["GET"] == sum(math.ceil(r.length / read_chunk) for r in ranges)
        assert stats.bytes_down == sum(r.length for r in ranges)
        be.close()


def test_chunked_read_allocates_about_one_chunk_not_the_range(seaweedfs_s3: S3Server
                                                              ) -> None:
    """The transient memory of one range is bounded by read_chunk, not by its length
    (tracemalloc counts what this process allocates: SeaweedFS runs in its own, unlike
    moto, which reads the whole object for every ranged GET)."""
    config = {"profiles": {"weed": msc_store_profile(seaweedfs_s3, "dcpstore-test")}}
    be = dcpstore.open_backend(f"msc://weed/{fresh('chunk-mem')}", config=config,
                               read_chunk=CHUNK)
    length = 64 * CHUNK  # 4 MiB, 64 requests
    data = _payload(length, seed=12)
    be.put("obj", data)
    bufs = [memoryview(bytearray(n)) for n in (10, length - 20, 10)]
    list(be.read_ranges([ReadRange("obj", 0, CHUNK)]))  # warm the client up
    tracemalloc.start()
    try:
        list(be.read_ranges([ReadRange("obj", 0, length)], [bufs]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert b"".join(bytes(b) for b in bufs) == data
    # a whole-range response alone would be `length`; staging it again, twice that
    assert peak < length // 4, f"peak {peak} bytes for a {length}-byte range"


@pytest.mark.parametrize(("stored", "ends"), [
    (5 * CHUNK + 123, "ends at byte"),  # a chunk comes back short
    (5 * CHUNK + CHUNK // 2, "ends before byte"),  # a chunk starts at the end: HTTP 416
])
def test_truncated_object_is_eoferror(s3_store: tuple[S3Server, str], stored: int,
                                      ends: str) -> None:
    """The object is shorter than the range: an EOFError naming the object, where it
    ends, the offset and the expected size; through read_ranges an OSError carrying the
    same message. Nothing is requested after the chunk that found the end."""
    s3, bucket = s3_store
    data = _payload(8 * CHUNK, seed=13)
    with FaultProxy(s3.endpoint_url) as proxy:
        be = _counting_backend(s3, bucket, proxy, read_chunk=CHUNK)
        be.put("obj", data)
        # truncate it behind dcpstore's back
        s3.client().put_object(Bucket=bucket, Key=f"{be.store.root}/obj", Body=data[:stored])
        offset, length = CHUNK // 2, 7 * CHUNK  # chunks start at offset + k * CHUNK
        bufs = [memoryview(bytearray(n)) for n in (100, length - 200, 100)]
        message = (rf"counted/.*/obj {ends} {stored}, expected {length} bytes from offset "
                   rf"{offset} \(object truncated\?\)")
        proxy.reset_stats()
        with pytest.raises(EOFError, match=message):
            be._read_into("obj", offset, bufs)
        # the full chunks before the end, then the one that found it
        assert proxy.snapshot().requests["GET"] == (stored - offset) // CHUNK + 1
        with pytest.raises(OSError, match=message) as info:
            list(be.read_ranges([ReadRange("obj", offset, length)], [bufs]))
        assert isinstance(info.value.__cause__, EOFError)
        be.close()


def test_posix_profile_reads_with_preadv(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """POSIX profiles read straight into the pieces (no MSC read, so no chunking), and a
    short file is an EOFError there too."""
    be = dcpstore.open_backend(f"msc://{LOCAL_PROFILE}/{fresh('posix-read')}",
                               config=msc_env.config, fsync=False, read_chunk=CHUNK)
    assert isinstance(be, MSCBackend)
    data = _payload(16 * CHUNK, seed=14)
    be.put("obj", data)
    calls: list[Any] = []
    client = be.client
    real_read = client.read
    monkeypatch.setattr(client, "read", lambda *a, **k: calls.append(a) or real_read(*a, **k))
    offset = 3 * CHUNK - 7
    bufs = [memoryview(bytearray(n)) for n in PIECES]
    list(be.read_ranges([ReadRange("obj", offset, sum(PIECES))], [bufs]))
    assert b"".join(bytes(b) for b in bufs) == data[offset:offset + sum(PIECES)]
    assert calls == []
    with pytest.raises(EOFError, match=rf"/obj ends at byte {16 * CHUNK}, expected"):
        be._read_into("obj", 15 * CHUNK, [memoryview(bytearray(2 * CHUNK))])


def test_read_chunk_option(msc_env: MSCEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"msc://{S3_PROFILE}/{fresh('opt')}"
    # the default is the reader's largest range: each range the reader asks for is one GET
    assert dcpstore.open_backend(uri).options.read_chunk == dcpstore.ReaderOptions().max_range
    assert dcpstore.open_backend(uri + "?read_chunk=1MiB").options.read_chunk == 1 << 20
    monkeypatch.setenv("DCPSTORE_MSC_READ_CHUNK", "256k")
    assert dcpstore.open_backend(uri).options.read_chunk == 256 * 1024
    for bad in (0, -1):
        with pytest.raises(ValueError, match="read_chunk must be > 0"):
            dcpstore.open_backend(uri, read_chunk=bad)


def test_retries_are_dcpstores_alone(s3_store: tuple[S3Server, str]) -> None:
    """MSC's own retry layer and botocore's inside its S3 provider are set to one attempt:
    a store that answers 503 to every PUT sees exactly ``max_attempts`` requests (not
    ``max_attempts x`` MSC's attempts ``x`` botocore's), then the failure kind."""
    s3, bucket = s3_store
    plan = FaultPlan(rate=1.0, kinds=("503",), match=lambda info: info.method == "PUT")
    with FaultProxy(s3.endpoint_url, plan) as proxy:
        be = _counting_backend(s3, bucket, proxy, max_attempts=4, retry_backoff=0.01)
        proxy.reset_stats()
        with pytest.raises(OSError):
            be.put("obj", b"x" * 100)
        assert proxy.snapshot().requests["PUT"] == 4
        be.close()


def test_profile_retries_are_overridden_and_said_so(s3_store: tuple[S3Server, str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A profile that sets MSC's ``retry`` attempts and botocore's ``retries`` itself gets
    one attempt of each too (dcpstore's ``max_attempts`` is the one retry policy), and the
    plugin says so, naming the profile, what it set and the option that counts."""
    s3, bucket = s3_store
    plan = FaultPlan(rate=1.0, kinds=("503",), match=lambda info: info.method == "PUT")
    with FaultProxy(s3.endpoint_url, plan) as proxy:
        config = {"profiles": {"explicit": msc_store_profile(
            s3, bucket, endpoint=proxy.endpoint_url, retry_attempts=5)}}
        with caplog.at_level(logging.INFO, logger="dcpstore_msc"):
            be = dcpstore.open_backend(f"msc://explicit/{fresh('retries')}", config=config,
                                       max_attempts=3, retry_backoff=0.01)
        said = [r.getMessage() for r in caplog.records if r.name.startswith("dcpstore_msc")]
        assert len(said) == 1, said
        assert "'explicit'" in said[0] and "retry attempts 5" in said[0], said[0]
        assert "retries {'max_attempts': 2}" in said[0] and "max_attempts" in said[0]
        proxy.reset_stats()
        with pytest.raises(OSError):
            be.put("obj", b"x" * 100)
        assert proxy.snapshot().requests["PUT"] == 3
        be.close()


def test_azure_sdk_retries_are_set_to_one_attempt() -> None:
    """An MSC ``azure`` profile: the Azure SDK's own retries (``retry_total``, 3 by default
    in azure-core) are set to none as well, as botocore's are for S3-type providers; what
    the profile set itself is reported. (The config MSC gets: MSC's azure provider needs
    ``azure-identity``, which the test environment does not install, so no requests are
    counted here.)"""
    config: dict[str, Any] = {"profiles": {"blob": {
        "retry": {"attempts": 4, "delay": 0.5},
        "storage_provider": {"type": "azure", "options": {
            "endpoint_url": "https://acct.blob.core.windows.net", "base_path": "c",
            "retry_total": 5, "retry_read": 2, "read_timeout": 30}},
    }, "other": {"storage_provider": {"type": "azure", "options": {"base_path": "d"}}}}}
    merged, overridden = _one_attempt(config, "blob")
    assert merged["profiles"]["blob"] == {
        "retry": {"attempts": 1, "delay": 0.5},
        "storage_provider": {"type": "azure", "options": {
            "endpoint_url": "https://acct.blob.core.windows.net", "base_path": "c",
            "retry_total": 0, "read_timeout": 30}},
    }
    assert overridden == ["retry attempts 4", "retry_total 5", "retry_read 2"]
    assert merged["profiles"]["other"] == config["profiles"]["other"]  # only the one used
    assert config["profiles"]["blob"]["retry"]["attempts"] == 4  # the caller's untouched
    merged, overridden = _one_attempt(config, "other")
    assert merged["profiles"]["other"]["storage_provider"]["options"]["retry_total"] == 0
    assert overridden == []
