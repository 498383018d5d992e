"""S3 encryption at rest: SSE-C, SSE-S3 and SSE-KMS against real servers on 127.0.0.1.

What the stand-ins do (measured, see ``docs/encryption.md``):

- SeaweedFS enforces SSE-C: a GET or HEAD of an SSE-C object without the key answers 400
  (``InvalidArgument`` on GET, a bare 400 on HEAD), with a wrong key 403. It stores SSE-S3
  (echoes ``AES256`` on HEAD) and refuses SSE-KMS with a 500 (no KMS configured).
- moto 5.2 ignores SSE-C headers entirely (no check, no echo) and stores and echoes SSE-S3
  and SSE-KMS parameters without encrypting anything.

Where a server enforces, the tests load without and with a wrong key; everywhere they
count, per S3 operation, the requests that carried the headers (botocore's
``before-send`` event on the client the saves and loads share): every request kind that
touches object data, every multipart part and every ranged GET.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from botocore.exceptions import ClientError
from dcpstore_s3 import S3Options, S3Store
from dcpstore_s3.errors import to_store_error
from stores import S3_TEST_BUCKET

import dcpstore
from dcpstore.errors import AccessDeniedError, ConfigurationError
from dcpstore.testing.servers import S3Server, isolate_env

MiB = 1024 * 1024
KEY_HEADER = "x-amz-server-side-encryption-customer-key"
MD5_HEADER = "x-amz-server-side-encryption-customer-key-md5"
SSE_HEADER = "x-amz-server-side-encryption"


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_env(monkeypatch)




def _key_file(tmp_path: Path, *, b64: bool = False) -> tuple[Path, bytes]:
    key = secrets.token_bytes(32)
    path = tmp_path / f"sse-c-{uuid.uuid4().hex[:6]}.key"
    path.write_bytes(base64.b64encode(key) + b"\n" if b64 else key)
    return path, key


def _uri(area: str) -> str:
    return f"s3://{S3_TEST_BUCKET}/encryption/{area}/{uuid.uuid4().hex[:10]}"


class Sent:
    """Every request a store's client sends, by S3 operation, with its headers."""

    def __init__(self, uri: str, options: dict[str, Any]) -> None:
        # stores with the same client settings share one botocore client: hooking the
        # client of a store opened with the same options sees every save's and load's
        self.uri = uri
        self.backend = dcpstore.open_backend(uri, **options)
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.client = self.backend.client
        self.client.meta.events.register("before-send.s3", self._record)

    def _record(self, request: Any, event_name: str, **kwargs: Any) -> None:
        headers = {k.lower(): (v.decode() if isinstance(v, bytes) else str(v))
                   for k, v in request.headers.items()}
        self.requests.append((event_name.rsplit(".", 1)[-1], headers))

    def close(self) -> None:
        self.client.meta.events.unregister("before-send.s3", self._record)
        self.backend.close()

    def ops(self) -> Counter[str]:
        return Counter(op for op, _ in self.requests)

    def carrying(self, header: str, value: str | None = None) -> Counter[str]:
        return Counter(op for op, h in self.requests
                       if header in h and (value is None or h[header] == value))


@pytest.fixture
def sent() -> Iterator[list[Sent]]:
    hooks: list[Sent] = []
    yield hooks
    for hook in hooks:
        hook.close()


def _state() -> dict[str, Any]:
    """Several tensors in one 12 MiB data file (multipart at 5 MiB parts)."""
    return {f"t{i}": torch.randn(768 * 1024) for i in range(4)}  # 4 x 3 MiB


def _empty() -> dict[str, Any]:
    return {f"t{i}": torch.zeros(768 * 1024) for i in range(4)}


# multipart uploads of 5 MiB parts, every tensor read by its own ranged GET
SMALL_PARTS: dict[str, Any] = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}
ONE_FILE: dict[str, Any] = {"files_per_rank": 1}
RANGED: dict[str, Any] = {"coalesce_gap": 0, "max_range": 1 * MiB}


def _round_trip(tag: str, options: dict[str, Any], sent: list[Sent],
                **load_options: Any) -> Sent:
    """Save :func:`_state` in one data file and load it back bit-exact, every request
    recorded by the returned hook."""
    uri = _uri(tag)
    hook = Sent(uri, options)
    sent.append(hook)
    state = _state()
    dcpstore.save(state, uri, **options, **ONE_FILE)
    out = _empty()
    dcpstore.load(out, uri, **options, **load_options)
    assert all(torch.equal(out[k], state[k]) for k in state)
    return hook


# -- SSE-C ------------------------------------------------------------------------------


