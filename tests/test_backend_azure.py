"""The Azure Blob Storage plugin (dcpstore_azure) against Azurite on 127.0.0.1.

Runs the conformance suite (contract checks, SDK faults, missing container, a wrong
account key, throttling through the FaultProxy), the error table, the credential chain,
secrets never printed, and an FSDP2 save on 2 gloo ranks loaded at 1. Azurite comes from
npm (``make setup`` runs ``backends/azure/install-azurite.sh``); without it the tests
error, never skip.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import pickle
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests.exceptions
import torch
import torch.distributed.checkpoint as dcp
import urllib3.exceptions
import urllib3.response
from azure.core.exceptions import (
    ClientAuthenticationError,
    DecodeError,
    HttpResponseError,
    IncompleteReadError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
    ServiceResponseTimeoutError,
)
from azure.storage.blob import BlobServiceClient
from dcpstore_azure import AzureBlobStore, AzureOptions
from dcpstore_azure import store as azure_store
from dcpstore_azure.store import _block_id

import dcpstore
from dcpstore.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigurationError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
    StoreThrottledError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from dcpstore.plugin import http_body
from dcpstore.storage.backend import ReadRange
from dcpstore.storage.store_backend import StoreBackend
from dcpstore.testing import BackendConformance, FaultPlan, FaultProxy, HTTPEndpoint
from dcpstore.testing.azurite import (
    ACCOUNT,
    ACCOUNT_KEY,
    AzuriteServer,
    azurite_binary,
    azurite_server,
)

CONTAINER = "dcpstore-test"
PART = 256 * 1024
#: A key only these tests use: it must never show up in anything printed.
SECRET_KEY = "c2VjcmV0LWtleS1mb3ItZGNwc3RvcmUtdGVzdHMtb25seQ=="


@pytest.fixture(scope="module")
def azurite() -> Iterator[AzuriteServer]:
    if azurite_binary() is None:
        pytest.fail("Azurite is not installed: run backends/azure/install-azurite.sh "
                    "(make setup does)")
    with azurite_server() as server:
        client = BlobServiceClient.from_connection_string(server.connection_string(),
                                                          retry_total=0)
        client.create_container(CONTAINER)
        client.close()
        yield server


@pytest.fixture(autouse=True)
def azure_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the emulator's connection string: no other account, no DCPSTORE_AZ_* option."""
    for name in list(os.environ):
        if name.startswith(("AZURE_", "DCPSTORE_AZ_", "MSI_", "IDENTITY_")):
            monkeypatch.delenv(name)
    if "azurite" in request.fixturenames:
        server = request.getfixturevalue("azurite")
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string())


def _uri(tag: str) -> str:
    return f"az://{CONTAINER}/{tag}/{uuid.uuid4().hex[:12]}"


def sdk_error(cls: type[Exception], status: int | None = None, code: str | None = None,
              request_id: str = "req-0001") -> Exception:
    """An exception as the SDK raises it (status, x-ms-error-code, request id)."""
    exc = cls(f"{status} {code}")
    if isinstance(exc, HttpResponseError):
        headers = {"x-ms-request-id": request_id, **({"x-ms-error-code": code} if code else {})}
        for name, value in (("status_code", status), ("error_code", code),
                            ("response", SimpleNamespace(headers=headers))):
            setattr(exc, name, value)
    return exc


class TestAzureBlobStore(BackendConformance):
    @pytest.fixture
    def checkpoint_uri(self, azurite: AzuriteServer) -> str:
        return _uri("conformance")

    @pytest.fixture
    def backend_options(self, azurite: AzuriteServer) -> dict[str, Any]:
        return {"part_size": PART, "max_concurrency": 4}

    @pytest.fixture
    def missing_bucket_uri(self, azurite: AzuriteServer) -> str:
        return f"az://no-such-container-{uuid.uuid4().hex[:8]}/conformance"

    @pytest.fixture
    def denied_backend_options(self, azurite: AzuriteServer,
                               monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                           azurite.connection_string(key=SECRET_KEY))  # a wrong key
        return {"part_size": PART}

    @pytest.fixture
    def http_endpoint(self, azurite: AzuriteServer) -> HTTPEndpoint:
        return HTTPEndpoint(azurite.upstream, lambda url: {"endpoint_url": f"{url}/{ACCOUNT}"})

    @pytest.fixture
    def store_faults(self) -> dict[str, BaseException]:
        return {
            "throttled": sdk_error(HttpResponseError, 503, "ServerBusy"),
            "timeout": ServiceResponseTimeoutError("read timed out"),
            "unavailable": sdk_error(HttpResponseError, 500, "InternalError"),
            "denied": sdk_error(ClientAuthenticationError, 403, "AuthenticationFailed"),
            "not_found": sdk_error(ResourceNotFoundError, 404, "BlobNotFound"),
            "missing_bucket": sdk_error(ResourceNotFoundError, 404, "ContainerNotFound"),
            "too_large": sdk_error(HttpResponseError, 413, "RequestBodyTooLarge"),
            "precondition": sdk_error(ResourceModifiedError, 412, "ConditionNotMet"),
        }


