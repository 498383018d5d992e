"""The S3 store: ``s3://bucket/prefix`` (and ``s3a://``) over botocore.

:class:`S3Store` implements dcpstore's plugin contract (:mod:`dcpstore.plugin`); the
framework wraps it in its ``Backend`` (retries, worker pool, concurrency, part buffers
and their growth, pickling). Each method is one or a few S3 requests:

=======================  ==============================================================
method                   S3 requests
=======================  ==============================================================
``read``                 one ``GetObject`` (ranged: ``Range: bytes=a-b``), streamed
                         straight into the caller's buffers
``put``                  ``PutObject`` (atomic on S3)
``head``                 ``HeadObject`` (and ``HeadBucket`` after a 404, to tell a
                         missing bucket)
``list``                 ``ListObjectsV2`` (paginated)
``delete``               ``DeleteObjects`` (batches of 1000)
``start_upload``         ``CreateMultipartUpload``
``upload_part``          ``UploadPart``
``complete_upload``      ``CompleteMultipartUpload``
``abort_upload``         ``AbortMultipartUpload``
``list_uploads``         ``ListMultipartUploads``
=======================  ==============================================================

Encryption at rest (``sse*`` options, ``docs/encryption.md``) is added per operation in
one place, :meth:`S3Store._request`: SSE-S3/SSE-KMS parameters on ``PutObject`` and
``CreateMultipartUpload``, an SSE-C key on every request touching object data.

The client is botocore's (thread-safe; shared by the stores of a process with the same
settings). botocore's own retries are switched off: the framework retries every request
with backoff and jitter on the kinds :func:`dcpstore_s3.errors.to_store_error` calls
retryable (throttling, 5xx, timeouts, dropped connections), so attempts are never
multiplied. Every request has a connect and a read timeout.

The plugin's other modules: :mod:`~dcpstore_s3.options` (``S3Options``, S3's limits),
:mod:`~dcpstore_s3.keys` (the root and the ``hash`` prefix strategy),
:mod:`~dcpstore_s3.errors` (error codes, the translation) and
:mod:`~dcpstore_s3._zerocopy` (the botocore/urllib3 internals behind zero-copy bodies).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import botocore
import botocore.session
from botocore.config import Config
from botocore.exceptions import ClientError

from dcpstore.plugin import (
    BucketNotFoundError,
    ConfigurationError,
    MultipartStore,
    ObjectInfo,
    StoreError,
    StoreOptions,
    crc32c,
)
from dcpstore.storage.redact import CLIENT_LOGGERS, install_log_redaction
from dcpstore.storage.registry import as_backend_class

from . import _zerocopy
from .errors import error_info, is_not_found, redact_url, to_store_error
from .keys import KeyLayout
from .options import (
    LIMITS,
    SSE_C_OPERATIONS,
    SSE_WRITE_OPERATIONS,
    S3Options,
    encryption_params,
)

__all__ = ["S3Store", "S3StoreBackend"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Keys per ``DeleteObjects`` request (S3's limit).
_DELETE_BATCH = 1000


class S3Store(MultipartStore):
    """Objects under ``s3://bucket/prefix``. URI forms: ``s3://bucket/path``,
    ``s3a://bucket/path`` (Hadoop's spelling), options in the query string.

    Attributes:
        bucket: The bucket.
        root: Key prefix of the checkpoint root (``""`` or ending in ``/``).
        keys: Where logical keys live in the bucket (root and prefix strategy).
        request_counts: S3 requests issued (every attempt), by API operation name.
        bytes_read: Object bytes received by ``GetObject`` requests.
        bytes_written: Object bytes sent by ``PutObject`` / ``UploadPart`` requests.
    """

    name = "s3"
    schemes = ("s3", "s3a")
    Options = S3Options
    limits = LIMITS
    conditional_writes = True
    options: S3Options

    def __init__(self, location: str, options: StoreOptions | None = None) -> None:
        super().__init__(location, options)
        bucket, _, prefix = location.partition("/")
        if not bucket:
            raise ConfigurationError(f"S3 location {location!r} names no bucket")
        self.bucket = bucket
        prefix = prefix.strip("/")
        self.root = prefix + "/" if prefix else ""
        self.keys = KeyLayout(self.root, self.options.prefix_strategy)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self.bytes_read = 0
        self.bytes_written = 0
        self._part_sizes: dict[str, dict[int, int]] = {}  # upload id -> part -> bytes
        self._bucket_seen = False
        self._endpoint: str | None = None  # the client's, once it is made
        # the SSE parameters (SSE-C: the key), loaded on first use in each process
        self._sse: tuple[dict[str, Any], dict[str, Any]] | None = None

    # -- statistics ----------------------------------------------------------------------

    @property
    def request_counts(self) -> dict[str, int]:
        """S3 requests this store issued (every attempt), by API operation name."""
        with self._lock:
            return dict(self._counts)

    def reset_stats(self) -> None:
        """Zero :attr:`request_counts`, :attr:`bytes_read` and :attr:`bytes_written`."""
        with self._lock:
            self._counts.clear()
            self.bytes_read = self.bytes_written = 0

    def _request(self, operation: str, *, _bytes_out: int = 0, **params: Any) -> Any:
        """One S3 API call, counted (no retries here: the framework retries), with the
        encryption parameters its operation needs (:meth:`_encryption`)."""
        with self._lock:
            self._counts[operation] += 1
            self.bytes_written += _bytes_out
        client = self.client
        if self._endpoint is None:
            self._endpoint = str(client.meta.endpoint_url)
        if operation in SSE_C_OPERATIONS:
            write, customer = self._encryption()
            if operation in SSE_WRITE_OPERATIONS:
                params.update(write)
            params.update(customer)
        return getattr(client, operation)(**params)

    def _encryption(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The SSE parameters: ``(on writes, on every request touching object data)``
        (:func:`~dcpstore_s3.options.encryption_params`); an SSE-C key is read once per
        process and its value kept out of the client loggers' records."""
        sse = self._sse
        if sse is None:
            sse = encryption_params(self.options)
            if sse[1]:
                _redact_customer_key(sse[1]["SSECustomerKey"])
            self._sse = sse
        return sse

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_lock"]
        state["_sse"] = None  # an SSE-C key never travels: each process reads its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()

    # -- client ----------------------------------------------------------------------------

    def client_key(self) -> Hashable:
        """Stores with the same client settings and AWS environment share a client (the
        environment is hashed: the key holds no secret)."""
        o = self.options
        aws_env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
        return (o.endpoint_url, o.region, o.profile, o.addressing_style, o.anonymous,
                o.unsigned_payload, o.connect_timeout, o.timeout, o.max_concurrency,
                hashlib.sha256(repr(aws_env).encode()).hexdigest())

    def connect(self) -> Any:
        o = self.options
        session = botocore.session.Session(profile=o.profile)
        session.register_component("data_loader", _shared_loader())
        # botocore logs signed headers and canonical requests at DEBUG: blank the secrets
        install_log_redaction()
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
                # explicit, so botocore's S3 signer obeys it over plain HTTP too
                "payload_signing_enabled": not o.unsigned_payload,
            },
            # integrity is dcpstore's CRC32C manifest, end to end; per-request checksum
            # trailers cost a pass over the data and trip up some S3-compatible stores
            request_checksum_calculation="when_required",
            # bodies are memoryviews (sent without a copy), which botocore's parameter
            # validation does not know; every parameter is built by this plugin
            parameter_validation=False,
            response_checksum_validation="when_required",
            user_agent_extra="dcpstore-s3",
        )
        client = session.create_client("s3", endpoint_url=o.endpoint_url, config=config)
        _zerocopy.install_body_handlers(client)
        resolved = urlsplit(str(client.meta.endpoint_url))
        if resolved.username is not None or resolved.password is not None:
            client.close()  # e.g. AWS_ENDPOINT_URL_S3=http://user:pass@host; never echo it
            raise ConfigurationError(
                "the S3 endpoint URL (from the environment or the AWS config) carries "
                "credentials; credentials never belong in a URL. Use AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, a profile or a role."
            )
        logger.debug(
            "S3 client for s3://%s: endpoint %s, region %s, addressing %s, anonymous %s, "
            "unsigned payload %s", self.bucket, redact_url(client.meta.endpoint_url),
            client.meta.region_name, o.addressing_style, o.anonymous, o.unsigned_payload,
        )
        return client

    def map_error(self, exc: Exception,
                  key: str | None) -> StoreError | ConfigurationError | None:
        return to_store_error(
            exc, where=self._url(key), bucket=self.bucket,
            endpoint=self._endpoint or self.options.endpoint_url, options=self.options)

    # -- key mapping -------------------------------------------------------------------

    def _physical(self, key: str) -> str:
        """The S3 key storing logical ``key`` (every method's keys pass here)."""
        return self.keys.physical(key)

    def _url(self, key: str | None) -> str:
        if key is None:
            return f"s3://{self.bucket}/{self.root}".rstrip("/")
        return f"s3://{self.bucket}/{self._physical(key)}"

    def _with_fallback(self, key: str, fn: Callable[[str], T]) -> T:
        """Call ``fn(physical_key)``; for a missing data file, once more at the key of
        the other prefix strategy."""
        try:
            return fn(self._physical(key))
        except ClientError as exc:
            other = self.keys.alternative(key)
            if other is None or not is_not_found(exc):
                raise
            try:
                return fn(other)
            except ClientError as exc2:
                if is_not_found(exc2):
                    raise exc from None
                raise

    # -- objects -----------------------------------------------------------------------

    def read(self, key: str, offset: int = 0,
             buffers: Sequence[memoryview] | None = None) -> bytes | None:
        if buffers is None:
            return self._with_fallback(key, lambda physical: self._get_all(physical, offset))
        self._with_fallback(key, lambda physical: self._get_range(physical, offset, buffers))
        return None

    def read_checksummed(self, key: str, offset: int, buffers: Sequence[memoryview],
                         checksums: dict[int, int | None]) -> None:
        # each piece the socket gives is checksummed right after it lands, in cache
        self._with_fallback(key, lambda physical: self._get_range(physical, offset, buffers,
                                                                  checksums))

    def _get_all(self, physical: str, offset: int) -> bytes:
        params: dict[str, Any] = {"Range": f"bytes={offset}-"} if offset else {}
        body = self._request("get_object", Bucket=self.bucket, Key=physical, **params)["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        with self._lock:
            self.bytes_read += len(data)
        return data

    def _get_range(self, physical: str, offset: int, outs: Sequence[memoryview],
                   checksums: dict[int, int | None] | None = None) -> None:
        length = sum(len(o) for o in outs)
        try:
            response = self._request(
                "get_object", Bucket=self.bucket, Key=physical,
                Range=f"bytes={offset}-{offset + length - 1}",
            )
        except ClientError as exc:
            if error_info(exc)[0] == "InvalidRange":
                raise EOFError(
                    f"s3://{self.bucket}/{physical} is shorter than {offset + length} bytes "
                    f"(requested {length} bytes from offset {offset}; object truncated?)"
                ) from None
            raise
        body = response["Body"]
        try:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 200 and offset:
                _zerocopy.skip(body, offset)  # a store that ignored the Range header
            pos = 0
            for j, out in enumerate(outs):  # one body, read straight into each buffer
                filled, crc = 0, 0
                checksum = checksums is not None and j in checksums
                while filled < len(out):
                    n = _zerocopy.readinto(body, out[filled:])
                    if not n:
                        break
                    if checksum:
                        crc = crc32c(out[filled:filled + n], crc)
                    filled += n
                if checksums is not None and checksum and filled == len(out):
                    checksums[j] = crc
                pos += filled
                if filled < len(out):
                    break
            with self._lock:
                self.bytes_read += pos
            if pos < length:
                raise EOFError(
                    f"s3://{self.bucket}/{physical} ends at byte {offset + pos}, expected "
                    f"{length} bytes from offset {offset} (object truncated?)"
                )
        finally:
            body.close()

    def put(self, key: str, data: memoryview, *, if_absent: bool = False,
            if_match: str | None = None) -> None:
        # A single PutObject is atomic on S3: readers see the old object or the new one.
        conditions = {}
        if if_absent:
            conditions["IfNoneMatch"] = "*"
        if if_match is not None:
            conditions["IfMatch"] = if_match
        self._request("put_object", Bucket=self.bucket, Key=self._physical(key),
                      Body=data.cast("B"), ContentLength=len(data), _bytes_out=len(data),
                      **conditions)

    def head(self, key: str) -> ObjectInfo:
        def head(physical: str) -> ObjectInfo:
            response = self._request("head_object", Bucket=self.bucket, Key=physical)
            return ObjectInfo(key, int(response["ContentLength"]),
                              _mtime(response.get("LastModified")), response.get("ETag"))

        try:
            return self._with_fallback(key, head)
        except ClientError as exc:
            # HEAD answers a bare 404 for a missing bucket too (no error code in a body)
            if is_not_found(exc) and not self._bucket_exists():
                request_id = error_info(exc)[2]
                raise BucketNotFoundError(
                    f"S3 bucket {self.bucket!r} does not exist at "
                    f"{redact_url(self._endpoint)} (HeadObject and HeadBucket: HTTP 404, "
                    f"request id {request_id or 'none'}); create it or fix the URI",
                    request_id=request_id) from exc
            raise

    def _bucket_exists(self) -> bool:
        """Whether the bucket exists (one ``HeadBucket``; a yes is remembered)."""
        if self._bucket_seen:
            return True
        try:
            self._request("head_bucket", Bucket=self.bucket)
        except ClientError as exc:
            # anything but not-found (e.g. 403: HeadBucket not allowed) means it is there
            return not (is_not_found(exc) or error_info(exc)[0] == "NoSuchBucket")
        self._bucket_seen = True
        return True

    def list(self, prefix: str, *, start_after: str = "",
             delimiter: str | None = None) -> Iterator[ObjectInfo | str]:
        if delimiter is None:
            params = {"Prefix": self.keys.list_prefix(prefix)}
        else:
            params = {"Prefix": self.root + prefix, "Delimiter": delimiter}
            if start_after:
                # every key of directory `start_after` sorts before this ('0' follows '/')
                params["StartAfter"] = self.root + prefix + start_after + "0"
        for response in self._pages("list_objects_v2", params):
            for obj in response.get("Contents", ()):
                physical = str(obj["Key"])
                if physical.endswith("/") or not physical.startswith(self.root):
                    continue  # directory markers of some stores
                key = self.keys.logical(physical)
                if key.startswith(prefix):
                    yield ObjectInfo(key, int(obj.get("Size", 0)),
                                     _mtime(obj.get("LastModified")))
            for common in response.get("CommonPrefixes", ()):
                name = str(common["Prefix"])[len(params["Prefix"]):].rstrip("/")
                if self.keys.hashed and _is_hash_dir(name):
                    continue  # the hash prefix strategy's own level, not a directory
                if name:
                    yield name

    def _pages(self, operation: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The responses of a paginated listing, page after page."""
        params = {"Bucket": self.bucket, **params}
        while True:
            response = self._request(operation, **params)
            yield response
            if not response.get("IsTruncated"):
                return
            if operation == "list_multipart_uploads":
                params["KeyMarker"] = response.get("NextKeyMarker")
                params["UploadIdMarker"] = response.get("NextUploadIdMarker")
            elif response.get("NextContinuationToken"):
                params["ContinuationToken"] = response["NextContinuationToken"]
            else:
                return

    def delete(self, keys: Sequence[str]) -> None:
        physical: list[str] = []
        for key in keys:
            physical.append(self._physical(key))
            other = self.keys.alternative(key)  # a data file may exist in either layout
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

    # -- multipart uploads ---------------------------------------------------------------

    def start_upload(self, key: str) -> str:
        response = self._request("create_multipart_upload", Bucket=self.bucket,
                                 Key=self._physical(key))
        logger.debug("%s: multipart upload started", self._url(key))
        return str(response["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, data: memoryview) -> str:
        with self._lock:
            self._part_sizes.setdefault(upload_id, {})[number] = len(data)
        response = self._request(
            "upload_part", Bucket=self.bucket, Key=self._physical(key), UploadId=upload_id,
            PartNumber=number, Body=data.cast("B"), ContentLength=len(data),
            _bytes_out=len(data),
        )
        return str(response["ETag"])

    def complete_upload(self, key: str, upload_id: str,
                        parts: Sequence[tuple[int, str]]) -> None:
        physical = self._physical(key)
        try:
            self._request(
                "complete_multipart_upload", Bucket=self.bucket, Key=physical,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"ETag": tag, "PartNumber": n} for n, tag in parts]},
            )
        except ClientError as exc:
            # a retry after a completion whose response was lost: the object is there
            if error_info(exc)[0] != "NoSuchUpload" or not self._stored_whole(
                    physical, upload_id):
                raise
        with self._lock:
            self._part_sizes.pop(upload_id, None)

    def _stored_whole(self, physical: str, upload_id: str) -> bool:
        """Whether ``physical`` holds the object of every part of ``upload_id``."""
        with self._lock:
            size = sum(self._part_sizes.get(upload_id, {}).values())
        try:
            head = self._request("head_object", Bucket=self.bucket, Key=physical)
        except ClientError as exc:
            if is_not_found(exc):
                return False
            raise  # e.g. throttled: retry the completion, do not fail it for good
        return int(head.get("ContentLength", -1)) == size

    def abort_upload(self, key: str, upload_id: str) -> None:
        with self._lock:
            self._part_sizes.pop(upload_id, None)
        candidates = [self._physical(key)]
        other = self.keys.alternative(key)  # a data file's upload may use either layout
        if other is not None:
            candidates.append(other)
        for physical in candidates:
            try:
                self._request("abort_multipart_upload", Bucket=self.bucket, Key=physical,
                              UploadId=upload_id)
            except ClientError as exc:
                code, status, _, _ = error_info(exc)
                if code != "NoSuchUpload" and status != 404:
                    raise
            else:
                logger.debug("aborted multipart upload %s of %s", upload_id, self._url(key))
                return
        # already completed or aborted: nothing to do

    def list_uploads(self, prefix: str) -> Iterator[tuple[str, str]]:
        for response in self._pages("list_multipart_uploads",
                                    {"Prefix": self.keys.list_prefix(prefix)}):
            for upload in response.get("Uploads", ()):
                physical = str(upload["Key"])
                if not physical.startswith(self.root):
                    continue
                key = self.keys.logical(physical)
                if key.startswith(prefix):
                    yield key, str(upload["UploadId"])


#: The framework's ``Backend`` over :class:`S3Store` (``dcpstore_s3.S3Backend``), bound
#: here under its own name so that pickle finds the class where it says it lives.
S3StoreBackend = as_backend_class(S3Store)


def _mtime(modified: Any) -> float | None:
    return modified.timestamp() if modified is not None else None


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader() -> Any:
    """botocore's data loader, shared by every client of this process: parsing the S3
    service model once instead of per store saves ~80 ms per writer/reader."""
    global _loader
    with _loader_lock:
        if _loader is None:
            from botocore.loaders import create_loader

            _loader = create_loader()
        return _loader


def _is_hash_dir(name: str) -> bool:
    """Whether ``name`` is a two-hex-digit prefix of the ``hash`` prefix strategy."""
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


#: An SSE-C key header or parameter and its value, in a log record (botocore logs the
#: request headers and the canonical request it signs at DEBUG).
_CUSTOMER_KEY_PATTERN = re.compile(
    r"(?i)((?:x-amz-(?:copy-source-)?server-side-encryption-customer-key|"
    r"SSECustomerKey)['\"]?\s*[:=]\s*b?['\"]?)[A-Za-z0-9+/=]+")


class _CustomerKeyFilter(logging.Filter):
    """Blanks SSE-C keys out of the client loggers' records: by header name, and every
    key this process loaded wherever it shows."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        cleaned = _CUSTOMER_KEY_PATTERN.sub(r"\1***", message)
        for key in self.keys:
            cleaned = cleaned.replace(key, "***")
        if cleaned != message:
            record.msg = cleaned
            record.args = ()
        return True


_key_filter_lock = threading.Lock()
_key_filter: _CustomerKeyFilter | None = None


def _redact_customer_key(key_b64: str) -> None:
    """Keep ``key_b64`` (and any SSE-C key header) out of the client loggers' records."""
    global _key_filter
    with _key_filter_lock:
        if _key_filter is None:
            _key_filter = _CustomerKeyFilter()
            for name in CLIENT_LOGGERS:
                logging.getLogger(name).addFilter(_key_filter)
        _key_filter.keys.add(key_b64)
