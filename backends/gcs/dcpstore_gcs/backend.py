"""Google Cloud Storage backend, built on gcsfs.

URIs: ``gs://bucket/prefix`` (``gcs://`` is an alias). Everything goes through the GCS
JSON API with gcsfs's credentials, endpoint resolution (``STORAGE_EMULATOR_HOST``,
mTLS), aiohttp session and event loop; the requests themselves are issued here so
that every one carries a timeout, a CRC32C and dcpstore's own retry policy, and so
errors keep their HTTP status and request id.

Writes
    An object smaller than one part is stored with a single multipart/related upload
    carrying its CRC32C (GCS rejects the upload if the bytes do not match).

    A larger object is a *parallel composite upload*: every ``part_size`` bytes become
    a temporary object ``<root>/.dcpstore-uploads/<upload id>/pNNNNN/<key>``, uploaded
    concurrently (up to ``max_concurrency`` in flight, each with its CRC32C) while the
    writer keeps serializing. ``commit`` composes the parts into the final object (in
    a tree of at most 32 sources per ``compose`` call), checks the composite's CRC32C
    against the CRC32C of the whole stream, and deletes the parts. Until then nothing
    exists under the final key. A resumable upload session would be the alternative,
    but its chunks must be sent one after another, so it cannot keep several parts in
    flight. GCS allows 1024 components per composite object; parts grow (2x after part
    512, 4x after 768, 8x after 896) so one object can reach 2560 x ``part_size``
    (80 GiB at the default 32 MiB) before an error asks for a larger ``part_size``.
    Parts left behind by a crash are found by ``list_uploads`` and removed by
    ``abort_uploads`` (``dcpstore gc``). Buckets with a
    soft-delete policy keep deleted parts (and bill them) for the retention period.

Reads
    Ranged ``GET ...?alt=media`` requests with a ``Range`` header, streamed straight
    into the caller's buffer; the base class runs them concurrently. Whole-object reads
    verify the CRC32C GCS returns in ``x-goog-hash``.

gcsfs itself is reached only through :mod:`dcpstore_gcs.gcsfs_adapter`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import logging
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote as _urlquote
from urllib.parse import urlsplit

import aiohttp
from typing_extensions import Buffer

from dcpstore.dcp.manifest import crc32c
from dcpstore.errors import (
    BucketNotFoundError,
    IntegrityError,
    StoreThrottledError,
    StoreTimeoutError,
)
from dcpstore.storage.backend import Backend, BackendOptions, Failure, ObjectInfo, Upload
from dcpstore.storage.multipart import MultipartUpload

from .gcsfs_adapter import GcsfsClient

__all__ = [
    "BucketNotFoundError",
    "GCSBackend",
    "GCSOptions",
    "GCSRequestError",
]

logger = logging.getLogger(__name__)

#: Prefix (under the checkpoint root) of the temporary part objects of composite uploads.
UPLOADS_PREFIX = ".dcpstore-uploads/"
#: GCS limits: sources per compose request, components per composite object.
MAX_COMPOSE_SOURCES = 32
MAX_COMPONENTS = 1024
#: Part numbers after which parts double in size (see the module docstring).
_GROWTH = ((896, 8), (768, 4), (512, 2))
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: How GCS asks clients to slow down (429 rate limits, 503 "backend busy").
_THROTTLING_STATUS = frozenset({429, 503})
_REQUEST_ID_HEADERS = ("X-GUploader-UploadID", "X-Goog-Request-Id", "X-Request-Id")


@dataclass
class GCSOptions(BackendOptions):
    """Options of the GCS backend (also ``DCPSTORE_GS_<OPTION>`` variables, URI query).

    Attributes:
        endpoint_url: JSON API endpoint, e.g. ``http://127.0.0.1:4443`` for an emulator.
            Default: ``$STORAGE_EMULATOR_HOST`` if set, else Google's endpoint.
        project: Google Cloud project (billing project for ``requester_pays``).
        token: How to authenticate, as in gcsfs: ``None`` (the standard Google chain:
            ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud ADC, GCE metadata; anonymous
            when talking to ``STORAGE_EMULATOR_HOST``), ``"anon"``,
            ``"google_default"``, ``"cloud"``, a path to a service-account JSON file,
            or (as a keyword argument) a ``google.auth`` credentials object.
        requester_pays: Bill requests to ``project`` (requester-pays buckets).
        connect_timeout: Seconds to establish a connection (``timeout`` bounds each
            whole request).
        max_concurrency: Part uploads and ranged reads in flight per process.
        part_size: Bytes per part of a composite upload (objects smaller than this
            are a single request). At least 256 KiB.
    """

    endpoint_url: str | None = None
    project: str | None = None
    # may carry credentials (a service-account dict, a credentials object): never shown
    token: str | None = field(default=None, repr=False)
    requester_pays: bool = False
    connect_timeout: float = 10.0
    max_concurrency: int = 16
    part_size: int = 32 * 1024 * 1024

    def validate(self) -> None:
        """Raise ``ValueError`` for values that make no sense."""
        super().validate()
        if self.connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0, got {self.connect_timeout}")
        if self.part_size < 256 * 1024:
            raise ValueError(f"part_size must be >= 256 KiB for GCS, got {self.part_size}")
        if self.endpoint_url is not None:
            url = self.endpoint_url if "://" in self.endpoint_url else f"http://{self.endpoint_url}"
            parts = urlsplit(url)
            if parts.username is not None or parts.password is not None:
                # never echo it: it carries a secret
                raise ValueError(
                    "endpoint_url carries credentials; credentials never belong in a URL. "
                    "Use GOOGLE_APPLICATION_CREDENTIALS, application-default credentials or "
                    "token=..."
                )


class GCSRequestError(Exception):
    """A GCS JSON API request answered with an HTTP error (before translation).

    Attributes:
        status: HTTP status code.
        message: The error message GCS returned.
        reason: GCS's error reason (``notFound``, ``forbidden``, ...) if any.
        request_id: The request id GCS returned (``X-GUploader-UploadID``), if any.
        method: HTTP method of the request.
        url: URL of the request (without query string).
    """

    def __init__(self, status: int, message: str, *, reason: str = "", request_id: str = "",
                 method: str = "", url: str = "") -> None:
        self.status = status
        self.message = message
        self.reason = reason
        self.request_id = request_id
        self.method = method
        self.url = url
        super().__init__(f"HTTP {status} {reason or ''} {message}".strip() + _rid(request_id))

    def __reduce__(self) -> Any:
        return (_rebuild_request_error,
                (self.status, self.message, self.reason, self.request_id, self.method, self.url))


def _rebuild_request_error(status: int, message: str, reason: str, request_id: str,
                           method: str, url: str) -> GCSRequestError:
    return GCSRequestError(status, message, reason=reason, request_id=request_id,
                           method=method, url=url)


class _ChecksumMismatch(Exception):
    """Downloaded bytes do not match the CRC32C GCS reported: retried, then raised as
    an :class:`~dcpstore.errors.IntegrityError` (a ``DcpstoreError`` would not be)."""


def _rid(request_id: str) -> str:
    return f" (request id: {request_id})" if request_id else ""


def _crc_b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def _crc_from_b64(text: str) -> int:
    return int.from_bytes(base64.b64decode(text), "big")


def _q(name: str) -> str:
    return _urlquote(name, safe="")


def _is_local_endpoint(url: str) -> bool:
    host = urlsplit(url if "://" in url else f"http://{url}").hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class _CompositeUpload(MultipartUpload):
    """Parallel composite upload: parts as temporary objects, then ``compose``."""

    backend: GCSBackend
    part_growth = _GROWTH

    def __init__(self, backend: GCSBackend, key: str) -> None:
        super().__init__(backend, key)
        self._crc = 0

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        n = super().write(view)
        self._crc = crc32c(view, self._crc)
        return n

    def _submit_part(self) -> None:
        if self._next_part > MAX_COMPONENTS:
            raise ValueError(
                f"gs://{self.backend.bucket}/{self.backend._name(self.key)} needs more than "
                f"{MAX_COMPONENTS} parts, the most a GCS composite object can have; raise "
                f"part_size (now {self.part_size}) or files_per_rank"
            )
        super()._submit_part()

    def _part_name(self, upload_id: str, tag: str) -> str:
        return self.backend._name(f"{UPLOADS_PREFIX}{upload_id}/{tag}/{self.key}")

    def _create(self) -> str:
        return uuid.uuid4().hex[:16]

    def _upload_part(self, upload_id: str, number: int, data: memoryview) -> Any:
        name = self._part_name(upload_id, f"p{number:05d}")
        self.backend._run(self.backend._upload_object(name, data, crc32c(data)))
        return name

    def _complete(self, upload_id: str, parts: list[tuple[int, Any]]) -> None:
        # Retried as a whole by the backend: every compose is idempotent (same sources,
        # same target), so the parts are deleted only once the final object is there. A
        # failed attempt (even one whose compose landed but whose response was lost) must
        # leave them for the next one; if every attempt fails, abort() removes them.
        be = self.backend
        names: list[str] = [name for _, name in parts]
        temporary = list(names)
        level = 0
        while len(names) > MAX_COMPOSE_SOURCES:
            groups = [names[i:i + MAX_COMPOSE_SOURCES]
                      for i in range(0, len(names), MAX_COMPOSE_SOURCES)]
            targets = [self._part_name(upload_id, f"c{level}-{i:04d}")
                       for i in range(len(groups))]
            temporary += targets
            be._run(be._gather(
                [be._compose(group, target) for group, target in zip(groups, targets,
                                                                     strict=True)]))
            names = targets
            level += 1
        final = be._name(self.key)
        meta = be._run(be._compose(names, final))
        stored = meta.get("crc32c")
        if stored and _crc_from_b64(stored) != self._crc:
            be._run(be._delete_objects([final]))
            raise IntegrityError(
                f"gs://{be.bucket}/{final}: composed object has CRC32C {stored}, the "
                f"uploaded stream {_crc_b64(self._crc)}; the object was deleted"
            )
        self._delete_parts(temporary)

    def _delete_parts(self, names: list[str]) -> None:
        """Delete temporary parts through the backend's retry, each attempt retrying only
        the deletes that failed (one failure among hundreds must not restart them all);
        leftovers are logged and found by ``list_uploads`` / ``dcpstore gc``. Never
        raises: the object is committed."""
        be = self.backend
        left = list(names)

        def attempt() -> None:
            nonlocal left
            failed = be._run(be._delete_each(left))
            left = [name for name, _ in failed]
            if failed:
                raise failed[0][1]

        try:
            be._call(attempt, key=self.key)
        except Exception as exc:
            logger.debug("deleting temporary parts of %s failed: %s", self.key, exc)
            logger.warning("could not delete %d of %d temporary parts of %s; `dcpstore gc` "
                           "removes them", len(left), len(names), self.key)

    def _abort_multipart(self, upload_id: str) -> None:
        self.backend._abort_upload(self.key, upload_id)

    def _put_whole(self, data: memoryview) -> None:
        self.backend._run(self.backend._upload_object(self.backend._name(self.key), data,
                                                      self._crc))


class GCSBackend(Backend):
    """Objects under ``gs://bucket/prefix`` (see the module docstring).

    Args:
        location: ``bucket/prefix``.
        options: :class:`GCSOptions`.
    """

    Options = GCSOptions
    name = "gs"
    schemes = ("gs", "gcs")
    options: GCSOptions

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        super().__init__(location.strip("/"), options)
        bucket, _, prefix = self.location.partition("/")
        if not bucket:
            raise ValueError(f"GCS location {location!r} has no bucket")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._bucket_exists: bool | None = None

    # -- plumbing ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The JSON API endpoint requests go to."""
        if self.options.endpoint_url:
            url = self.options.endpoint_url.rstrip("/")
            return url if "://" in url else f"http://{url}"
        return self.client.endpoint

    def _token(self) -> Any:
        o = self.options
        if o.token is not None:
            return o.token
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        target = o.endpoint_url or (emulator if emulator not in ("", "default") else "")
        if target and _is_local_endpoint(target):
            return "anon"  # like google-cloud-storage: emulators take no credentials
        return None

    def _make_client(self) -> GcsfsClient:
        o = self.options
        return GcsfsClient(token=self._token(), project=o.project,
                           requester_pays=o.requester_pays,
                           endpoint_url=self.endpoint if o.endpoint_url else None)

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, name: str) -> str:
        return name[len(self.prefix) + 1:] if self.prefix else name

    def _url(self, *parts: str, upload: bool = False) -> str:
        base = f"{self.endpoint}/upload/storage/v1/b/{_q(self.bucket)}" if upload else \
            f"{self.endpoint}/storage/v1/b/{_q(self.bucket)}"
        return base + "".join(f"/{p}" for p in parts)

    def _run(self, coro: Any) -> Any:
        """Run a coroutine on gcsfs's event loop thread and wait for it."""
        client = self.client
        # aiohttp's per-request timeout fires first; this is only a safety net
        return client.run(coro, timeout=self.options.timeout * 4
                          + self.options.connect_timeout + 30)

    async def _request(
        self,
        method: str,
        url: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        data: Any = None,
        json_body: Any = None,
        ok_statuses: Iterable[int] = (),
    ) -> tuple[int, Any, bytes]:
        client = self.client
        session = await client.session()
        hdrs = client.headers(headers)  # credentials + user agent
        query = client.params(params)  # + userProject for requester pays
        timeout = aiohttp.ClientTimeout(total=self.options.timeout,
                                        sock_connect=self.options.connect_timeout)
        async with session.request(method, url, params=query, headers=hdrs, data=data,
                                   json=json_body, timeout=timeout) as resp:
            body = await resp.read()
            if resp.status >= 400 and resp.status not in ok_statuses:
                raise _http_error(resp, body, method, url)
            return resp.status, resp.headers, body

    async def _gather(self, coros: Sequence[Any]) -> list[Any]:
        """Await coroutines with at most ``max_concurrency`` in flight; first error wins."""
        sem = asyncio.Semaphore(self.options.max_concurrency)

        async def bounded(c: Any) -> Any:
            async with sem:
                return await c

        tasks = [asyncio.ensure_future(bounded(c)) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in coros:  # cancelled before they started: no "never awaited" warning
                c.close()
            raise

    # -- requests ----------------------------------------------------------------------

    async def _upload_object(self, name: str, data: Buffer, crc: int) -> dict[str, Any]:
        """Single-request (multipart/related) upload; GCS checks the CRC32C."""
        meta = {"name": name, "crc32c": _crc_b64(crc), "contentType": "application/octet-stream"}
        with aiohttp.MultipartWriter("related") as body:
            body.append_json(meta)
            body.append(memoryview(data), {"Content-Type": "application/octet-stream"})
        _, _, raw = await self._request("POST", self._url("o", upload=True),
                                        params={"uploadType": "multipart"}, data=body)
        return _json(raw)

    async def _compose(self, sources: Sequence[str], target: str) -> dict[str, Any]:
        request = {
            "kind": "storage#composeRequest",
            "sourceObjects": [{"name": s} for s in sources],
            "destination": {"contentType": "application/octet-stream"},
        }
        _, _, raw = await self._request("POST", self._url("o", _q(target), "compose"),
                                        json_body=request)
        return _json(raw)

    async def _delete_objects(self, names: Sequence[str]) -> None:
        async def one(name: str) -> None:
            await self._request("DELETE", self._url("o", _q(name)), ok_statuses=(404,))

        await self._gather([one(n) for n in names])

    async def _delete_each(self, names: Sequence[str]) -> list[tuple[str, Exception]]:
        """Try to delete every object (a missing one is fine); return those that failed,
        each with its error."""
        sem = asyncio.Semaphore(self.options.max_concurrency)

        async def one(name: str) -> Exception | None:
            async with sem:
                try:
                    await self._request("DELETE", self._url("o", _q(name)), ok_statuses=(404,))
                except Exception as exc:
                    logger.debug("DELETE %s failed: %s", name, exc)
                    return exc
                return None

        done = await asyncio.gather(*(one(n) for n in names))
        return [(n, exc) for n, exc in zip(names, done, strict=True) if exc is not None]

    async def _list_names(self, prefix: str) -> list[tuple[str, int, float | None]]:
        out: list[tuple[str, int, float | None]] = []
        token: str | None = None
        while True:
            params = {"prefix": prefix, "maxResults": "1000",
                      "fields": "items(name,size,updated),nextPageToken"}
            if token:
                params["pageToken"] = token
            _, _, raw = await self._request("GET", self._url("o"), params=params)
            page = _json(raw)
            for item in page.get("items", []):
                name = item["name"]
                if not name.endswith("/"):
                    out.append((name, int(item.get("size", 0)), _parse_time(item.get("updated"))))
            token = page.get("nextPageToken")
            if not token:
                return out

    async def _list_prefixes(self, prefix: str, start_offset: str) -> list[str]:
        """Common prefixes (``delimiter=/``) under ``prefix``, from ``start_offset`` on."""
        out: list[str] = []
        token: str | None = None
        while True:
            params = {"prefix": prefix, "delimiter": "/", "maxResults": "1000",
                      "fields": "prefixes,nextPageToken"}
            if start_offset:
                params["startOffset"] = start_offset
            if token:
                params["pageToken"] = token
            _, _, raw = await self._request("GET", self._url("o"), params=params)
            page = _json(raw)
            out += [str(p) for p in page.get("prefixes", [])]
            token = page.get("nextPageToken")
            if not token:
                return out

    async def _read_range(self, name: str, offset: int, outs: Sequence[memoryview]) -> None:
        """One ranged GET streamed into ``outs`` in order (no staging buffer)."""
        client = self.client
        session = await client.session()
        views = [o if o.format == "B" and o.ndim == 1 else o.cast("B") for o in outs if len(o)]
        want = sum(len(v) for v in views)
        url = self._url("o", _q(name))
        hdrs = client.headers({"Range": f"bytes={offset}-{offset + want - 1}"})
        timeout = aiohttp.ClientTimeout(total=self.options.timeout,
                                        sock_connect=self.options.connect_timeout)
        pos, piece, filled = 0, 0, 0  # bytes taken; the destination being filled, its fill
        async with session.get(url, params=client.params({"alt": "media"}), headers=hdrs,
                               timeout=timeout) as resp:
            if resp.status == 416:
                raise EOFError(f"gs://{self.bucket}/{name} is shorter than {offset + 1} bytes "
                               f"(asked for {want} bytes from offset {offset})")
            if resp.status >= 400:
                raise _http_error(resp, await resp.read(), "GET", url)
            skip = offset if resp.status == 200 else 0  # server ignored the Range header
            async for chunk in resp.content.iter_any():
                view = memoryview(chunk)
                if skip:
                    cut = min(skip, len(view))
                    view, skip = view[cut:], skip - cut
                while view and pos < want:
                    dest = views[piece]
                    take = min(len(view), len(dest) - filled)
                    dest[filled:filled + take] = view[:take]
                    view = view[take:]
                    filled += take
                    pos += take
                    if filled == len(dest):
                        piece, filled = piece + 1, 0
                if pos >= want:
                    break
        if pos < want:
            raise EOFError(f"gs://{self.bucket}/{name} ends at byte {offset + pos}, expected "
                           f"{want} bytes from offset {offset} (object truncated?)")

    async def _download(self, name: str) -> bytes:
        url = self._url("o", _q(name))
        _, headers, body = await self._request("GET", url, params={"alt": "media"})
        expected = _hash_from_headers(headers)
        encoding = headers.get("X-Goog-Stored-Content-Encoding", "identity")
        if expected is not None and encoding == "identity" and crc32c(body) != expected:
            raise _ChecksumMismatch(
                f"gs://{self.bucket}/{name}: downloaded bytes have CRC32C "
                f"{_crc_b64(crc32c(body))}, GCS reports {_crc_b64(expected)}"
            )
        return body

    # -- primitives ----------------------------------------------------------------------

    def _abort_upload(self, key: str, upload_id: str) -> None:
        """Delete the parts of one unfinished composite upload."""
        prefix = self._name(f"{UPLOADS_PREFIX}{upload_id}/")
        names = [n for n, _, _ in self._run(self._list_names(prefix))]
        if names:
            self._run(self._delete_objects(names))

    def _open_upload(self, key: str) -> Upload:
        self.client  # noqa: B018 (fail here, on credentials, not in a worker thread)
        return _CompositeUpload(self, key)

    def upload_memory(self, size_hint: int | None = None) -> int:
        """``part_size``: every upload fills one part before its first request (an
        object that fits is one upload request)."""
        return self.options.part_size

    def preferred_object_size(self) -> int | None:
        """15/16 of ``part_size``: files the automatic layout makes are smaller than one
        part, so each is one upload request (no parts, no compose, no deletes) and, on
        a same-world-size load, one read."""
        return self.options.part_size - self.options.part_size // 16

    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        self._run(self._read_range(self._name(key), offset, outs))

    def _put(self, key: str, data: bytes, *, atomic: bool) -> None:
        # a GCS object upload is atomic: readers see the old object or the new one
        self._run(self._upload_object(self._name(key), data, crc32c(data)))

    def _get(self, key: str) -> bytes:
        return bytes(self._run(self._download(self._name(key))))

    def _stat(self, key: str) -> ObjectInfo:
        _, _, raw = self._run(self._request(
            "GET", self._url("o", _q(self._name(key))), params={"fields": "name,size,updated"}))
        meta = _json(raw)
        return ObjectInfo(key, int(meta.get("size", 0)), _parse_time(meta.get("updated")))

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        names = self._run(self._list_names(self._name(prefix) if self.prefix else prefix))
        for name, size, mtime in names:
            key = self._key(name)
            if key.startswith(UPLOADS_PREFIX) and not prefix.startswith(UPLOADS_PREFIX):
                continue  # in-flight composite parts are not objects of the checkpoint
            yield ObjectInfo(key, size, mtime)

    def _list_dirs(self, prefix: str, start_after: str) -> Iterator[str]:
        base = self._name(prefix) if self.prefix else prefix
        # every name in directory `start_after` sorts before this ('0' follows '/')
        start = base + start_after + "0" if start_after else ""
        for name in self._run(self._list_prefixes(base, start)):
            segment = name[len(base):].rstrip("/")
            if segment and not (prefix + segment + "/").startswith(UPLOADS_PREFIX):
                yield segment

    def _delete(self, keys: Sequence[str]) -> None:
        self._run(self._delete_objects([self._name(k) for k in keys]))

    def _list_uploads(self, prefix: str) -> Iterator[tuple[str, str]]:
        """Composite uploads that left parts behind, as ``(key, upload_id)``."""
        for name, _, _ in self._run(self._list_names(self._name(UPLOADS_PREFIX))):
            segments = self._key(name)[len(UPLOADS_PREFIX):].split("/")
            if len(segments) < 3:
                continue
            key = "/".join(segments[2:])
            if key.startswith(prefix):
                yield key, segments[0]

    # -- errors --------------------------------------------------------------------------

    def _check_bucket(self) -> bool:
        """Whether the bucket exists (``True`` when that cannot be told)."""
        if self._bucket_exists is None:
            try:
                self._run(self._request("GET", self._url(), params={"fields": "name"}))
                self._bucket_exists = True
            except GCSRequestError as exc:
                if exc.status == 404:
                    return False
                self._bucket_exists = True  # e.g. no storage.buckets.get permission
            except Exception:
                return True
        return self._bucket_exists

    def _classify(self, exc: Exception, key: str | None) -> Failure | None:
        where = f"gs://{self.bucket}/{self._name(key)}" if key else f"gs://{self.location}"
        if isinstance(exc, GCSRequestError):
            return Failure(self._http_failure(exc, where), exc.status in _RETRYABLE_STATUS)
        if isinstance(exc, _ChecksumMismatch):
            return Failure(IntegrityError(str(exc)), retryable=True)
        if isinstance(exc, asyncio.TimeoutError) or _is_fs_timeout(exc):
            return Failure(StoreTimeoutError(
                f"GCS request for {where} at {self._safe_endpoint()} timed out after "
                f"{self.options.timeout:g}s ({self.options.max_attempts} attempts); raise "
                "timeout= or check the network"
            ), retryable=True)
        if isinstance(exc, aiohttp.ClientSSLError):  # not trusted: the same every time
            return Failure(ConnectionError(
                f"TLS handshake with GCS at {self._safe_endpoint()} failed for {where}: "
                f"{exc}. For an endpoint with a private CA, set SSL_CERT_FILE to a bundle "
                "holding it before the process starts"
            ))
        if isinstance(exc, (aiohttp.ClientConnectionError, ConnectionError)):
            return Failure(ConnectionError(
                f"cannot reach GCS at {self._safe_endpoint()} for {where}: {exc}. Check "
                "endpoint_url / STORAGE_EMULATOR_HOST and that the server is running"
            ), retryable=True)
        if isinstance(exc, aiohttp.ClientPayloadError):  # a response cut short, every time
            return Failure(ConnectionError(
                f"connection to GCS at {self._safe_endpoint()} dropped during a request for "
                f"{where} ({self.options.max_attempts} attempt(s)): {exc}"
            ), retryable=True)
        if _is_auth_error(exc):
            return Failure(PermissionError(
                errno.EACCES,
                f"could not get Google credentials for {where}: {exc}. Set "
                "GOOGLE_APPLICATION_CREDENTIALS, run `gcloud auth application-default login`, "
                "or pass token='anon' for public buckets and emulators",
            ))
        return None

    def _http_failure(self, exc: GCSRequestError, where: str) -> OSError:
        """The exception an HTTP error of GCS becomes (its request id kept)."""
        rid = _rid(exc.request_id)
        if exc.status == 404:
            if "bucket" in exc.message.lower() or not self._check_bucket():
                return BucketNotFoundError(
                    errno.ENOENT,
                    f"GCS bucket {self.bucket!r} does not exist (at {self._safe_endpoint()})"
                    f"{rid}; create it first or fix the URI",
                )
            return FileNotFoundError(errno.ENOENT, f"no such object {where}{rid}")
        if exc.status == 401:
            return PermissionError(
                errno.EACCES,
                f"GCS rejected the credentials for {exc.method} {where}: {exc.message}{rid}. "
                "Check GOOGLE_APPLICATION_CREDENTIALS / `gcloud auth application-default "
                "login`, or pass token=...",
            )
        if exc.status == 403:
            return PermissionError(
                errno.EACCES, f"permission denied: {exc.method} {where}: {exc.message}{rid}"
            )
        if exc.status == 412:
            return FileExistsError(errno.EEXIST, f"precondition failed for {where}{rid}")
        if exc.status == 416:
            return OSError(f"{where}: requested range not satisfiable{rid}")
        if exc.status in _THROTTLING_STATUS:
            return StoreThrottledError(
                errno.EAGAIN,
                f"GCS {exc.method} {where} failed: HTTP {exc.status} {exc.message}{rid}; "
                f"throttled through {self.options.max_attempts} attempt(s): lower "
                "max_concurrency or raise max_attempts / retry_backoff_max",
            )
        return OSError(f"GCS {exc.method} {where} failed: HTTP {exc.status} "
                       f"{exc.message}{rid}")

    def _safe_endpoint(self) -> str:
        try:
            return self.endpoint
        except Exception:
            return "<unknown endpoint>"


def _json(raw: bytes) -> dict[str, Any]:
    import json

    if not raw:
        return {}
    out = json.loads(raw)
    return out if isinstance(out, dict) else {}


def _http_error(
    resp: aiohttp.ClientResponse, body: bytes, method: str, url: str
) -> GCSRequestError:
    message, reason = "", ""
    text = body.decode("utf-8", "replace") if body else ""
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        err = _json(body).get("error")
        if isinstance(err, dict):
            message = str(err.get("message", ""))
            errors = err.get("errors") or [{}]
            reason = str(errors[0].get("reason", ""))
        elif isinstance(err, str):
            message = err
    if not message:
        message = text.strip()[:500] or (resp.reason or "")
    request_id = next((resp.headers[h] for h in _REQUEST_ID_HEADERS if h in resp.headers), "")
    return GCSRequestError(resp.status, message, reason=reason, request_id=request_id,
                           method=method, url=url)


def _hash_from_headers(headers: Any) -> int | None:
    for value in headers.getall("X-Goog-Hash", []) if hasattr(headers, "getall") else []:
        for part in value.split(","):
            name, _, encoded = part.strip().partition("=")
            if name == "crc32c" and encoded:
                with contextlib.suppress(ValueError):
                    return _crc_from_b64(encoded)
    return None


def _is_fs_timeout(exc: BaseException) -> bool:
    try:
        from fsspec.exceptions import FSTimeoutError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, FSTimeoutError)


def _is_auth_error(exc: BaseException) -> bool:
    try:
        import google.auth.exceptions
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, google.auth.exceptions.GoogleAuthError)