def test_sse_c_key_on_every_object_request(s3: S3Server, tmp_path: Path,
                                           sent: list[Sent]) -> None:
    """Every request touching object data carries the key and its MD5: the single
    PutObjects, CreateMultipartUpload, each part, CompleteMultipartUpload, each ranged
    GET, HeadObject; listings and deletes carry none."""
    path, key = _key_file(tmp_path)
    options: dict[str, Any] = {"endpoint_url": s3.endpoint_url,
                               "sse_customer_key_file": str(path), **SMALL_PARTS}
    hook = _round_trip("sse-c", options, sent, **RANGED)
    data_file = next(i.key for i in hook.backend.list() if i.key.endswith(".distcp"))
    assert hook.backend.stat(data_file).size >= 12 * MiB  # HeadObject

    b64 = base64.b64encode(key).decode()
    md5 = base64.b64encode(hashlib.md5(key).digest()).decode()
    ops = hook.ops()
    with_key = hook.carrying(KEY_HEADER, b64)
    assert hook.carrying(MD5_HEADER, md5) == with_key
    assert ops["UploadPart"] >= 3 and ops["CreateMultipartUpload"] >= 1
    assert ops["CompleteMultipartUpload"] >= 1 and ops["PutObject"] >= 1
    assert ops["HeadObject"] >= 1
    ranged = [h for op, h in hook.requests if op == "GetObject" and "range" in h]
    assert len(ranged) >= 4, ops  # one ranged GET per tensor (none coalesced)
    assert all(h.get(KEY_HEADER) == b64 for h in ranged)
    for op in ("PutObject", "CreateMultipartUpload", "UploadPart",
               "CompleteMultipartUpload", "GetObject", "HeadObject"):
        assert with_key[op] == ops[op], (op, with_key[op], ops[op])
    for op in ("ListObjectsV2", "DeleteObjects", "ListMultipartUploads"):
        assert with_key[op] == 0
    assert not hook.carrying(SSE_HEADER)  # SSE-C alone, no SSE-S3/KMS header


def test_sse_c_enforced_by_seaweedfs(seaweed: S3Server, tmp_path: Path) -> None:
    """SeaweedFS refuses reads without the key (400) and with a wrong key (403): both are
    an AccessDeniedError naming the option, not an integrity error."""
    path, _ = _key_file(tmp_path, b64=True)  # base64 in the file works too
    base: dict[str, Any] = {"endpoint_url": seaweed.endpoint_url, "max_attempts": 2,
                            **SMALL_PARTS}
    uri = _uri("sse-c-enforced")
    state = _state()
    dcpstore.save(state, uri, sse_customer_key_file=str(path), **base, **ONE_FILE)
    out = _empty()
    dcpstore.load(out, uri, sse_customer_key_file=str(path), **base, **RANGED)
    assert all(torch.equal(out[k], state[k]) for k in state)

    with pytest.raises(AccessDeniedError, match="sse_customer_key_file") as no_key:
        dcpstore.load(_empty(), uri, **base)
    assert "IntegrityError" not in repr(no_key.value)
    wrong, _ = _key_file(tmp_path)
    with pytest.raises(AccessDeniedError, match="sse_customer_key_file") as bad:
        dcpstore.load(_empty(), uri, sse_customer_key_file=str(wrong), **base)
    assert "not the one the object was written with" in str(bad.value)
    # a HEAD has no error body: a bare 400 is told as the missing key too
    plain = dcpstore.open_backend(uri, endpoint_url=seaweed.endpoint_url, max_attempts=1)
    data_file = next(i.key for i in plain.list() if i.key.endswith(".distcp"))
    with pytest.raises(AccessDeniedError, match="sse_customer_key_env"):
        plain.stat(data_file)
    plain.close()


