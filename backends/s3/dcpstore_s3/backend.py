"""The S3 backend: ``s3://bucket/prefix`` (and ``s3a://``) over botocore.

Every primitive of :class:`dcpstore.Backend` maps onto one or a few S3 requests:

=====================  ================================================================
primitive              S3 requests
=====================  ================================================================
``_open_upload``       ``CreateMultipartUpload`` (when the first part is full),
                       ``UploadPart`` x N (concurrently, while later parts are being
                       serialized), ``CompleteMultipartUpload``; an object smaller than
                       one part, or announced (``expect_size``) and at most
                       ``part_size x max_concurrency``, is a single ``PutObject``;
                       abort is ``AbortMultipartUpload``
``_read_into``         one ranged ``GetObject`` (``Range: bytes=a-b``) per range,
                       streamed straight into the caller's buffers
``_put`` / ``_get``    ``PutObject`` (atomic on S3) / ``GetObject``
``_stat``              ``HeadObject``
``_list``              ``ListObjectsV2`` (paginated)
``_delete``            ``DeleteObjects`` (batches of 1000)
``_list_uploads``      ``ListMultipartUploads``
``_abort_upload``      ``AbortMultipartUpload``
=====================  ================================================================

The client is botocore's (thread-safe; the backend's worker threads share one), made by
``_make_client`` on first use of :attr:`~dcpstore.Backend.client`. botocore's own retries
are switched off: the base class retries every request with exponential backoff and
jitter (``max_attempts``, ``retry_backoff``) on what :func:`dcpstore_s3.errors.classify`
calls transient (throttling, 5xx, timeouts, dropped connections), so attempts are never
multiplied. Every request has a connect and a read timeout.

The plugin's other modules: :mod:`~dcpstore_s3.options` (``S3Options``, S3's limits),
:mod:`~dcpstore_s3.keys` (the root and the ``hash`` prefix strategy),
:mod:`~dcpstore_s3.errors` (error codes, the classification) and
:mod:`~dcpstore_s3._zerocopy` (the botocore/urllib3 internals behind zero-copy bodies).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import botocore
import botocore.session
from botocore.config import Config
from botocore.exceptions import ClientError

from dcpstore.errors import BucketNotFoundError
from dcpstore.storage.backend import Backend, BackendOptions, Failure, ObjectInfo, Upload
from dcpstore.storage.multipart import MultipartUpload, first_buffer_bytes
from dcpstore.storage.redact import install_log_redaction

from . import _zerocopy
from .errors import classify, error_info, is_not_found, redact_url
from .keys import KeyLayout
from .options import (
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    PART_GROWTH,
    S3Options,
    largest_object,
)

__all__ = [
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "S3Backend",
    "S3MultipartUpload",
    "S3Options",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Keys per ``DeleteObjects`` request (S3's limit).
_DELETE_BATCH = 1000


class S3MultipartUpload(MultipartUpload):
    """A streaming S3 multipart upload (parts uploaded concurrently by the backend).

    Parts start at ``part_size`` and double after every 1,000 parts up to 4x (and 5 GiB),
    so the small default part keeps small objects' uploads pipelined while S3's
    10,000-part limit still admits ``largest_object(part_size)`` bytes."""

    backend: S3Backend
    part_growth = PART_GROWTH

    def part_bytes(self, number: int) -> int:
        if number == 1:
            return self.backend._first_part()
        return min(MAX_PART_SIZE, super().part_bytes(number))

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
                f"parts; with part_size={self.part_size} the largest object is "
                f"{largest_object(self.part_size)} bytes: raise part_size",
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
            if error_info(exc)[0] != "NoSuchUpload" or not self._stored_whole():
                raise

    def _stored_whole(self) -> bool:
        try:
            head = self.backend._request("head_object", Bucket=self.backend.bucket,
                                         Key=self.physical_key)
        except ClientError as exc:
            if is_not_found(exc):
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
            if error_info(exc)[0] != "NoSuchUpload":
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
        keys: Where logical keys live in the bucket (root and prefix strategy).
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
        self.keys = KeyLayout(self.root, self.options.prefix_strategy)
        self._stats_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._bytes_in = 0
        self._bytes_out = 0
        self._bucket_seen = False

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

    def _client_key(self) -> Any:
        """Backends with the same client settings and AWS environment share a client
        (the environment is hashed: the key holds no secret)."""
        o = self.options
        aws_env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
        return (o.endpoint_url, o.region, o.profile, o.addressing_style, o.anonymous,
                o.unsigned_payload, o.connect_timeout, o.timeout, o.max_concurrency,
                hashlib.sha256(repr(aws_env).encode()).hexdigest())

    def _make_client(self) -> Any:
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
            raise ValueError(
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

    def _close_client(self, client: Any) -> None:
        client.close()  # its HTTP connection pool

    def _request(self, operation: str, *, _bytes_out: int = 0, **params: Any) -> Any:
        """One S3 API call (no retries here: the caller is inside ``Backend._call``)."""
        self._count(operation, bytes_out=_bytes_out)
        return getattr(self.client, operation)(**params)

    def _endpoint(self) -> str | None:
        """The endpoint URL, without making a client for it."""
        client = self._resources.get("client")
        if client is not None:
            return str(client.meta.endpoint_url)
        return self.options.endpoint_url

    # -- key mapping -------------------------------------------------------------------

    def _physical(self, key: str) -> str:
        """The S3 key storing logical ``key`` (every primitive's keys pass here)."""
        return self.keys.physical(key)

    def _url(self, key: str | None) -> str:
        if key is None:
            return f"s3://{self.bucket}/{self.root}".rstrip("/")
        return f"s3://{self.bucket}/{self._physical(key)}"

    def _with_fallback(self, key: str, fn: Callable[[str], T]) -> T:
        """Call ``fn(physical_key)``; for a missing data file, once more at the
        key of the other prefix strategy."""
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

    # -- primitives --------------------------------------------------------------------

    def _open_upload(self, key: str) -> Upload:
        return S3MultipartUpload(self, key)

    def whole_object_limit(self) -> int:
        """``part_size x max_concurrency``: an announced object up to the bytes the
        parts in flight may hold is one ``PutObject`` (a request per object, not one per
        part plus two: the request count bounds throughput on stores that pay per
        request, such as SeaweedFS on few cores), within the same memory."""
        o = self.options
        return min(MAX_PART_SIZE, o.part_size * o.max_concurrency)

    def upload_memory(self, size_hint: int | None = None) -> int:
        """The buffer an upload fills before its first request (the uploads size it
        with this): ``multipart_threshold``, or an announced object's size up to
        :meth:`whole_object_limit`."""
        return first_buffer_bytes(self._first_part(), self.whole_object_limit(), size_hint)

    def _first_part(self) -> int:
        """Part 1's size: the buffer an object up to ``multipart_threshold`` is sent
        from in one ``PutObject``."""
        o = self.options
        return min(MAX_PART_SIZE, max(o.multipart_threshold, o.part_size))

    def preferred_object_size(self) -> int | None:
        """15/16 of ``max(multipart_threshold, part_size)``: files the automatic layout
        makes are single ``PutObject`` requests, with room for the items' archive
        headers and small pickled items."""
        threshold = max(self.options.multipart_threshold, self.options.part_size)
        return threshold - threshold // 16

    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        self._with_fallback(key, lambda physical: self._get_range(physical, offset, outs))

    def _get_range(self, physical: str, offset: int, outs: Sequence[memoryview]) -> None:
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
            for out in outs:  # one response body, read straight into each buffer in turn
                filled = 0
                while filled < len(out):
                    n = _zerocopy.readinto(body, out[filled:])
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

        return self._with_fallback(key, fetch)

    def _stat(self, key: str) -> ObjectInfo:
        def head(physical: str) -> ObjectInfo:
            response = self._request("head_object", Bucket=self.bucket, Key=physical)
            modified = response.get("LastModified")
            return ObjectInfo(key, int(response["ContentLength"]),
                              modified.timestamp() if modified is not None else None)

        try:
            return self._with_fallback(key, head)
        except ClientError as exc:
            # HEAD answers a bare 404 for a missing bucket too (no error code in a body)
            if is_not_found(exc) and not self._bucket_exists():
                request_id = error_info(exc)[2] or "none"
                raise BucketNotFoundError(
                    errno.ENOENT,
                    f"S3 bucket {self.bucket!r} does not exist at "
                    f"{redact_url(self._endpoint())} (HeadObject and HeadBucket: HTTP 404, "
                    f"request id {request_id}); create it or fix the URI",
                ) from exc
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

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        params: dict[str, Any] = {"Bucket": self.bucket,
                                  "Prefix": self.keys.list_prefix(prefix)}
        while True:
            response = self._request("list_objects_v2", **params)
            for obj in response.get("Contents", ()):
                physical = str(obj["Key"])
                if physical.endswith("/") or not physical.startswith(self.root):
                    continue  # directory markers of some stores
                key = self.keys.logical(physical)
                if not key.startswith(prefix):
                    continue
                modified = obj.get("LastModified")
                yield ObjectInfo(key, int(obj.get("Size", 0)),
                                 modified.timestamp() if modified is not None else None)
            token = response.get("NextContinuationToken")
            if not response.get("IsTruncated") or not token:
                return
            params["ContinuationToken"] = token

    def _list_dirs(self, prefix: str, start_after: str) -> Iterator[str]:
        base = self.root + prefix
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
        if start_after:
            # every key of directory `start_after` sorts before this ('0' follows '/')
            params["StartAfter"] = base + start_after + "0"
        while True:
            response = self._request("list_objects_v2", **params)
            for common in response.get("CommonPrefixes", ()):
                name = str(common["Prefix"])[len(base):].rstrip("/")
                if self.keys.hashed and _is_hash_dir(name):
                    continue  # the hash prefix strategy's own level, not a directory
                if name:
                    yield name
            token = response.get("NextContinuationToken")
            if not response.get("IsTruncated") or not token:
                return
            params["ContinuationToken"] = token

    def _delete(self, keys: Sequence[str]) -> None:
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

    def _list_uploads(self, prefix: str) -> Iterator[tuple[str, str]]:
        params: dict[str, Any] = {"Bucket": self.bucket,
                                  "Prefix": self.keys.list_prefix(prefix)}
        while True:
            response = self._request("list_multipart_uploads", **params)
            for upload in response.get("Uploads", ()):
                physical = str(upload["Key"])
                if not physical.startswith(self.root):
                    continue
                key = self.keys.logical(physical)
                if key.startswith(prefix):
                    yield key, str(upload["UploadId"])
            if not response.get("IsTruncated"):
                return
            params["KeyMarker"] = response.get("NextKeyMarker")
            params["UploadIdMarker"] = response.get("NextUploadIdMarker")

    def _abort_upload(self, key: str, upload_id: str) -> None:
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
                logger.info("aborted multipart upload %s of %s", upload_id, self._url(key))
                return
        # already completed or aborted: nothing to do

    def _classify(self, exc: Exception, key: str | None) -> Failure | None:
        return classify(exc, where=self._url(key), bucket=self.bucket,
                        endpoint=self._endpoint(), options=self.options)


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


def _is_hash_dir(name: str) -> bool:
    """Whether ``name`` is a two-hex-digit prefix of the ``hash`` prefix strategy."""
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)