# -- resolution, options, block ids -----------------------------------------------------------


def test_entry_point_options_and_loopback(azurite: AzuriteServer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    uri = _uri("options")
    be = dcpstore.open_backend(uri)
    assert isinstance(be, StoreBackend) and isinstance(be.store, AzureBlobStore)
    assert be.uri == uri and be.store.container == CONTAINER
    assert be.client.url.startswith(f"http://127.0.0.1:{azurite.port}/")  # the emulator only
    be.put("k", b"v")
    assert be.get("k") == b"v"
    be.close()
    monkeypatch.setenv("DCPSTORE_AZ_TIMEOUT", "7")
    opts = dcpstore.open_backend(f"{uri}?max_concurrency=3").options
    assert isinstance(opts, AzureOptions) and opts.max_concurrency == 3 and opts.timeout == 7
    with pytest.raises(ValueError, match="http"):
        dcpstore.open_backend(uri, account_url="blob.core.windows.net")


def test_block_ids_have_one_length() -> None:
    ids = {_block_id("a" * 32, n) for n in (1, 2, 999, 50_000)}
    ids |= {_block_id("other-upload", 1)}
    assert len(ids) == 5 and len({len(i) for i in ids}) == 1
    assert _block_id("u", 7) == _block_id("u", 7)  # a retried part replaces its block


def test_large_object_in_many_blocks(azurite: AzuriteServer) -> None:
    be = dcpstore.open_backend(_uri("blocks"), part_size=PART, max_concurrency=4)
    data = os.urandom(PART * 9 + 123)
    with be.open_upload("big.distcp") as up:
        for i in range(0, len(data), 100_000):
            up.write(data[i:i + 100_000])
        assert not be.exists("big.distcp")  # staged blocks are not visible
        assert up.commit().size == len(data)
    assert be.get("big.distcp") == data
    assert be.stat("big.distcp").size == len(data)
    be.close()


# -- the error table --------------------------------------------------------------------------


@pytest.mark.parametrize(("exc", "kind"), [
    (sdk_error(ResourceNotFoundError, 404, "BlobNotFound"), ObjectNotFoundError),
    (sdk_error(ResourceNotFoundError, 404, "ContainerNotFound"), BucketNotFoundError),
    (sdk_error(ClientAuthenticationError, 403, "AuthorizationPermissionMismatch"),
     AccessDeniedError),
    (sdk_error(HttpResponseError, 403, None), AccessDeniedError),
    (sdk_error(HttpResponseError, 429, None), StoreThrottledError),
    (sdk_error(HttpResponseError, 503, "ServerBusy"), StoreThrottledError),
    (sdk_error(HttpResponseError, 500, "OperationTimedOut"), StoreTimeoutError),
    (sdk_error(HttpResponseError, 502, None), StoreUnavailableError),
    (sdk_error(HttpResponseError, 413, None), ObjectTooLargeError),
    (sdk_error(HttpResponseError, 400, "RequestBodyTooLarge"), ObjectTooLargeError),
    (ServiceResponseTimeoutError("timed out"), StoreTimeoutError),
    (ServiceRequestError("connection refused"), StoreUnavailableError),
])
def test_error_table(exc: Exception, kind: type[StoreError]) -> None:
    store = AzureBlobStore("ctr/run")
    mapped = store.map_error(exc, "k.distcp")
    assert mapped is not None and type(mapped) is kind, (exc, mapped)
    if isinstance(exc, HttpResponseError):
        assert mapped.request_id == "req-0001" and "req-0001" in str(mapped)
    assert ("az://ctr" in str(mapped)) if kind is BucketNotFoundError else \
        ("az://ctr/run/k.distcp" in str(mapped))
    assert store.map_error(ValueError("not the SDK's"), "k") is None
    assert store.map_error(sdk_error(HttpResponseError, 400, "InvalidBlockList"), "k") is None
    assert isinstance(store.map_error(ClientAuthenticationError("no token"), "k"),
                      AccessDeniedError)  # a credential that could not get a token


def test_sdk_retries_are_off(azurite: AzuriteServer) -> None:
    """One 503 is one request: the SDK does not retry, the framework does (once here)."""
    with FaultProxy(azurite.upstream) as proxy:
        be = dcpstore.open_backend(_uri("noretry"), endpoint_url=f"{proxy.endpoint_url}/{ACCOUNT}",
                                   max_attempts=1)
        be.put("k", b"v")
        proxy.plan = FaultPlan(rate=1.0, kinds=("503",), match=lambda i: i.method == "GET")
        with pytest.raises(StoreThrottledError):
            be.get("k")
        be.close()
        assert proxy.snapshot().faults["503"] == 1


def _cut(exc: BaseException) -> HttpResponseError:
    """What the SDK's downloader raises after its own retries: status-less, ``exc`` inside."""
    outer = HttpResponseError(exc, error=exc)
    outer.__cause__ = exc
    return outer


@pytest.mark.parametrize(("exc", "kind"), [
    (IncompleteReadError("cut"), StoreUnavailableError),
    (DecodeError("bad body"), StoreUnavailableError),
    (ServiceResponseError("reset"), StoreUnavailableError),
    (_cut(IncompleteReadError("cut")), StoreUnavailableError),
    (_cut(DecodeError("bad body")), StoreUnavailableError),
    (_cut(ServiceResponseError("reset")), StoreUnavailableError),
    (_cut(ServiceResponseTimeoutError("slow")), StoreTimeoutError),
    (_cut(requests.exceptions.ChunkedEncodingError("x")), StoreUnavailableError),
    (http.client.IncompleteRead(b"", 1), StoreUnavailableError),
    (urllib3.exceptions.ProtocolError("Connection broken"), StoreUnavailableError),
    (urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out"), StoreTimeoutError),
    (requests.exceptions.ConnectionError("reset"), StoreUnavailableError),
    (requests.exceptions.ChunkedEncodingError("cut"), StoreUnavailableError),
    (requests.exceptions.ReadTimeout("slow"), StoreTimeoutError),
])
def test_broken_reads_are_retryable(exc: Exception, kind: type[StoreError]) -> None:
    """A cut body or connection, bare or inside the SDK's status-less error: retryable."""
    mapped = AzureBlobStore("ctr/run").map_error(exc, "k.distcp")
    assert mapped is not None and type(mapped) is kind, (exc, mapped)
    assert mapped.retryable and "az://ctr/run/k.distcp" in str(mapped)


def test_broken_reads_are_decided_by_type_not_text() -> None:
    store = AzureBlobStore("ctr/run")
    text = "('Connection broken: IncompleteRead(0 bytes read, 1 more expected)', ...)"
    assert store.map_error(HttpResponseError(text), "k") is None  # no status, no cause
    assert store.map_error(_cut(ValueError(text)), "k") is None
    assert store.map_error(ValueError(text), "k") is None


def test_read_is_one_request_into_the_buffers(azurite: AzuriteServer) -> None:
    """Scatter reads (any buffer format), whole-object reads, short objects and ranges
    past the end; every read is one GET, and a finished one hands its connection back."""
    with FaultProxy(azurite.upstream) as proxy:
        be = dcpstore.open_backend(_uri("reads"), endpoint_url=f"{proxy.endpoint_url}/{ACCOUNT}",
                                   max_attempts=1)
        store: AzureBlobStore = be.store
        data = os.urandom(3 * PART + 5)
        be.put("k", data)
        be.put("empty", b"")
        proxy.reset_stats()
        head, body = bytearray(7), torch.zeros(PART // 4, dtype=torch.float32)
        assert store.read("k", 11, [memoryview(head), memoryview(body.numpy())]) is None
        assert bytes(head) == data[11:18] and body.numpy().tobytes() == data[18:18 + PART]
        assert store.read("k") == data and store.read("k", PART) == data[PART:]
        assert store.read("empty") == b""
        with pytest.raises(EOFError):
            store.read("k", len(data) - 3, [memoryview(bytearray(4))])
        with pytest.raises(EOFError):
            store.read("k", len(data) + 10, [memoryview(bytearray(4))])
        assert proxy.snapshot().total_requests == 6  # one GET per read, no retry
        proxy.plan = FaultPlan(rate=1.0, kinds=("truncate",), match=lambda i: i.kind == "GET")
        proxy.reset_stats()
        with pytest.raises(StoreUnavailableError):
            be.get("k")
        with pytest.raises(StoreUnavailableError):
            list(be.read_ranges([ReadRange("k", 5, PART)]))
        assert proxy.snapshot().faults["truncate"] == 2  # max_attempts=1: one GET each
        be.close()


def test_one_request_read_internals_match_the_pinned_sdk(azurite: AzuriteServer) -> None:
    """The internals the store's one-request reads lean on (see store._get) are there:
    the generated Get Blob, and the http.client response under urllib3's, read straight
    from the socket; an SDK upgrade that changes them fails here, not silently (slower
    or retrying)."""
    be = dcpstore.open_backend(_uri("rawget"))
    be.put("k", b"0123456789")
    blob = be.store._blob("k")
    assert callable(blob._client.blob.download)
    response = azure_store._get(blob, "bytes=2-5")
    assert response.status_code == 206
    raw = response.internal_response.raw
    assert isinstance(raw, urllib3.response.HTTPResponse)
    assert http_body.direct_response(raw) is raw._fp  # the zero-copy path is taken
    out = bytearray(8)
    assert azure_store._readinto(response, memoryview(out)) == 4 and out[:4] == b"2345"
    assert raw._fp_bytes_read == 4 and raw.length_remaining == 0
    assert raw._connection is None  # handed back to the pool
    assert azure_store._readinto(response, memoryview(out)) == 0
    response = azure_store._get(blob, None)
    raw = response.internal_response.raw
    assert http_body.direct_response(raw) is raw._fp
    assert azure_store._read_all(response) == b"0123456789" and raw._connection is None
    with pytest.raises(HttpResponseError) as info:
        azure_store._get(blob, "bytes=100-")
    assert info.value.status_code == 416
    be.close()


# -- credentials ------------------------------------------------------------------------------


def test_account_name_and_key_from_env(azurite: AzuriteServer,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", ACCOUNT_KEY)
    be = dcpstore.open_backend(_uri("keyenv"), endpoint_url=azurite.endpoint_url)
    be.put("k", b"v")
    assert be.get("k") == b"v"
    assert be.store.client_key()[2] == "account key"
    be.close()


def test_no_credentials_is_a_configuration_error() -> None:
    be = dcpstore.open_backend("az://ctr/x")
    with pytest.raises(ConfigurationError, match="AZURE_STORAGE_CONNECTION_STRING"):
        be.get("k")
    be.close()


def test_secrets_never_printed(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
    """The account key is in no repr, str, pickle, client key, error or log line."""
    caplog.set_level(logging.DEBUG)
    logging.getLogger("azure").setLevel(logging.DEBUG)
    uri = _uri("secrets")
    seen: list[str] = []
    for key in (ACCOUNT_KEY, SECRET_KEY):  # the right key, then a wrong one
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string(key=key))
        be = dcpstore.open_backend(uri)
        try:
            be.put("k", b"v")
            be.get("k")
        except PermissionError as exc:
            assert key == SECRET_KEY
            seen += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
        seen += [repr(be), str(be), repr(be.store), repr(be.options), repr(be.store.client_key()),
                 repr(pickle.dumps(be)), repr(vars(be.store))]
        be.close()
    out = io.StringIO()
    for record in caplog.records:
        out.write(record.getMessage())
    seen.append(out.getvalue())
    for text in seen:
        for key in (ACCOUNT_KEY, SECRET_KEY):
            assert key not in text and key[:20] not in text


# -- multi-process: FSDP2 saved on 2 gloo ranks, loaded at 1 ----------------------------------


def azure_fsdp_save(rank: int, world_size: int, uri: str, options: dict[str, Any],
                    reference: str) -> dict[str, Any]:
    from fsdp_workers import build, full_state, sharded_state, train

    model, optim = build(world_size, seed=1)
    train(model, optim, 1, seed=100)
    writer = dcpstore.get_writer(uri, **options)
    dcp.save(sharded_state(model, optim), storage_writer=writer)
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, reference)
    return {"coordinator": writer.is_coordinator,
            "store": type(getattr(writer.backend, "store", None)).__name__}


@pytest.mark.multiprocess
def test_fsdp2_save_2_ranks_load_at_1(azurite: AzuriteServer, tmp_path: Path) -> None:
    from s3_multiprocess import fsdp_load, run_ranks

    uri, opts = _uri("fsdp"), {"part_size": PART, "max_concurrency": 4}
    reference = str(tmp_path / "reference.pt")
    saved = run_ranks(azure_fsdp_save, 2, uri, opts, reference)
    assert [r["coordinator"] for r in saved] == [True, False]
    assert {r["store"] for r in saved} == {"AzureBlobStore"}
    loaded = run_ranks(fsdp_load, 1, uri, opts, reference)
    assert loaded[0]["mismatches"] == [], loaded[0]["mismatches"]
    assert loaded[0]["tensors_compared"] == 8 * 4  # 8 parameters + AdamW's 3 states each
    be = dcpstore.open_backend(uri)
    assert be.exists(".metadata")
    be.close()