def test_sse_c_key_from_environment_and_uri_query(seaweed: S3Server,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable's name comes as ``DCPSTORE_S3_SSE_CUSTOMER_KEY_ENV`` or in the URI
    query; the key itself only ever from the variable."""
    key = secrets.token_bytes(32)
    monkeypatch.setenv("CKPT_SSE_KEY", base64.b64encode(key).decode())
    monkeypatch.setenv("DCPSTORE_S3_SSE_CUSTOMER_KEY_ENV", "CKPT_SSE_KEY")
    base = {"endpoint_url": seaweed.endpoint_url, "max_attempts": 2}
    uri = _uri("sse-c-env")
    dcpstore.save({"w": torch.arange(100)}, uri, **base)
    monkeypatch.delenv("DCPSTORE_S3_SSE_CUSTOMER_KEY_ENV")
    with pytest.raises(AccessDeniedError, match="sse_customer_key_env"):
        dcpstore.load({"w": torch.zeros(100, dtype=torch.int64)}, uri, **base)
    out = {"w": torch.zeros(100, dtype=torch.int64)}
    dcpstore.load(out, f"{uri}?sse_customer_key_env=CKPT_SSE_KEY", **base)
    assert torch.equal(out["w"], torch.arange(100))
    raw = boto3.client("s3", endpoint_url=seaweed.endpoint_url)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    head = raw.head_object(Bucket=bucket, Key=f"{prefix}/.metadata",
                           SSECustomerAlgorithm="AES256", SSECustomerKey=key)
    assert head["SSECustomerAlgorithm"] == "AES256"


# -- SSE-S3 and SSE-KMS ----------------------------------------------------------------------


def _head(server: S3Server, uri: str, name: str) -> dict[str, Any]:
    raw = boto3.client("s3", endpoint_url=server.endpoint_url)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    key = next(o["Key"] for o in raw.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
               if o["Key"].endswith(name))
    return raw.head_object(Bucket=bucket, Key=key)


def test_sse_s3_stored(s3: S3Server, sent: list[Sent]) -> None:
    """``sse=AES256`` goes on PutObject and CreateMultipartUpload (not on parts or reads);
    both servers store it and echo it on HEAD."""
    options = {"endpoint_url": s3.endpoint_url, "sse": "AES256", **SMALL_PARTS}
    hook = _round_trip("sse-s3", options, sent)
    ops, with_sse = hook.ops(), hook.carrying(SSE_HEADER, "AES256")
    assert with_sse["PutObject"] == ops["PutObject"] >= 1
    assert with_sse["CreateMultipartUpload"] == ops["CreateMultipartUpload"] >= 1
    assert ops["UploadPart"] >= 3 and sum(with_sse.values()) == (
        ops["PutObject"] + ops["CreateMultipartUpload"])
    assert _head(s3, hook.uri, ".distcp")["ServerSideEncryption"] == "AES256"
    assert _head(s3, hook.uri, ".metadata")["ServerSideEncryption"] == "AES256"


def test_sse_kms_parameters_sent_and_stored_by_moto(moto: S3Server, sent: list[Sent],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """SSE-KMS with key id, encryption context and bucket key: sent on every write
    (moto stores them; it encrypts nothing and checks no KMS permission). Options from
    ``DCPSTORE_S3_*`` variables."""
    monkeypatch.setenv("DCPSTORE_S3_SSE", "aws:kms")
    monkeypatch.setenv("DCPSTORE_S3_SSE_KMS_KEY_ID", "alias/dcpstore-test")
    monkeypatch.setenv("DCPSTORE_S3_SSE_KMS_CONTEXT", '{"project": "llm"}')
    monkeypatch.setenv("DCPSTORE_S3_SSE_BUCKET_KEY", "true")
    options = {"endpoint_url": moto.endpoint_url, **SMALL_PARTS}
    uri = _uri("sse-kms")
    hook = Sent(uri, options)
    sent.append(hook)
    dcpstore.save(_state(), uri, **options, **ONE_FILE)
    context = base64.b64encode(b'{"project": "llm"}').decode()
    ops = hook.ops()
    writes = [h for op, h in hook.requests if op in ("PutObject", "CreateMultipartUpload")]
    assert len(writes) == ops["PutObject"] + ops["CreateMultipartUpload"] >= 2
    for h in writes:
        assert h[SSE_HEADER] == "aws:kms"
        assert h["x-amz-server-side-encryption-aws-kms-key-id"] == "alias/dcpstore-test"
        assert h["x-amz-server-side-encryption-context"] == context
        assert h["x-amz-server-side-encryption-bucket-key-enabled"] == "true"
    assert sum(hook.carrying(SSE_HEADER).values()) == len(writes)  # not on parts or reads
    head = _head(moto, uri, ".distcp")
    assert head["ServerSideEncryption"] == "aws:kms"
    assert head["SSEKMSKeyId"] == "alias/dcpstore-test"


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "match"), [
    ({"sse": "aws:kmsx"}, "sse must be one of"),
    ({"sse": "aes256"}, "sse must be one of"),
    ({"sse_kms_key_id": "alias/k"}, "apply to SSE-KMS only"),
    ({"sse": "AES256", "sse_bucket_key": True}, "apply to SSE-KMS only"),
    ({"sse": "aws:kms", "sse_kms_context": "[1]"}, "JSON object of strings"),
    ({"sse": "aws:kms", "sse_kms_context": "{not json"}, "JSON object of strings"),
    ({"sse_customer_key_file": "/nonexistent/dcpstore.key"}, "cannot read"),
    ({"sse_customer_key_env": "DCPSTORE_TEST_NO_SUCH_VAR"}, "is not set"),
])
def test_bad_encryption_options_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        dcpstore.open_backend(f"s3://{S3_TEST_BUCKET}/x", **options)


def test_bad_customer_keys_refused_without_echo(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    short = tmp_path / "short.key"
    secret_text = base64.b64encode(secrets.token_bytes(31)).decode()
    short.write_text(secret_text)
    good, _ = _key_file(tmp_path)
    monkeypatch.setenv("CKPT_KEY", secret_text)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"sse_customer_key_file": str(short)}, "256-bit"),
        ({"sse_customer_key_env": "CKPT_KEY"}, "256-bit"),
        ({"sse_customer_key_file": str(good), "sse_customer_key_env": "CKPT_KEY"},
         "only one of"),
        ({"sse_customer_key_file": str(good), "sse": "AES256"}, "excludes"),
    ]
    for options, match in cases:
        with pytest.raises(ConfigurationError, match=match) as err:
            dcpstore.open_backend(f"s3://{S3_TEST_BUCKET}/x", **options)
        assert secret_text not in str(err.value)
    # from the URI query too: an unknown value is an error, not ignored
    with pytest.raises(ConfigurationError, match="sse must be one of"):
        dcpstore.open_backend(f"s3://{S3_TEST_BUCKET}/x?sse=aws:kmsx")


def test_options_repr_and_pickle_hold_no_key(tmp_path: Path, moto: S3Server) -> None:
    import pickle

    path, key = _key_file(tmp_path)
    backend = dcpstore.open_backend(_uri("pickle"), endpoint_url=moto.endpoint_url,
                                    sse_customer_key_file=str(path))
    backend.put("k", b"v")
    b64 = base64.b64encode(key).decode()
    store = backend.store
    assert isinstance(store, S3Store)
    for text in (repr(backend), repr(store.options), str(store.options)):
        assert b64 not in text
    blob = pickle.dumps(backend)
    assert key not in blob and b64.encode() not in blob
    assert pickle.loads(blob).get("k") == b"v"  # the other process reads its own key
    backend.close()


# -- AWS's answers (no stand-in gives them): the translation ---------------------------------


def _error(code: str, status: int, message: str, op: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": status, "RequestId": "r1"}}, op)


@pytest.mark.parametrize(("exc", "configured", "match"), [
    # AWS: GET of an SSE-C object without the key
    (_error("InvalidRequest", 400, "The object was stored using a form of Server Side "
            "Encryption. The correct parameters must be provided to retrieve the object.",
            "GetObject"), False, "set sse_customer_key_file or sse_customer_key_env"),
    # AWS: an SSE-C key on an object stored without one
    (_error("InvalidRequest", 400, "The encryption parameters are not applicable to this "
            "object.", "GetObject"), True, "not encrypted with a customer-provided key"),
    (_error("AccessDenied", 403, "Access Denied", "GetObject"), True,
     "not the one the object was written with"),
    (_error("KMS.NotFoundException", 400, "Invalid keyId", "PutObject"), False,
     "sse_kms_key_id"),
    (_error("AccessDenied", 403, "User is not authorized to perform: kms:Decrypt",
            "GetObject"), False, "kms:Decrypt"),
])
def test_aws_encryption_answers_are_access_denied(exc: ClientError, configured: bool,
                                                  match: str, tmp_path: Path) -> None:
    options = S3Options()
    if configured:
        options.sse_customer_key_file = str(_key_file(tmp_path)[0])
    error = to_store_error(exc, where="s3://b/k", bucket="b", endpoint=None, options=options)
    assert isinstance(error, AccessDeniedError) and not error.retryable
    assert match in str(error)


def test_kms_unavailable_on_seaweedfs_is_not_silent(seaweed: S3Server) -> None:
    """SeaweedFS without a KMS answers SSE-KMS writes with a 500: the save fails (after
    its retries), it never stores the object unencrypted."""
    uri = _uri("kms-seaweedfs")
    with pytest.raises(OSError):
        dcpstore.save({"w": torch.ones(4)}, uri, endpoint_url=seaweed.endpoint_url,
                      sse="aws:kms", max_attempts=1)
    assert not dcpstore.open_backend(uri, endpoint_url=seaweed.endpoint_url).list()


def test_key_file_is_read_per_process(tmp_path: Path) -> None:
    """Only the path is an option: the store holds no key until it sends a request."""
    path, _ = _key_file(tmp_path)
    store = S3Store(f"{S3_TEST_BUCKET}/x", S3Options(sse_customer_key_file=str(path)))
    assert store._sse is None
    assert os.fspath(path) in repr(store.options)
