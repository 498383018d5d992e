"""The S3 backend: ``s3://bucket/prefix`` (and ``s3a://``) over botocore.

Every primitive of :class:`dcpstore.Backend` maps onto one or a few S3 requests:

=====================  ================================================================
primitive              S3 requests
=====================  ================================================================
``open_upload``        ``CreateMultipartUpload`` (when the first part is full),
                       ``UploadPart`` x N (concurrently, while later parts are being
                       serialized), ``CompleteMultipartUpload``; an object smaller than
                       one part is a single ``PutObject``; abort is
                       ``AbortMultipartUpload``
``read_ranges``        one ranged ``GetObject`` (``Range: bytes=a-b``) per range,
                       streamed straight into the caller's buffer
``put`` / ``get``      ``PutObject`` (atomic on S3) / ``GetObject``
``stat``               ``HeadObject``
``list``               ``ListObjectsV2`` (paginated)
``delete``             ``DeleteObjects`` (batches of 1000)
``list_uploads``       ``ListMultipartUploads``
=====================  ================================================================

The client is botocore's (thread-safe; the backend's worker threads share one), created
lazily so the backend pickles without it. botocore's own retries are switched off: the
base class retries every request with exponential backoff and jitter (``max_attempts``,
``retry_backoff``) on throttling (503 SlowDown, 429, ``Throttling*``), 500/502/504 and
dropped connections, so attempts are never multiplied. Every request has a connect and
a read timeout.

Prefix strategy ``hash``: S3 scales request rates per key prefix. With
``prefix_strategy="hash"`` the data files (``__*.distcp``) of a checkpoint are stored
under ``<root>/<hh>/<name>``, ``hh`` being two hex digits of a hash of the file name,
so the ranks' parallel uploads and reads spread over 256 prefixes. The mapping is done
inside every primitive, so the *logical* key space (what ``.metadata`` and the manifest
record, what ``list`` returns) is unchanged and the checkpoint loads by its root URI.
Reads of a data file fall back to the other layout when the object is missing, so a
checkpoint loads whichever strategy wrote it (torch's own ``FsspecReader`` does not know
the mapping: keep the default ``"none"`` for checkpoints it must read).
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import io
import logging
import re
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import botocore
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
)

from dcpstore.backend import Backend, BackendOptions, ObjectInfo, Upload
from dcpstore.errors import StoreTimeoutError
from dcpstore.multipart import MultipartUpload
from dcpstore.redact import install_log_redaction, redact
from dcpstore.uri import validate_key

__all__ = [
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "S3Backend",
    "S3MultipartUpload",
    "S3Options",
]

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
#: S3's smallest part (all parts but the last).
MIN_PART_SIZE = 5 * MiB
#: S3's largest part.
MAX_PART_SIZE = 5 * 1024 * MiB
#: S3's limit of parts per multipart upload.
MAX_PARTS = 10_000
#: Keys per ``DeleteObjects`` request (S3's limit).
_DELETE_BATCH = 1000

_ADDRESSING_STYLES = ("auto", "path", "virtual")
_PREFIX_STRATEGIES = ("none", "hash")

#: Error codes that mean "slow down / try again".
_RETRYABLE_CODES = frozenset({
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "ProvisionedThroughputExceededException",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeoutException",
    "PriorRequestNotComplete",
    "EC2ThrottledException",
})
_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_DENIED_CODES = frozenset({
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidSecurity",
    "RequestTimeTooSkewed",
})

_DATA_FILE = re.compile(r"^__[^/]*\.distcp$")
_HASHED_DATA_FILE = re.compile(
    r"^(?P<dir>(?:.*/)?)(?P<hash>[0-9a-f]{2})/(?P<name>__[^/]*\.distcp)$"
)


@dataclass
class S3Options(BackendOptions):
    """Options of the S3 backend.

    Set them as keyword arguments (``dcpstore.get_writer(uri, region="eu-west-1")``), in
    the URI query (``s3://bucket/path?region=eu-west-1``) or as environment variables
    (``DCPSTORE_S3_REGION=eu-west-1``), in that order of precedence. Credentials are
    never options: they come from the standard AWS chain (environment, shared
    config/credentials files, ``profile``, SSO, instance/container roles).

    Attributes:
        endpoint_url: S3 endpoint, e.g. ``http://127.0.0.1:8333`` for SeaweedFS or
            MinIO. Default: botocore's resolution (``AWS_ENDPOINT_URL_S3``,
            ``AWS_ENDPOINT_URL``, the profile's ``endpoint_url``, else AWS).
        region: AWS region. Default: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the
            profile's region.
        profile: Named profile of the shared AWS config files (default ``AWS_PROFILE``).
        addressing_style: ``"path"`` (``endpoint/bucket/key``), ``"virtual"``
            (``bucket.endpoint/key``) or ``"auto"`` (botocore decides).
        anonymous: Send unsigned requests (public buckets); no credentials are looked up.
        unsigned_payload: Do not SHA-256 the request bodies for the signature over
            HTTPS (TLS already protects them, and dcpstore's manifest CRC32C verifies
            every byte end to end); saves a full pass over the data. botocore always
            signs payloads over plain HTTP, whatever this says.
        prefix_strategy: ``"none"``: data files live directly under the checkpoint
            root, as torch writes them. ``"hash"``: data files are spread over 256
            hashed sub-prefixes (``<root>/<hh>/__0_0.<id>.distcp``) to multiply S3's
            per-prefix request rate limits; transparent to dcpstore, not to torch's
            ``FsspecReader``.
        connect_timeout: Seconds to establish a connection.
        timeout: Seconds a request may wait for the server (per socket read) before it
            is abandoned and retried.
        max_attempts: Attempts per request, the first included (dcpstore retries with
            exponential backoff and jitter; botocore's own retries are off).
        part_size: Bytes per multipart-upload part (5 MiB .. 5 GiB). Objects smaller
            than one part are a single ``PutObject``. Largest object: part_size x 10,000.
        max_concurrency: Requests in flight at once per process: upload parts and
            ranged reads. Memory bound of a save: about ``part_size x
            (max_concurrency + files_per_rank)`` (parts in flight plus the part each
            open upload is filling); up to ``max_concurrency + 2`` part buffers are kept
            for reuse until the backend is closed (``dcpstore.save`` closes it).
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str = "auto"
    anonymous: bool = False
    unsigned_payload: bool = True
    prefix_strategy: str = "none"
    connect_timeout: float = 10.0
    timeout: float = 60.0
    max_attempts: int = 6
    part_size: int = 32 * MiB
    max_concurrency: int = 8

    def validate(self) -> None:
        """Raise ``ValueError`` for values S3 would refuse or that make no sense."""
        super().validate()
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ValueError(
                f"part_size must be between 5 MiB ({MIN_PART_SIZE}) and 5 GiB "
                f"({MAX_PART_SIZE}) for S3 multipart uploads, got {self.part_size}"
            )
        if self.addressing_style not in _ADDRESSING_STYLES:
            raise ValueError(
                f"addressing_style must be one of {', '.join(_ADDRESSING_STYLES)}, "
                f"got {self.addressing_style!r}"
            )
        if self.prefix_strategy not in _PREFIX_STRATEGIES:
            raise ValueError(
                f"prefix_strategy must be one of {', '.join(_PREFIX_STRATEGIES)}, "
                f"got {self.prefix_strategy!r}"
            )
        if self.connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0, got {self.connect_timeout}")
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    "endpoint_url must be an http:// or https:// URL with a host, e.g. "
                    "http://127.0.0.1:8333"
                )
            if parts.username is not None or parts.password is not None:
                # never echo it: it carries a secret
                raise ValueError(
                    "endpoint_url carries credentials; credentials never belong in a URL. "
                    "Use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role."
                )


def _name_hash(name: str) -> str:
    """Two hex digits spreading data files over 256 prefixes (stable across processes)."""
    return hashlib.sha256(name.encode()).hexdigest()[:2]


def hashed_key(key: str) -> str:
    """The physical key of a data file under the ``hash`` prefix strategy."""
    head, _, name = key.rpartition("/")
    return f"{head}/{_name_hash(name)}/{name}" if head else f"{_name_hash(name)}/{name}"


def logical_key(physical: str) -> str:
    """Undo :func:`hashed_key` (keys that are not hashed data files are unchanged)."""
    m = _HASHED_DATA_FILE.match(physical)
    if m is not None and _name_hash(m.group("name")) == m.group("hash"):
        return m.group("dir") + m.group("name")
    return physical


def is_data_file(key: str) -> bool:
    """Whether ``key`` names a DCP data file (``__*.distcp``)."""
    return bool(_DATA_FILE.match(key.rpartition("/")[2]))


def _error_info(exc: ClientError) -> tuple[str, int | None, str | None, str]:
    """``(code, http_status, request_id, message)`` of a botocore ``ClientError``."""
    response: dict[str, Any] = getattr(exc, "response", None) or {}
    error = response.get("Error") or {}
    meta = response.get("ResponseMetadata") or {}
    status = meta.get("HTTPStatusCode")
    code = str(error.get("Code") or status or "Unknown")
    request_id = meta.get("RequestId") or (meta.get("HTTPHeaders") or {}).get("x-amz-request-id")
    message = str(error.get("Message") or "").strip()
    return code, status if isinstance(status, int) else None, request_id, message


def _redact_url(url: str | None) -> str:
    """An endpoint URL fit for messages: scheme, host and port only."""
    if not url:
        return "the default AWS endpoint"
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def _readinto(body: Any, out: memoryview) -> int:
    """``body.readinto(out)``, straight from the socket when possible.

    urllib3's ``readinto`` reads into a temporary ``bytes`` (which http.client itself
    fills through a zeroed temporary) and copies that into ``out``: three extra passes
    over every byte. For a plain (not chunked, not content-encoded) response the
    underlying http.client response fills ``out`` directly; urllib3's byte accounting
    and connection release are kept as its own ``read`` keeps them.
    """
    raw: Any = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if (not isinstance(fp, http.client.HTTPResponse) or fp.chunked
            or raw.headers.get("content-encoding") or not hasattr(raw, "_fp_bytes_read")):
        return int(body.readinto(out))
    try:
        n = fp.readinto(out)
    except TimeoutError as exc:
        raise ReadTimeoutError(endpoint_url="", error=exc) from exc
    except (http.client.HTTPException, OSError) as exc:
        raise ResponseStreamingError(error=exc) from exc
    raw._fp_bytes_read += n
    if raw.length_remaining is not None:
        raw.length_remaining -= n
        if not n and len(out) and raw.length_remaining > 0:  # connection cut short
            raise ResponseStreamingError(error=http.client.IncompleteRead(
                b"", raw.length_remaining))
    if fp.isclosed():  # all of it read: hand the connection back to the pool
        raw.release_conn()
    return n


class _PartStream(io.RawIOBase):
    """A seekable, read-only stream over a view: what the signer reads a part through.

    Upload bodies are passed to botocore as the part's ``memoryview`` itself (see
    :func:`_install_body_handlers`): urllib3 then hands the whole view to one
    ``sendall``, with no copy and no ``Expect: 100-continue`` round trip, which botocore
    adds for file-like bodies. Signing is the exception: botocore's CRT signer (used
    whenever ``awscrt`` is installed) wraps any body that is not ``bytes`` or a stream in
    a ``BytesIO``, a copy of the whole part. So just for signing the body is this stream
    (hashed through ``readinto`` in small blocks), and it is swapped back afterwards.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._view)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = len(self._view) + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        start = min(self._pos, len(self._view))
        end = len(self._view) if size is None or size < 0 else min(len(self._view),
                                                                    start + size)
        self._pos = max(self._pos, end)
        return self._view[start:end].tobytes()

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        start = min(self._pos, len(self._view))
        n = min(len(out), len(self._view) - start)
        out[:n] = self._view[start:start + n]
        self._pos = start + n
        return n


_SIGNED_BODY = "dcpstore_body"


def _body_to_stream(request: Any, **kwargs: Any) -> None:
    """``before-sign``: let the signer read a view body through a stream (no copy)."""
    body = request.data  # AWSRequest.body is derived from it
    if isinstance(body, memoryview):
        request.context[_SIGNED_BODY] = body
        request.data = _PartStream(body)


def _stream_to_body(request: Any, **kwargs: Any) -> None:
    """``request-created``, after signing: send the view itself again."""
    body = request.context.pop(_SIGNED_BODY, None)
    if body is not None:
        request.data = body


def _install_body_handlers(client: Any) -> None:
    """Send upload bodies as views: one ``sendall`` each, signed through a stream."""
    events = client.meta.events
    events.register("before-sign.s3", _body_to_stream)
    events.register_last("request-created.s3", _stream_to_body)


class S3MultipartUpload(MultipartUpload):
    """A streaming S3 multipart upload (parts uploaded concurrently by the backend)."""

    backend: S3Backend

    def __init__(self, backend: S3Backend, key: str) -> None:
        super().__init__(backend, key)
        self.physical_key = backend._physical(key)

    def _create(self) -> str:
        response = self.backend._request(
            "create_multipart_upload", Bucket=self.backend.bucket, Key=self.physical_key
        )
        upload_id = str(response["UploadId"])
        logger.debug("s3://%s/%s: multipart upload started", self.backend.bucket,
                     self.physical_key)
        return upload_id

    def _upload_part(self, upload_id: str, number: int, data: memoryview) -> Any:
        if number > MAX_PARTS:
            raise OSError(
                errno.EFBIG,
                f"s3://{self.backend.bucket}/{self.physical_key}: more than {MAX_PARTS} "
                f"parts of {self.part_size} bytes; raise part_size (largest object: "
                "part_size x 10,000)",
            )
        response = self.backend._request(
            "upload_part", Bucket=self.backend.bucket, Key=self.physical_key,
            UploadId=upload_id, PartNumber=number, Body=data.cast("B"),
            ContentLength=len(data), _bytes_out=len(data),
        )
        return response["ETag"]

    def _complete(self, upload_id: str, parts: list[tuple[int, Any]]) -> None:
        try:
            self.backend._request(
                "complete_multipart_upload", Bucket=self.backend.bucket,
                Key=self.physical_key, UploadId=upload_id,
                MultipartUpload={"Parts": [{"ETag": tag, "PartNumber": n} for n, tag in parts]},
            )
        except ClientError as exc:
            # a retry after a completion whose response was lost: the object is there
            if _error_info(exc)[0] != "NoSuchUpload" or not self._stored_whole():
                raise

    def _stored_whole(self) -> bool:
        try:
            head = self.backend._request("head_object", Bucket=self.backend.bucket,
                                         Key=self.physical_key)
        except ClientError as exc:
            if _is_not_found(exc):
                return False
            raise  # e.g. throttled: retry the completion, do not fail it for good
        return int(head.get("ContentLength", -1)) == self._size

    def _abort_multipart(self, upload_id: str) -> None:
        try:
            self.backend._request(
                "abort_multipart_upload", Bucket=self.backend.bucket,
                Key=self.physical_key, UploadId=upload_id,
            )
        except ClientError as exc:
            if _error_info(exc)[0] != "NoSuchUpload":
                raise
        logger.debug("s3://%s/%s: multipart upload aborted", self.backend.bucket,
                     self.physical_key)

    def _put_whole(self, data: memoryview) -> None:
        self.backend._request(
            "put_object", Bucket=self.backend.bucket, Key=self.physical_key,
            Body=data.cast("B"), ContentLength=len(data), _bytes_out=len(data),
        )


class S3Backend(Backend):
    """Objects under ``s3://bucket/prefix``. URI forms: ``s3://bucket/path``,
    ``s3a://bucket/path`` (Hadoop's spelling), options in the query string.

    Attributes:
        bucket: The bucket.
        root: Key prefix of the checkpoint root (``""`` or ending in ``/``).
    """

    Options = S3Options
    name = "s3"
    schemes = ("s3", "s3a")
    options: S3Options

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        super().__init__(location, options)
        bucket, _, prefix = location.partition("/")
        if not bucket:
            raise ValueError(f"S3 location {location!r} names no bucket")
        self.bucket = bucket
        prefix = prefix.strip("/")
        self.root = prefix + "/" if prefix else ""
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._bytes_in = 0
        self._bytes_out = 0

    # -- pickling / lifecycle ------------------------------------------------------------

    def _lazy_attributes(self) -> Sequence[str]:
        return ("_client",)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_client_lock", None)
        state.pop("_stats_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._client_lock = threading.Lock()
        self._stats_lock = threading.Lock()

    def close(self) -> None:
        """Release worker threads and the HTTP connection pool (recreated on use)."""
        super().close()
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # closing must never fail a caller
                logger.debug("closing the S3 client failed: %s", exc)

    # -- statistics ----------------------------------------------------------------------

    @property
    def request_counts(self) -> dict[str, int]:
        """S3 requests this backend issued (every attempt), by API operation name."""
        with self._stats_lock:
            return dict(self._counts)

    @property
    def bytes_read(self) -> int:
        """Object bytes received by ``GetObject`` requests."""
        return self._bytes_in

    @property
    def bytes_written(self) -> int:
        """Object bytes sent by ``PutObject`` / ``UploadPart`` requests."""
        return self._bytes_out

    def reset_stats(self) -> None:
        """Zero :attr:`request_counts`, :attr:`bytes_read` and :attr:`bytes_written`."""
        with self._stats_lock:
            self._counts.clear()
            self._bytes_in = 0
            self._bytes_out = 0

    def _count(self, operation: str, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._stats_lock:
            self._counts[operation] += 1
            self._bytes_in += bytes_in
            self._bytes_out += bytes_out

    # -- client ----------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The botocore S3 client (created on first use; thread-safe)."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        o = self.options
        session = botocore.session.Session(profile=o.profile)
        session.register_component("data_loader", _shared_loader())
        _install_log_redaction()
        config = Config(
            region_name=o.region,
            signature_version=botocore.UNSIGNED if o.anonymous else None,
            connect_timeout=o.connect_timeout,
            read_timeout=o.timeout,
            # dcpstore retries (with backoff and jitter); botocore must not multiply them
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=o.max_concurrency + 8,
            tcp_keepalive=True,
            s3={
                "addressing_style": o.addressing_style,
                "payload_signing_enabled": not o.unsigned_payload,
            },
            # integrity is dcpstore's CRC32C manifest, end to end; per-request checksum
            # trailers cost a pass over the data and trip up some S3-compatible stores
            request_checksum_calculation="when_required",
            # bodies are memoryviews (sent without a copy), which botocore's parameter
            # validation does not know; every parameter is built by this module
            parameter_validation=False,
            response_checksum_validation="when_required",
            user_agent_extra="dcpstore-s3",
        )
        client = session.create_client("s3", endpoint_url=o.endpoint_url, config=config)
        _install_body_handlers(client)
        resolved = urlsplit(str(client.meta.endpoint_url))
        if resolved.username is not None or resolved.password is not None:
            client.close()  # e.g. AWS_ENDPOINT_URL_S3=http://user:pass@host; never echo it
            raise ValueError(
                "the S3 endpoint URL (from the environment or the AWS config) carries "
                "credentials; credentials never belong in a URL. Use AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, a profile or a role."
            )
        logger.debug(
            "S3 client for s3://%s: endpoint %s, region %s, addressing %s, anonymous %s, "
            "unsigned payload %s", self.bucket, _redact_url(client.meta.endpoint_url),
            client.meta.region_name, o.addressing_style, o.anonymous, o.unsigned_payload,
        )
        return client

    def _request(self, operation: str, *, _bytes_out: int = 0, **params: Any) -> Any:
        """One S3 API call (no retries here: the caller is inside ``Backend._call``)."""
        self._count(operation, bytes_out=_bytes_out)
        return getattr(self.client, operation)(**params)

    # -- key mapping -------------------------------------------------------------------

    def _physical(self, key: str) -> str:
        """The S3 key storing logical ``key`` (see the prefix strategy)."""
        if self.options.prefix_strategy == "hash" and is_data_file(key):
            return self.root + hashed_key(key)
        return self.root + key

    def _alternative(self, key: str) -> str | None:
        """Where a data file lives under the *other* prefix strategy (read fallback)."""
        if not is_data_file(key):
            return None
        if self.options.prefix_strategy == "hash":
            return self.root + key
        return self.root + hashed_key(key)

    def _logical(self, physical: str) -> str:
        return logical_key(physical[len(self.root):])

    def _url(self, key: str | None) -> str:
        if key is None:
            return f"s3://{self.bucket}/{self.root}".rstrip("/")
        return f"s3://{self.bucket}/{self._physical(key)}"

    def _with_fallback(self, key: str, fn: Any) -> Any:
        """Call ``fn(physical_key)``; for a missing data file, once more at the
        key of the other prefix strategy."""
        try:
            return fn(self._physical(key))
        except ClientError as exc:
            other = self._alternative(key)
            if other is None or not _is_not_found(exc):
                raise
            try:
                return fn(other)
            except ClientError as exc2:
                if _is_not_found(exc2):
                    raise exc from None
                raise

    # -- primitives --------------------------------------------------------------------

    def _open_upload(self, key: str) -> Upload:
        return S3MultipartUpload(self, key)

    def _read_into(self, key: str, offset: int, out: memoryview) -> None:
        self._read_into_scatter(key, offset, [out])

    def _read_into_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        def fetch(physical: str) -> None:
            self._get_range(physical, offset, outs)

        self._with_fallback(key, fetch)

    def _get_range(self, physical: str, offset: int, outs: Sequence[memoryview]) -> None:
        length = sum(len(o) for o in outs)
        try:
            response = self._request(
                "get_object", Bucket=self.bucket, Key=physical,
                Range=f"bytes={offset}-{offset + length - 1}",
            )
        except ClientError as exc:
            if _error_info(exc)[0] == "InvalidRange":
                raise EOFError(
                    f"s3://{self.bucket}/{physical} is shorter than {offset + length} bytes "
                    f"(requested {length} bytes from offset {offset}; object truncated?)"
                ) from None
            raise
        body = response["Body"]
        try:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 200 and offset:
                _skip(body, offset)  # a store that ignored the Range header
            pos = 0
            for out in outs:  # one response body, read straight into each buffer in turn
                filled = 0
                while filled < len(out):
                    n = _readinto(body, out[filled:])
                    if not n:
                        break
                    filled += n
                pos += filled
                if filled < len(out):
                    break
            with self._stats_lock:
                self._bytes_in += pos
            if pos < length:
                raise EOFError(
                    f"s3://{self.bucket}/{physical} ends at byte {offset + pos}, expected "
                    f"{length} bytes from offset {offset} (object truncated?)"
                )
        finally:
            body.close()

    def _put(self, key: str, data: bytes, *, atomic: bool) -> None:
        # A single PutObject is atomic on S3: readers see the old object or the new one.
        self._request("put_object", Bucket=self.bucket, Key=self._physical(key),
                      Body=data, ContentLength=len(data), _bytes_out=len(data))

    def _get(self, key: str) -> bytes:
        def fetch(physical: str) -> bytes:
            response = self._request("get_object", Bucket=self.bucket, Key=physical)
            body = response["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            with self._stats_lock:
                self._bytes_in += len(data)
            return data

        result: bytes = self._with_fallback(key, fetch)
        return result

    def _stat(self, key: str) -> ObjectInfo:
        def head(physical: str) -> ObjectInfo:
            response = self._request("head_object", Bucket=self.bucket, Key=physical)
            modified = response.get("LastModified")
            return ObjectInfo(key, int(response["ContentLength"]),
                              modified.timestamp() if modified is not None else None)

        info: ObjectInfo = self._with_fallback(key, head)
        return info

    def _list_prefix(self, prefix: str) -> str:
        """The physical prefix to list for logical ``prefix``: its directory when hashed
        data files could match it, else the prefix itself."""
        if self.options.prefix_strategy == "hash":
            head, _, tail = prefix.rpartition("/")
            if tail.startswith("__") or "__".startswith(tail):
                return self.root + (head + "/" if head else "")
        return self.root + prefix

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        physical_prefix = self._list_prefix(prefix)
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": physical_prefix}
        while True:
            response = self._request("list_objects_v2", **params)
            for obj in response.get("Contents", ()):
                physical = str(obj["Key"])
                if physical.endswith("/") or not physical.startswith(self.root):
                    continue  # directory markers of some stores
                key = self._logical(physical)
                if not key.startswith(prefix):
                    continue
                modified = obj.get("LastModified")
                yield ObjectInfo(key, int(obj.get("Size", 0)),
                                 modified.timestamp() if modified is not None else None)
            token = response.get("NextContinuationToken")
            if not response.get("IsTruncated") or not token:
                return
            params["ContinuationToken"] = token

    def _delete(self, keys: Sequence[str]) -> None:
        physical: list[str] = []
        for key in keys:
            physical.append(self._physical(key))
            other = self._alternative(key)  # a data file may exist in either layout
            if other is not None:
                physical.append(other)
        unique = list(dict.fromkeys(physical))
        for start in range(0, len(unique), _DELETE_BATCH):
            batch = unique[start : start + _DELETE_BATCH]
            response = self._request(
                "delete_objects", Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise ClientError(
                    {"Error": {"Code": first.get("Code", "Unknown"),
                               "Message": f"{first.get('Message', '')} ({len(errors)} of "
                                          f"{len(batch)} keys failed, e.g. {first.get('Key')})"},
                     "ResponseMetadata": response.get("ResponseMetadata", {})},
                    "DeleteObjects",
                )

    # -- multipart housekeeping ----------------------------------------------------------

    def list_uploads(self, prefix: str = "") -> list[tuple[str, str]]:
        """Unfinished multipart uploads under ``prefix`` as ``(key, upload_id)``."""

        def run() -> list[tuple[str, str]]:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._list_prefix(prefix)}
            found: list[tuple[str, str]] = []
            while True:
                response = self._request("list_multipart_uploads", **params)
                for upload in response.get("Uploads", ()):
                    physical = str(upload["Key"])
                    if not physical.startswith(self.root):
                        continue
                    key = self._logical(physical)
                    if key.startswith(prefix):
                        found.append((key, str(upload["UploadId"])))
                if not response.get("IsTruncated"):
                    return sorted(found)
                params["KeyMarker"] = response.get("NextKeyMarker")
                params["UploadIdMarker"] = response.get("NextUploadIdMarker")

        result: list[tuple[str, str]] = self._call(run, key=prefix or None)
        return result

    def abort_uploads(self, uploads: Iterable[tuple[str, str]]) -> None:
        """Abort unfinished multipart uploads returned by :meth:`list_uploads`."""
        for key, upload_id in uploads:
            validate_key(key)
            candidates = [self._physical(key)]
            other = self._alternative(key)  # a data file's upload may use either layout
            if other is not None:
                candidates.append(other)

            def run(candidates: list[str] = candidates, upload_id: str = upload_id) -> bool:
                for physical in candidates:
                    try:
                        self._request("abort_multipart_upload", Bucket=self.bucket,
                                      Key=physical, UploadId=upload_id)
                        return True
                    except ClientError as exc:
                        code, status, _, _ = _error_info(exc)
                        if code != "NoSuchUpload" and status != 404:
                            raise
                return False  # already completed or aborted

            if self._call(run, key=key):
                logger.info("aborted multipart upload %s of %s", upload_id, self._url(key))

    # -- errors ----------------------------------------------------------------------------

    def _is_retryable(self, exc: BaseException) -> bool:
        """Throttling, 5xx, timeouts and dropped connections are transient."""
        if isinstance(exc, ClientError):
            code, status, _, _ = _error_info(exc)
            return code in _RETRYABLE_CODES or status in _RETRYABLE_STATUS
        if isinstance(exc, SSLError):
            return False
        if isinstance(exc, (
            EndpointConnectionError,  # connection refused / DNS: also a restarting store
            ConnectTimeoutError,
            ReadTimeoutError,
            ConnectionClosedError,
            ResponseStreamingError,
            IncompleteReadError,
            HTTPClientError,
        )):
            return True
        return super()._is_retryable(exc)

    def _translate_error(self, exc: BaseException, key: str | None) -> BaseException | None:
        """botocore errors to Python's own (request ids kept, secrets never shown)."""
        where = self._url(key)
        attempts = self.options.max_attempts
        if isinstance(exc, ClientError):
            return self._translate_client_error(exc, where)
        if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
            phase = "connect" if isinstance(exc, ConnectTimeoutError) else "read"
            limit = self.options.connect_timeout if phase == "connect" else self.options.timeout
            return StoreTimeoutError(
                f"S3 request for {where} timed out ({phase} timeout {limit:g}s, "
                f"{attempts} attempt(s)) at {_redact_url(self._endpoint())}; the store is "
                "overloaded or unreachable (raise timeout= / max_attempts= if it is slow)"
            )
        if isinstance(exc, EndpointConnectionError):
            return ConnectionError(
                errno.ECONNREFUSED,
                f"cannot reach the S3 endpoint {_redact_url(self._endpoint())} for {where} "
                f"({attempts} attempt(s)): {_describe_cause(exc)}. Check endpoint_url / "
                "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and that the store is running",
            )
        if isinstance(exc, SSLError):
            return ConnectionError(
                f"TLS handshake with {_redact_url(self._endpoint())} failed for {where}: "
                f"{_describe_cause(exc)}"
            )
        if isinstance(exc, (ConnectionClosedError, ResponseStreamingError, IncompleteReadError,
                            HTTPClientError)):
            return ConnectionError(
                f"connection to {_redact_url(self._endpoint())} dropped during a request "
                f"for {where} ({attempts} attempt(s)): {type(exc).__name__}"
            )
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError,
                            CredentialRetrievalError)):
            return PermissionError(
                errno.EACCES,
                f"no usable AWS credentials for {where} ({type(exc).__name__}): set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE / profile=, use an "
                "instance or container role, or pass anonymous=True for public buckets",
            )
        if isinstance(exc, ProfileNotFound):
            return PermissionError(
                errno.EACCES,
                f"the AWS profile {self.options.profile or '(from AWS_PROFILE)'!r} is not "
                "defined in the shared config/credentials files",
            )
        if isinstance(exc, ParamValidationError):
            return ValueError(f"invalid S3 request for {where}: {exc}")
        if isinstance(exc, EOFError):
            return OSError(errno.EIO, str(exc))
        if isinstance(exc, BotoCoreError):
            return OSError(f"S3 request for {where} failed: {type(exc).__name__}: {exc}")
        return None

    def _translate_client_error(self, exc: ClientError, where: str) -> BaseException:
        code, status, request_id, message = _error_info(exc)
        op = getattr(exc, "operation_name", None) or "request"
        rid = f"request id {request_id}" if request_id else "no request id"
        detail = f"{code}{': ' + message if message else ''}; HTTP {status}, {rid}"
        if code == "NoSuchBucket":
            return FileNotFoundError(
                errno.ENOENT,
                f"S3 bucket {self.bucket!r} does not exist at "
                f"{_redact_url(self._endpoint())} ({op}: {detail}); create it or fix the URI",
            )
        if code in _NOT_FOUND_CODES or (status == 404 and code != "NoSuchUpload"):
            return FileNotFoundError(errno.ENOENT, f"no such object {where} ({op}: {detail})")
        if code in _DENIED_CODES or status == 403:
            return PermissionError(
                errno.EACCES,
                f"S3 denied {op} on {where} ({detail}); check the credentials and the "
                "bucket policy",
            )
        if code == "InvalidRange":
            return OSError(errno.EIO, f"{where}: requested range is past the end ({detail})")
        if code in _RETRYABLE_CODES or status in _RETRYABLE_STATUS:
            return OSError(
                errno.EAGAIN,
                f"S3 {op} on {where} kept failing after {self.options.max_attempts} "
                f"attempt(s) ({detail})",
            )
        return OSError(f"S3 {op} on {where} failed ({detail})")

    def _endpoint(self) -> str | None:
        client = self._client
        if client is not None:
            return str(client.meta.endpoint_url)
        return self.options.endpoint_url


