"""The S3 backend against real S3 servers on 127.0.0.1 (moto and SeaweedFS)."""

from __future__ import annotations

import contextlib
import errno
import http.server
import io
import logging
import os
import pickle
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore
import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from botocore.exceptions import ClientError, ReadTimeoutError
from dcpstore_s3 import S3Backend, S3Options, S3Store, _zerocopy
from dcpstore_s3.keys import hashed_key, is_data_file, logical_key
from stores import S3_TEST_BUCKET, use_s3_server
from test_multipart import _odd_writes

import dcpstore
import dcpstore.dcp.api
import dcpstore.dcp.data_file
from dcpstore.storage import registry
from dcpstore.storage.backend import ReadRange
from dcpstore.storage.multipart import PartBuffers
from dcpstore.storage.store_backend import StoreUpload
from dcpstore.testing import BackendConformance, HTTPEndpoint
from dcpstore.testing.servers import S3Server, free_port


class _S3Conformance(BackendConformance):
    server_fixture = "moto_s3"

    @pytest.fixture
    def server(self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
               ) -> S3Server:
        return use_s3_server(request.getfixturevalue(self.server_fixture), monkeypatch)

    @pytest.fixture
    def checkpoint_uri(self, server: S3Server) -> str:
        return f"s3://{S3_TEST_BUCKET}/conformance/{uuid.uuid4().hex}"

    @pytest.fixture
    def backend_options(self, server: S3Server) -> dict[str, Any]:
        return {"endpoint_url": server.endpoint_url, "part_size": 5 * 1024 * 1024}

    @pytest.fixture
    def missing_bucket_uri(self, server: S3Server) -> str:
        return f"s3://dcpstore-no-such-bucket-{uuid.uuid4().hex[:8]}/conformance"

    @pytest.fixture
    def http_endpoint(self, server: S3Server) -> HTTPEndpoint:
        return HTTPEndpoint(server.endpoint_url, lambda url: {"endpoint_url": url})

    @pytest.fixture
    def store_faults(self) -> dict[str, BaseException]:
        def error(status: int, code: str) -> ClientError:
            return ClientError({"Error": {"Code": code, "Message": "scripted"},
                                "ResponseMetadata": {"HTTPStatusCode": status,
                                                     "RequestId": "req-1"}}, "GetObject")

        return {
            "throttled": error(503, "SlowDown"),
            "timeout": ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
            "unavailable": error(500, "InternalError"),
            "denied": error(403, "AccessDenied"),
            "not_found": error(404, "NoSuchKey"),
            "missing_bucket": error(404, "NoSuchBucket"),
            "too_large": error(400, "EntityTooLarge"),
            "precondition": error(412, "PreconditionFailed"),
        }


class TestMotoConformance(_S3Conformance):
    server_fixture = "moto_s3"


class TestSeaweedFSConformance(_S3Conformance):
    server_fixture = "seaweedfs_s3"

    @pytest.fixture
    def denied_backend_options(self, server: S3Server, backend_options: dict[str, Any],
                               monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        use_s3_server(server, monkeypatch, readonly=True)  # SeaweedFS's read-only identity
        return backend_options


# -- helpers ---------------------------------------------------------------------------

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _isolated_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here may see the developer's AWS configuration or reach a real cloud."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "DCPSTORE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unit-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unit-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")




def _uri(tag: str = "t") -> str:
    return f"s3://{S3_TEST_BUCKET}/{tag}/{uuid.uuid4().hex[:12]}"


def _opts(server: S3Server, **extra: Any) -> dict[str, Any]:
    # small parts, and objects past one part are multipart uploads (the default
    # multipart_threshold, 16 MiB, would store these tests' objects in one PutObject;
    # tests/test_layout_auto.py covers it)
    return {"endpoint_url": server.endpoint_url, "part_size": 5 * MiB,
            "multipart_threshold": 5 * MiB, **extra}


def _raw_keys(server: S3Server, uri: str) -> list[str]:
    prefix = uri.split(f"{S3_TEST_BUCKET}/", 1)[1] + "/"
    client = server.client()
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=S3_TEST_BUCKET,
                                                                  Prefix=prefix)
        return sorted(o["Key"][len(prefix):] for p in pages for o in p.get("Contents", ()))
    finally:
        client.close()


def _raw_uploads(server: S3Server, uri: str) -> list[str]:
    prefix = uri.split(f"{S3_TEST_BUCKET}/", 1)[1] + "/"
    client = server.client()
    try:
        response = client.list_multipart_uploads(Bucket=S3_TEST_BUCKET, Prefix=prefix)
        return [u["Key"] for u in response.get("Uploads", ())]
    finally:
        client.close()


def _errors_text(exc: BaseException) -> str:
    """Everything an exception would show a user: message, chain, traceback."""
    return "".join(traceback.format_exception(exc))


# -- registration and options ------------------------------------------------------------