def _install_log_redaction() -> None:
    """Blank credentials out of botocore's DEBUG records: it logs the signed request
    headers (``Authorization`` with the access key id, ``X-Amz-Security-Token``) and the
    canonical request verbatim (see :mod:`dcpstore.redact`)."""
    install_log_redaction()


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader() -> Any:
    """botocore's data loader, shared by every client of this process: parsing the S3
    service model once instead of per backend saves ~80 ms per writer/reader."""
    global _loader
    with _loader_lock:
        if _loader is None:
            from botocore.loaders import create_loader

            _loader = create_loader()
        return _loader


def _is_not_found(exc: ClientError) -> bool:
    code, status, _, _ = _error_info(exc)
    return code in _NOT_FOUND_CODES or (status == 404 and code not in ("NoSuchBucket",
                                                                        "NoSuchUpload"))


def _describe_cause(exc: BaseException) -> str:
    """The innermost reason of a botocore connection error, without URLs' userinfo."""
    error = getattr(exc, "kwargs", {}).get("error")
    reason = error if error is not None else exc
    text = redact(str(reason))
    return text.split(": ", 1)[-1] if "Connection" in text else text


def _skip(body: Any, count: int) -> None:
    """Read and drop ``count`` bytes of a response body."""
    chunk = bytearray(min(count, MiB))
    view = memoryview(chunk)
    left = count
    while left:
        n = body.readinto(view[: min(left, len(view))])
        if not n:
            raise EOFError("response ended while skipping to the requested offset")
        left -= n