def test_plugin_registered_for_s3_and_s3a() -> None:
    assert registry.backend_class("s3") is S3Backend
    assert registry.backend_class("s3a") is S3Backend
    assert issubclass(S3Backend, dcpstore.Backend)
    assert issubclass(S3Options, dcpstore.BackendOptions)
    assert S3Backend.name == "s3" and S3Backend.schemes == ("s3", "s3a")
    backend = dcpstore.open_backend("s3a://bucket/run7/step-3")
    assert isinstance(backend, S3Backend)
    assert (backend.store.bucket, backend.store.root, backend.uri) == ("bucket", "run7/step-3/",
                                                           "s3://bucket/run7/step-3")
    assert dcpstore.open_backend("s3://bucket").store.root == ""


def test_options_precedence_keyword_query_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPSTORE_S3_REGION", "env-region")
    monkeypatch.setenv("DCPSTORE_S3_PART_SIZE", "6MiB")
    monkeypatch.setenv("DCPSTORE_S3_MAX_CONCURRENCY", "3")
    monkeypatch.setenv("DCPSTORE_S3_UNSIGNED_PAYLOAD", "false")
    monkeypatch.setenv("DCPSTORE_S3_TIMEOUT", "7.5")
    monkeypatch.setenv("DCPSTORE_S3_PREFIX_STRATEGY", "hash")

    env_only = dcpstore.open_backend("s3://b/p").options
    assert isinstance(env_only, S3Options)
    assert (env_only.region, env_only.part_size, env_only.max_concurrency) == (
        "env-region", 6 * MiB, 3)
    assert env_only.unsigned_payload is False and env_only.timeout == 7.5
    assert env_only.prefix_strategy == "hash"

    uri = "s3://b/p?region=query-region&part_size=7MiB&addressing_style=path&anonymous=yes"
    query = dcpstore.open_backend(uri).options
    assert (query.region, query.part_size, query.addressing_style, query.anonymous) == (
        "query-region", 7 * MiB, "path", True)

    keyword = dcpstore.get_writer(uri, region="kw-region", part_size=8 * MiB,
                                  overwrite=True).backend.options
    assert (keyword.region, keyword.part_size, keyword.max_concurrency) == (
        "kw-region", 8 * MiB, 3)
    reader = dcpstore.get_reader(uri, region="kw-region", verify=False)
    assert reader.backend.options.region == "kw-region"


def test_options_reach_the_client() -> None:
    backend = dcpstore.open_backend(
        "s3://bucket/p", endpoint_url="https://s3.example.invalid:9000", region="eu-west-3",
        addressing_style="virtual", timeout=12, connect_timeout=3, max_concurrency=5)
    assert isinstance(backend, S3Backend)
    meta = backend.client.meta  # creating a client sends nothing
    assert meta.region_name == "eu-west-3"
    assert meta.endpoint_url == "https://s3.example.invalid:9000"
    cfg = meta.config
    assert cfg.read_timeout == 12 and cfg.connect_timeout == 3
    assert cfg.retries["total_max_attempts"] == 1  # dcpstore retries, botocore does not
    assert cfg.s3["payload_signing_enabled"] is False  # unsigned payload over https
    assert cfg.s3["addressing_style"] == "virtual"
    assert cfg.max_pool_connections >= 5
    signed = dcpstore.open_backend("s3://bucket/p", unsigned_payload=False)
    assert signed.client.meta.config.s3["payload_signing_enabled"] is True  # type: ignore[attr-defined]
    anonymous = dcpstore.open_backend("s3://bucket/p", anonymous=True)
    assert anonymous.client.meta.config.signature_version is botocore.UNSIGNED  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"part_size": MiB}, "5 MiB"),
        ({"part_size": 6 * 1024 * MiB}, "5 GiB"),
        ({"addressing_style": "sideways"}, "addressing_style"),
        ({"prefix_strategy": "random"}, "prefix_strategy"),
        ({"endpoint_url": "ftp://127.0.0.1:1"}, "endpoint_url"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"connect_timeout": 0}, "connect_timeout"),
    ],
)
def test_invalid_options_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dcpstore.open_backend("s3://bucket/p", **options)


def test_unknown_option_refused() -> None:
    with pytest.raises(TypeError, match="aws_secret_access_key"):
        dcpstore.open_backend("s3://bucket/p", aws_secret_access_key="x")


# -- credentials and endpoints -------------------------------------------------------------


def test_endpoint_and_credentials_from_the_aws_environment(
    moto: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.randn(16)}
    for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        monkeypatch.setenv(variable, moto.endpoint_url)
        uri = _uri("env-endpoint")
        dcpstore.save(state, uri)  # no endpoint option: botocore's standard resolution
        out = {"w": torch.zeros(16)}
        dcpstore.load(out, uri)
        assert torch.equal(out["w"], state["w"])
        assert ".metadata" in _raw_keys(moto, uri)


def test_credentials_from_a_named_profile(seaweed: S3Server, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[dcpstore-test]\naws_access_key_id = {seaweed.access_key}\n"
                           f"aws_secret_access_key = {seaweed.secret_key}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    uri = _uri("profile")
    backend = dcpstore.open_backend(uri, profile="dcpstore-test", **_opts(seaweed))
    backend.put("k", b"v")
    backend.close()  # clients are recreated on use
    assert backend.get("k") == b"v"
    monkeypatch.setenv("DCPSTORE_S3_PROFILE", "dcpstore-test")
    assert dcpstore.open_backend(uri, **_opts(seaweed)).get("k") == b"v"
    with pytest.raises(PermissionError, match="no-such-profile"):
        dcpstore.open_backend(uri, profile="no-such-profile", **_opts(seaweed)).get("k")


def test_secrets_never_leak(seaweed: S3Server, monkeypatch: pytest.MonkeyPatch,
                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # botocore's DEBUG logs included
    secret = seaweed.secret_key
    wrong = "wrong-" + secrets.token_hex(16)
    uri = _uri("secrets")
    opts = _opts(seaweed)
    shown: list[str] = []

    dcpstore.save({"w": torch.randn(4), "o": {"x": 1}}, uri, **opts)
    out: dict[str, Any] = {"w": torch.zeros(4), "o": {"x": 0}}
    dcpstore.load(out, uri, **opts)
    backend = dcpstore.open_backend(uri, **opts)
    backend.list()
    shown += [repr(backend), str(backend.options), repr(dcpstore.get_writer(uri, **opts)),
              repr(dcpstore.get_reader(uri, **opts)), repr(backend.client)]
    pickled = pickle.dumps(dcpstore.get_writer(uri, **opts))

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    bad = dcpstore.open_backend(uri, **opts)
    with pytest.raises(PermissionError, match="SignatureDoesNotMatch|AccessDenied") as denied:
        bad.get(".metadata")
    shown.append(_errors_text(denied.value))
    with pytest.raises(PermissionError) as denied_save:
        dcpstore.save({"w": torch.randn(4)}, _uri("secrets"), **opts)
    shown.append(_errors_text(denied_save.value))

    with pytest.raises(ValueError) as in_endpoint:
        dcpstore.open_backend(uri, endpoint_url=f"http://user:{secret}@127.0.0.1:1")
    with pytest.raises(dcpstore.InvalidURIError) as in_uri:
        dcpstore.open_backend(f"s3://AKID:{secret}@{S3_TEST_BUCKET}/x")
    with pytest.raises(TypeError) as in_query:
        dcpstore.get_writer(f"s3://{S3_TEST_BUCKET}/x?aws_secret_access_key={secret}")
    shown += [_errors_text(e.value) for e in (in_endpoint, in_uri, in_query)]

    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert "DeleteObjects" in logs or "PutObject" in logs or "Making request" in logs, (
        "botocore's DEBUG logs were not captured")
    for text in [*shown, logs]:
        assert secret not in text
        assert wrong not in text
    assert secret.encode() not in pickled


def test_session_tokens_never_logged(moto: S3Server, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    token = "session-token-" + secrets.token_hex(16)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    caplog.set_level(logging.DEBUG)
    backend = dcpstore.open_backend(_uri("token"), **_opts(moto))
    backend.put("k", b"v")
    assert backend.get("k") == b"v"
    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert "x-amz-security-token" in logs.lower()  # botocore did log the header...
    assert token not in logs  # ...with its value blanked out


# -- errors: specific and prompt ---------------------------------------------------------


def test_missing_bucket(s3: S3Server) -> None:
    bucket = "dcpstore-no-such-bucket-" + uuid.uuid4().hex[:8]
    uri = f"s3://{bucket}/ckpt"
    opts = _opts(s3)
    started = time.monotonic()
    backend = dcpstore.open_backend(uri, **opts)
    # one missing-bucket error on every backend, deliberately not a FileNotFoundError
    # ("no checkpoint here yet"); it still names the bucket and says it does not exist
    with pytest.raises(dcpstore.BucketNotFoundError,
                       match=f"bucket '{bucket}' does not exist") as missing:
        backend.get(".metadata")
    assert not isinstance(missing.value, FileNotFoundError)
    assert missing.value.errno == errno.ENOENT
    with pytest.raises(dcpstore.BucketNotFoundError, match=bucket):
        dcpstore.save({"w": torch.randn(4)}, uri, **opts)
    with pytest.raises(dcpstore.BucketNotFoundError, match=f"bucket '{bucket}' does not exist"):
        dcpstore.load({"w": torch.zeros(4)}, uri, **opts)
    assert time.monotonic() - started < 10
    assert backend.store.request_counts == {"get_object": 1}  # not retried


def test_access_denied(seaweed: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = _uri("denied")
    opts = _opts(seaweed)
    dcpstore.save({"w": torch.randn(4)}, uri, **opts)

    use_s3_server(seaweed, monkeypatch, readonly=True)
    reader = dcpstore.open_backend(uri, **opts)
    assert reader.exists(".metadata")  # reading is allowed
    with pytest.raises(PermissionError, match="AccessDenied") as denied:
        reader.put("x", b"1")
    assert "request id" in str(denied.value) and f"s3://{S3_TEST_BUCKET}/" in str(denied.value)
    assert reader.store.request_counts.get("put_object") == 1  # not retried
    with pytest.raises(PermissionError):
        dcpstore.save({"w": torch.randn(4)}, uri, overwrite=True, **opts)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "no-such-key-id")
    with pytest.raises(PermissionError, match="InvalidAccessKeyId|AccessDenied|Signature"):
        dcpstore.open_backend(uri, **opts).get(".metadata")

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    anonymous = dcpstore.open_backend(uri, anonymous=True, **opts)
    with pytest.raises(PermissionError):
        anonymous.get(".metadata")


def test_unreachable_endpoint_fails_fast() -> None:
    port = free_port()  # nothing listens there
    uri = _uri("unreachable")
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "max_attempts": 2,
            "retry_backoff": 0.01}
    started = time.monotonic()
    backend = dcpstore.open_backend(uri, **opts)
    with pytest.raises(ConnectionError, match=f"cannot reach the S3 endpoint "
                                              f"http://127.0.0.1:{port}"):
        backend.get(".metadata")
    assert backend.store.request_counts == {"get_object": 2}
    with pytest.raises(ConnectionError, match="cannot reach"):
        dcpstore.save({"w": torch.randn(4)}, uri, **opts)
    assert time.monotonic() - started < 10


@contextlib.contextmanager
def _silent_server() -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        sock.close()


def test_stuck_request_times_out() -> None:
    with _silent_server() as port:
        backend = dcpstore.open_backend(
            _uri("stuck"), endpoint_url=f"http://127.0.0.1:{port}", timeout=0.5,
            max_attempts=2, retry_backoff=0.01)
        started = time.monotonic()
        with pytest.raises(dcpstore.StoreTimeoutError, match="timed out"):
            backend.get("k")
        assert time.monotonic() - started < 5
        assert backend.store.request_counts == {"get_object": 2}
        backend.close()


class _ScriptedS3(http.server.ThreadingHTTPServer):
    """An HTTP server answering S3 requests from a script of (status, error code)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.script: list[tuple[int, str | None]] = []
        self.requests: list[str] = []


class _ScriptedHandler(http.server.BaseHTTPRequestHandler):
    server: _ScriptedS3
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append(f"{self.command} {self.path}")
        status, code = self.server.script.pop(0) if self.server.script else (200, None)
        if code == "drop":  # a connection dropped without an answer
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        request_id = f"req-{len(self.server.requests)}"
        body = b"payload!" if code is None else (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>scripted {code}</Message><RequestId>{request_id}</RequestId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml" if code else "binary/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", request_id)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[_ScriptedS3]:
    server = _ScriptedS3()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def test_retries_throttling_5xx_and_dropped_connections(
    scripted: _ScriptedS3, caplog: pytest.LogCaptureFixture
) -> None:
    opts = {"endpoint_url": f"http://127.0.0.1:{scripted.server_address[1]}",
            "max_attempts": 5, "retry_backoff": 0.01}
    backend = dcpstore.open_backend("s3://bucket/ckpt", **opts)
    scripted.script = [(503, "SlowDown"), (500, "InternalError"), (200, "drop"),
                       (429, "TooManyRequests")]
    with caplog.at_level(logging.WARNING):
        assert backend.get("k") == b"payload!"
    assert backend.store.request_counts == {"get_object": 5}
    assert len(scripted.requests) == 5  # botocore did not retry on its own
    assert "SlowDown" in caplog.text and "retrying" in caplog.text

    backend.store.reset_stats()
    scripted.script = [(503, "SlowDown")] * 5
    with pytest.raises(OSError, match=r"SlowDown.*req-\d+") as exhausted:
        backend.get("k")
    assert "5 attempt(s)" in str(exhausted.value)
    assert backend.store.request_counts == {"get_object": 5}

    for status, code, error in [(403, "AccessDenied", PermissionError),
                                (404, "NoSuchKey", FileNotFoundError),
                                (400, "InvalidArgument", OSError)]:
        backend.store.reset_stats()
        scripted.script = [(status, code)]
        with pytest.raises(error, match=rf"{code}.*HTTP {status}, request id req-\d+"):
            backend.get("k")
        assert backend.store.request_counts == {"get_object": 1}  # not retried


# -- saves and loads: streaming, bounded, efficient ------------------------------------------


def test_parts_upload_while_writing_bounded(moto: S3Server,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    backend = dcpstore.open_backend(_uri("stream"), **_opts(moto, max_concurrency=2))
    assert isinstance(backend, S3Backend)
    active = 0
    peak = 0
    lock = threading.Lock()
    original = S3Store.upload_part

    def tracked(self: S3Store, key: str, upload_id: str, number: int, data: memoryview) -> Any:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        try:
            time.sleep(0.05)
            return original(self, key, upload_id, number, data)
        finally:
            with lock:
                active -= 1

    monkeypatch.setattr(S3Store, "upload_part", tracked)
    part = 5 * MiB
    chunk = bytes(range(256)) * (MiB // 256)
    upload = backend.open_upload("big.distcp")
    for _ in range(5 * part // MiB):
        upload.write(chunk)
    assert isinstance(upload, StoreUpload)
    upload._drain()  # parts went up while we were still writing, before any commit
    counts = backend.store.request_counts
    assert counts["create_multipart_upload"] == 1 and counts["upload_part"] == 5
    assert "complete_multipart_upload" not in counts
    assert not backend.exists("big.distcp")  # not visible before commit
    upload.write(b"tail")
    assert upload.commit().size == 5 * part + 4
    assert peak <= 2  # max_concurrency bounds the parts in flight (and the memory)
    assert backend.store.request_counts["upload_part"] == 6
    assert backend.store.bytes_written == 5 * part + 4
    assert backend.stat("big.distcp").size == 5 * part + 4


def test_small_objects_are_one_put(moto: S3Server) -> None:
    backend = dcpstore.open_backend(_uri("small"), **_opts(moto))
    assert isinstance(backend, S3Backend)
    with backend.open_upload("__0_0.distcp") as upload:
        upload.write(b"x" * 1000)
        upload.commit()
    backend.put(".metadata", b"m", atomic=True)
    assert backend.store.request_counts == {"put_object": 2}


def test_save_requests_scale_with_files_not_tensors(moto: S3Server) -> None:
    uri = _uri("requests")
    writer = dcpstore.get_writer(uri, **_opts(moto))
    dcp.save({f"t{i}": torch.randn(64) for i in range(300)}, storage_writer=writer,
             no_dist=True)
    backend = writer.backend
    assert isinstance(backend, S3Backend)
    # coordinator: one existence check (.metadata); data file, manifest, .metadata: a PUT each
    assert backend.store.request_counts == {"get_object": 1, "put_object": 3}

    uri = _uri("requests")
    writer = dcpstore.get_writer(uri, files_per_rank=2, **_opts(moto))
    state = {f"t{i}": torch.randn(64 * 1024) for i in range(48)}  # 12 MiB in 48 tensors
    dcp.save(state, storage_writer=writer, no_dist=True)
    counts = writer.backend.store.request_counts  # type: ignore[attr-defined]
    assert counts == {"get_object": 1, "put_object": 2, "create_multipart_upload": 2,
                      "upload_part": 4, "complete_multipart_upload": 2}
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcpstore.load(out, uri, **_opts(moto))
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_partial_load_fetches_only_needed_bytes(s3: S3Server) -> None:
    uri = _uri("partial")
    state = {f"t{i}": torch.randn(256, 64) for i in range(8)}  # 64 KiB each
    dcpstore.save(state, uri, **_opts(s3))
    backend = dcpstore.open_backend(uri, **_opts(s3))
    small = sum(backend.stat(k).size for k in [".metadata"] + [
        o.key for o in backend.list(".dcpstore-")])
    planner = dcpstore.dcp.api.CheckedLoadPlanner(allow_partial_load=True)

    for gap, requests in [(0, 2), (1 * MiB, 1)]:
        reader = dcpstore.get_reader(uri, coalesce_gap=gap, **_opts(s3))
        out = {"t3": torch.zeros(256, 64), "t6": torch.zeros(256, 64)}
        dcp.load(out, storage_reader=reader, planner=planner, no_dist=True)
        assert torch.equal(out["t3"], state["t3"]) and torch.equal(out["t6"], state["t6"])
        fetched = reader.backend
        assert isinstance(fetched, S3Backend)
        assert reader.requests == requests
        # .metadata and manifest, then exactly the ranges the reader planned
        assert fetched.store.request_counts == {"get_object": 2 + requests}
        assert fetched.store.bytes_read == small + reader.bytes_read
        item = reader.bytes_needed // 2
        if gap == 0:
            assert reader.bytes_read == reader.bytes_needed
        else:  # t4 and t5 lie between t3 and t6: the coalescing gap, nothing more
            assert reader.bytes_needed < reader.bytes_read <= reader.bytes_needed + 2 * item


def test_interrupted_save_leaves_nothing(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = _uri("interrupted")
    state = {"a": torch.randn(2 * MiB), "b": torch.randn(2 * MiB)}  # 8 MiB each
    created: list[str] = []
    original_create = S3Store.start_upload

    def create(self: S3Store, key: str) -> str:
        created.append(key)
        return original_create(self, key)

    prepared = 0
    original_prepare = dcpstore.dcp.data_file._prepare_tensor

    def prepare(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal prepared
        prepared += 1
        if prepared == 2:
            raise RuntimeError("serializer crashed mid-write")
        return original_prepare(tensor)

    monkeypatch.setattr(S3Store, "start_upload", create)
    monkeypatch.setattr(dcpstore.dcp.data_file, "_prepare_tensor", prepare)
    with pytest.raises(RuntimeError, match="mid-write"):
        # one 16 MiB file: its first 8 MiB are parts of a multipart upload by the crash
        dcpstore.save(state, uri, files_per_rank=1, **_opts(s3))
    assert created, "the failed save had not started a multipart upload"
    backend = dcpstore.open_backend(uri, **_opts(s3))
    assert backend.list() == []
    assert backend.list_uploads() == []
    assert _raw_keys(s3, uri) == [] and _raw_uploads(s3, uri) == []
    with pytest.raises(dcpstore.CheckpointNotFoundError):
        dcpstore.load({"a": torch.zeros(2 * MiB)}, uri, **_opts(s3))


@pytest.mark.parametrize("strategy", ["none", "hash"])
def test_dangling_uploads_listed_and_aborted(s3: S3Server, strategy: str) -> None:
    backend = dcpstore.open_backend(_uri("dangling"), **_opts(s3, prefix_strategy=strategy))
    key = "__3_0.0123456789abcdef.distcp"
    upload = backend.open_upload(key)
    upload.write(bytes(5 * MiB + 10))
    assert isinstance(upload, StoreUpload)
    upload._drain()  # a rank that crashed here leaves an open multipart upload
    uploads = backend.list_uploads()
    assert [k for k, _ in uploads] == [key]
    assert backend.list_uploads("__3") == uploads
    assert backend.list_uploads("other/") == []
    backend.abort_uploads(uploads)
    assert backend.list_uploads() == []
    assert not backend.exists(key)
    backend.abort_uploads(uploads)  # already gone: not an error


# -- zero-copy uploads ---------------------------------------------------------------------


def test_parts_are_sent_without_a_copy(moto: S3Server,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    backend = dcpstore.open_backend(_uri("nocopy"), **_opts(moto, max_concurrency=2))
    assert isinstance(backend, S3Backend)
    bodies: list[Any] = []
    original = S3Store._request

    def request(self: S3Store, operation: str, **params: Any) -> Any:
        if operation in ("upload_part", "put_object"):
            bodies.append(params["Body"])
        return original(self, operation, **params)

    monkeypatch.setattr(S3Store, "_request", request)
    copies: list[int] = []  # botocore's CRT signer copies every body that is not bytes
    try:
        import botocore.crt.auth as crt_auth
    except ImportError:  # no awscrt: botocore's own signer, which copies nothing
        crt_auth = None
    if crt_auth is not None:
        real_bytesio = crt_auth.BytesIO

        def counting_bytesio(initial: Any = b"") -> Any:
            if type(initial) is not bytes:
                copies.append(len(initial))
            return real_bytesio(initial)

        monkeypatch.setattr(crt_auth, "BytesIO", counting_bytesio)
    sent: list[Any] = []  # what urllib3 is handed, and the headers
    backend.client.meta.events.register(
        "before-send.s3", lambda request, **kw: sent.append((request.body, request.headers)))
    part = 5 * MiB
    data = secrets.token_bytes(4 * part + 123)
    upload = backend.open_upload("parts.distcp")
    _odd_writes(upload, data[:1000])
    upload.write(data[1000:])
    upload.commit()
    assert backend.get("parts.distcp") == data
    pool = PartBuffers.of(backend, part, StoreUpload._allocate_buffer)
    assert len(bodies) == 5 and copies == []
    # each part's body is a view of a pooled buffer, reused part after part, and urllib3
    # gets that view (one sendall), without an Expect: 100-continue round trip
    for body, size in zip(bodies, [part] * 4 + [123], strict=True):
        assert isinstance(body, memoryview) and len(body) == size
        assert any(body.obj is f for f in pool._free)
    uploads = [(b, h) for b, h in sent if isinstance(b, memoryview)]
    assert len(uploads) == 5 and all("Expect" not in h for _, h in uploads)
    assert pool.allocated <= 3 and pool.outstanding == 0
    bodies.clear()
    small = backend.open_upload("small.distcp")
    small.write(b"abc")
    small.commit()
    assert len(bodies) == 1 and bytes(bodies[0]) == b"abc" and copies == []
    assert backend.get("small.distcp") == b"abc"


def test_part_stream_reads_seeks_and_rewinds() -> None:
    buf = bytearray(b"0123456789")
    stream = _zerocopy.PartStream(memoryview(buf)[2:8])
    assert len(stream) == 6 and stream.seekable() and stream.readable()
    assert stream.read(4) == b"2345" and stream.tell() == 4
    assert stream.read() == b"67" and stream.read(3) == b""
    assert stream.seek(0) == 0
    out = bytearray(4)
    assert stream.readinto(out) == 4 and out == b"2345"
    assert stream.seek(-1, io.SEEK_END) == 5 and stream.read(10) == b"7"
    assert stream.seek(1, io.SEEK_SET) == 1 and stream.seek(2, io.SEEK_CUR) == 3
    assert stream.read(None) == b"567"
    with pytest.raises(ValueError):
        stream.seek(-1)


def test_zero_copy_relies_on_botocores_expect_header_rule() -> None:
    """botocore adds ``Expect: 100-continue`` to file-like bodies only: a view is sent
    in one ``sendall`` without that round trip, a stream would not be."""
    from types import SimpleNamespace

    from botocore.handlers import add_expect_header

    model = SimpleNamespace(http={"method": "PUT"})
    view: dict[str, Any] = {"body": memoryview(b"part"), "headers": {}}
    add_expect_header(model, view)
    assert "Expect" not in view["headers"]
    stream: dict[str, Any] = {"body": _zerocopy.PartStream(memoryview(b"part")),
                              "headers": {}}
    add_expect_header(model, stream)
    assert stream["headers"].get("Expect") == "100-continue"


def test_zero_copy_body_swap_brackets_signing(moto: S3Server) -> None:
    """botocore signs in a ``request-created`` handler, which emits ``before-sign``: the
    signer reads the part through a stream, and the swap back (the last
    ``request-created`` handler) hands urllib3 the signed request with the view itself."""
    backend = dcpstore.open_backend(_uri("swap"), **_opts(moto))
    assert isinstance(backend, S3Backend)
    signer = backend.client._request_signer
    seen: list[tuple[str, Any, bool]] = []
    events = backend.client.meta.events
    events.register_last(_zerocopy.BEFORE_SIGN, lambda request, **kw: seen.append(
        ("sign", type(request.data), "Authorization" in request.headers)))
    events.register("before-send.s3", lambda request, **kw: seen.append(
        ("send", type(request.body), "Authorization" in request.headers
         and "Expect" not in request.headers)))
    payload = secrets.token_bytes(1000)
    with backend.open_upload("swap.bin") as upload:
        upload.write(payload)
        upload.commit()
    assert seen == [("sign", _zerocopy.PartStream, False), ("send", memoryview, True)]
    assert backend.get("swap.bin") == payload
    # the signer is a request-created handler, and the swap back comes after it
    created = list(backend.client.meta.events._emitter._handlers.prefix_search(
        "request-created.s3.PutObject"))
    assert signer.handler in created
    assert created.index(signer.handler) < created.index(_zerocopy._stream_to_body)


def test_zero_copy_reads_come_straight_from_the_socket(moto: S3Server) -> None:
    """The urllib3/http.client internals :func:`_zerocopy.readinto` uses are there, and
    the connection is handed back to the pool once the body is read."""
    backend = dcpstore.open_backend(_uri("direct"), **_opts(moto))
    assert isinstance(backend, S3Backend)
    data = secrets.token_bytes(3 * MiB + 17)
    backend.put("direct.bin", data)
    response = backend.client.get_object(Bucket=backend.store.bucket,
                                         Key=backend.store._physical("direct.bin"))
    body = response["Body"]
    fp = _zerocopy.direct_response(body)
    assert fp is not None, "botocore/urllib3 changed: ranged reads would copy every byte"
    out = memoryview(bytearray(len(data)))
    pos = 0
    while pos < len(out):
        n = _zerocopy.readinto(body, out[pos:])
        assert n > 0
        pos += n
    raw = body._raw_stream
    assert bytes(out) == data
    assert raw._fp_bytes_read == len(data) and raw.length_remaining == 0
    assert fp.isclosed() and raw._connection is None  # back in the pool
    body.close()
    # and through the backend: a scatter read of one range into three buffers
    outs = [memoryview(bytearray(n)) for n in (5, MiB, 100)]
    got = list(backend.read_ranges([ReadRange("direct.bin", 7, 5 + MiB + 100)], [outs]))
    assert got[0][0] == 0
    assert b"".join(bytes(o) for o in outs) == data[7:7 + 5 + MiB + 100]
    # the store checksums each piece as it comes off the socket (not after the request)
    checksums: dict[int, int | None] = {1: None}
    backend.store.read_checksummed("direct.bin", 7, outs, checksums)
    assert checksums == {1: crc32c.crc32c(outs[1])}


# -- prefix strategy ------------------------------------------------------------------------


def test_hash_key_mapping() -> None:
    name = "__0_1.00ff00ff00ff00ff.distcp"
    physical = hashed_key(name)
    assert re.fullmatch(r"[0-9a-f]{2}/" + re.escape(name), physical)
    assert hashed_key("step-1/" + name) == "step-1/" + physical
    assert logical_key(physical) == name and logical_key("step-1/" + physical) == "step-1/" + name
    assert logical_key("zz/" + name) == "zz/" + name  # not a hash of the name: left alone
    assert logical_key(".metadata") == ".metadata"
    assert is_data_file(name) and is_data_file("a/" + name) and not is_data_file(".metadata")
    spread = {hashed_key(f"__{r}_0.00ff00ff00ff00ff.distcp")[:2] for r in range(64)}
    assert len(spread) > 32


def test_hash_prefix_strategy_is_transparent(s3: S3Server) -> None:
    uri = _uri("hashed")
    opts = _opts(s3, prefix_strategy="hash")
    state = {"w": torch.randn(100), "b": torch.arange(10), "o": {"k": 1}}
    dcpstore.save(state, uri, files_per_rank=3, **opts)

    raw = _raw_keys(s3, uri)
    data = [k for k in raw if k.endswith(".distcp")]
    assert len(data) >= 2
    assert all(re.fullmatch(r"[0-9a-f]{2}/__0_\d\.[0-9a-f]+\.distcp", k) for k in data), raw
    assert ".metadata" in raw and any(k.startswith(".dcpstore-") for k in raw)

    backend = dcpstore.open_backend(uri, **opts)
    logical = [o.key for o in backend.list()]
    assert sorted(logical) == sorted([k.split("/", 1)[1] for k in data] + [
        k for k in raw if not k.endswith(".distcp")])
    assert [o.key for o in backend.list("__")] == sorted(k.split("/", 1)[1] for k in data)
    first = backend.list("__")[0]
    assert backend.stat(first.key).size == first.size and backend.exists(first.key)

    for reader_opts in (opts, _opts(s3)):  # loads by its root URI, with either strategy
        out: dict[str, Any] = {"w": torch.zeros(100), "b": torch.zeros(10, dtype=torch.int64),
                               "o": {"k": 0}}
        dcpstore.load(out, uri, **reader_opts)
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
        assert out["o"] == {"k": 1}

    dcpstore.save({"w": torch.ones(100)}, uri, overwrite=True, **opts)
    after = _raw_keys(s3, uri)
    assert not set(data) & set(after), "the overwritten save's hashed files were left"
    assert len([k for k in after if k.endswith(".distcp")]) == 1


# -- compatibility with torch's fsspec reader and writer ---------------------------------


def test_torch_fsspec_reader_and_writer_interoperate(s3: S3Server) -> None:
    pytest.importorskip("s3fs")
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    state = {"w": torch.randn(20, 7), "n": {"b": torch.arange(5)}, "step": 3}

    def empty() -> dict[str, Any]:
        return {"w": torch.zeros(20, 7), "n": {"b": torch.zeros(5, dtype=torch.int64)},
                "step": 0}

    uri = _uri("to-torch")
    dcpstore.save(state, uri, **_opts(s3))
    out = empty()
    dcp.load(out, storage_reader=FsspecReader(uri, **s3.storage_options()), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["n"]["b"], state["n"]["b"])
    assert out["step"] == 3

    uri = _uri("from-torch")
    dcp.save(state, storage_writer=FsspecWriter(uri, **s3.storage_options()), no_dist=True)
    out = empty()
    dcpstore.load(out, uri, **_opts(s3))
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["n"]["b"], state["n"]["b"])
    assert out["step"] == 3


def test_s3a_scheme_roundtrip(moto: S3Server) -> None:
    uri = _uri("s3a").replace("s3://", "s3a://")
    dcpstore.save({"w": torch.arange(6.0)}, uri, **_opts(moto))
    out = {"w": torch.zeros(6)}
    dcpstore.load(out, uri.replace("s3a://", "s3://"), **_opts(moto))
    assert torch.equal(out["w"], torch.arange(6.0))


def test_signed_payloads_work_too(moto: S3Server) -> None:
    backend = dcpstore.open_backend(_uri("signed"), **_opts(moto, unsigned_payload=False))
    with backend.open_upload("__0_0.distcp") as upload:
        upload.write(bytes(5 * MiB + 1))
        upload.commit()
    assert backend.stat("__0_0.distcp").size == 5 * MiB + 1


# -- multi-process: FSDP2 on 4 gloo ranks, resharded to 2 and 1 -------------------------


@pytest.mark.multiprocess
def test_fsdp2_save_4_ranks_load_at_2_and_1(seaweed: S3Server, tmp_path: Path) -> None:
    from s3_multiprocess import fsdp_load, fsdp_save, run_ranks

    uri = _uri("fsdp")
    opts = _opts(seaweed)
    reference = str(tmp_path / "reference.pt")
    saved = run_ranks(fsdp_save, 4, uri, opts, reference)

    for rank, result in enumerate(saved):
        requests = result["requests"]
        assert result["coordinator"] == (rank == 0)
        if rank == 0:  # one existence check; its data file, the manifest, .metadata
            assert requests == {"get_object": 1, "put_object": 3}, requests
        else:  # only the coordinator lists, checks existence or reads
            assert requests == {"put_object": 1}, (rank, requests)

    for world_size in (2, 1):
        loaded = run_ranks(fsdp_load, world_size, uri, opts, reference)
        assert loaded[0]["mismatches"] == [], (world_size, loaded[0]["mismatches"])
        # 8 parameters, and AdamW's step, exp_avg, exp_avg_sq of each
        assert loaded[0]["tensors_compared"] == 8 * 4


@pytest.mark.multiprocess
def test_cli_demo_with_endpoint_from_aws_env(moto: S3Server, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPSTORE_")}
    env["AWS_ENDPOINT_URL"] = moto.endpoint_url
    uri = _uri("demo")
    done = subprocess.run(
        [sys.executable, "-m", "dcpstore", "demo", "--uri", uri, "--width", "32"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bit-exact" in done.stdout
    assert ".metadata" in _raw_keys(moto, uri)


@pytest.mark.multiprocess
def test_reshard_matrix_s3(seaweed: S3Server) -> None:
    """Save at 1, 2, 4 ranks, load at 1, 2, 3, 4 on SeaweedFS (see test_reshard_matrix)."""
    from reshard_workers import run_matrix

    run_matrix(_uri("matrix"), _opts(seaweed))
