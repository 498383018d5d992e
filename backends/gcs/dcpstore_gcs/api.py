"""The GCS JSON API requests of dcpstore-gcs, issued on gcsfs's session and event loop.

Every request carries a timeout (``timeout`` for the whole request, ``connect_timeout``
to connect) and, for uploads, a CRC32C that GCS checks; nothing here retries (the
framework does). An HTTP error becomes a :class:`GCSRequestError` that keeps the status,
GCS's error reason and the request id, for :meth:`dcpstore_gcs.GCSStore.map_error`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

import aiohttp
import crc32c as _crc32c
from typing_extensions import Buffer

from dcpstore.plugin import crc32c_combine

from .gcsfs_adapter import GcsfsClient

__all__ = ["ChecksumMismatch", "GCSRequestError", "JsonApi", "crc32c", "crc32c_combine"]

logger = logging.getLogger(__name__)

_REQUEST_ID_HEADERS = ("X-GUploader-UploadID", "X-Goog-Request-Id", "X-Request-Id")
#: An object as a listing gives it: name, size, mtime.
Listed = tuple[str, int, float | None]


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
        rid = f" (request id: {request_id})" if request_id else ""
        super().__init__(f"HTTP {status} {reason} {message}".strip() + rid)

    def __reduce__(self) -> Any:
        return (_rebuild_request_error,
                (self.status, self.message, self.reason, self.request_id, self.method, self.url))


def _rebuild_request_error(status: int, message: str, reason: str, request_id: str,
                           method: str, url: str) -> GCSRequestError:
    return GCSRequestError(status, message, reason=reason, request_id=request_id,
                           method=method, url=url)


class ChecksumMismatch(Exception):
    """Downloaded bytes do not match the CRC32C GCS reported (retried by the framework,
    then raised as an :class:`~dcpstore.errors.IntegrityError`)."""


# -- CRC32C ----------------------------------------------------------------------------


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def crc_b64(value: int) -> str:
    """A CRC32C as GCS writes it (base64 of 4 big-endian bytes)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc_from_b64(text: str) -> int:
    return int.from_bytes(base64.b64decode(text), "big")


# -- requests ----------------------------------------------------------------------------


def quote_name(name: str) -> str:
    """An object name as one URL path segment."""
    return quote(name, safe="")


@dataclass
class JsonApi:
    """The requests of one bucket, on ``client``'s session and loop.

    Attributes:
        client: gcsfs's credentials, session and event loop.
        endpoint: JSON API endpoint (scheme and host).
        bucket: The bucket.
        timeout: Seconds per request.
        connect_timeout: Seconds to connect.
        max_concurrency: Most requests in flight of one batch (compose level, deletes).
        encryption_headers: The ``x-goog-encryption-*`` headers of a customer-supplied
            key (CSEK), sent with every request touching object data (uploads, compose,
            downloads, ranged reads, object metadata); empty without one. Never shown.
        kms_key_name: The Cloud KMS key (CMEK) of uploaded and composed objects
            (``kmsKeyName``); ``None``: the bucket's default.
    """

    client: GcsfsClient
    endpoint: str
    bucket: str
    timeout: float
    connect_timeout: float
    max_concurrency: int
    encryption_headers: dict[str, str] = field(default_factory=dict, repr=False)
    kms_key_name: str | None = None

    def url(self, *parts: str, upload: bool = False) -> str:
        base = f"{self.endpoint}/upload/storage/v1/b/{quote_name(self.bucket)}" if upload \
            else f"{self.endpoint}/storage/v1/b/{quote_name(self.bucket)}"
        return base + "".join(f"/{p}" for p in parts)

    def run(self, coro: Any) -> Any:
        """Run a coroutine on gcsfs's event loop thread and wait for it."""
        # aiohttp's per-request timeout fires first; this is only a safety net
        return self.client.run(coro, timeout=self.timeout * 4 + self.connect_timeout + 30)

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout)

    async def request(self, method: str, url: str, *, params: dict[str, str] | None = None,
                      headers: dict[str, str] | None = None, data: Any = None,
                      json_body: Any = None, ok_statuses: Iterable[int] = ()
                      ) -> tuple[int, Any, bytes]:
        session = await self.client.session()
        hdrs = self.client.headers(headers)  # credentials + user agent
        query = self.client.params(params)  # + userProject for requester pays
        async with session.request(method, url, params=query, headers=hdrs, data=data,
                                   json=json_body, timeout=self._timeout()) as resp:
            body = await resp.read()
            if resp.status >= 400 and resp.status not in ok_statuses:
                raise http_error(resp, body, method, url)
            return resp.status, resp.headers, body

    async def gather(self, coros: Sequence[Any]) -> list[Any]:
        """Await coroutines with at most ``max_concurrency`` in flight; first error wins."""
        sem = asyncio.Semaphore(self.max_concurrency)

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

    async def metadata(self, name: str = "", fields: str = "name,size,updated") -> dict[str, Any]:
        """An object's metadata (the bucket's where ``name`` is empty)."""
        url = self.url("o", quote_name(name)) if name else self.url()
        _, _, raw = await self.request("GET", url, params={"fields": fields},
                                       headers=self._keyed() if name else None)
        return _json(raw)

    def _keyed(self, headers: dict[str, str] | None = None) -> dict[str, str]:
        """``headers`` plus the customer-supplied key's, if any."""
        return {**(headers or {}), **self.encryption_headers}

    def _kms(self, params: dict[str, str]) -> dict[str, str]:
        """``params`` plus the CMEK key's name, if any."""
        if self.kms_key_name is not None:
            params["kmsKeyName"] = self.kms_key_name
        return params

    async def upload_object(self, name: str, data: Buffer, crc: int,
                            if_generation_match: str | None = None) -> dict[str, Any]:
        """Single-request (multipart/related) upload; GCS checks the CRC32C.

        ``if_generation_match``: store only if the live object has this generation
        (``"0"``: only if there is none); else a 412."""
        meta = {"name": name, "crc32c": crc_b64(crc), "contentType": "application/octet-stream"}
        with aiohttp.MultipartWriter("related") as body:
            body.append_json(meta)
            body.append(memoryview(data), {"Content-Type": "application/octet-stream"})
        params = {"uploadType": "multipart"}
        if if_generation_match is not None:
            params["ifGenerationMatch"] = if_generation_match
        _, _, raw = await self.request("POST", self.url("o", upload=True),
                                       params=self._kms(params), headers=self._keyed(),
                                       data=body)
        return _json(raw)

    async def compose(self, sources: Sequence[str], target: str) -> dict[str, Any]:
        request = {
            "kind": "storage#composeRequest",
            "sourceObjects": [{"name": s} for s in sources],
            "destination": {"contentType": "application/octet-stream"},
        }
        # with a customer-supplied key, sources and target use the same one
        _, _, raw = await self.request("POST", self.url("o", quote_name(target), "compose"),
                                       params=self._kms({}), headers=self._keyed(),
                                       json_body=request)
        return _json(raw)

    async def delete_objects(self, names: Sequence[str]) -> None:
        """Delete ``names`` (a missing one is fine); the first error wins."""
        await self.gather([self.request("DELETE", self.url("o", quote_name(n)),
                                         ok_statuses=(404,)) for n in names])

    async def delete_each(self, names: Sequence[str]) -> list[tuple[str, Exception]]:
        """Try to delete every object (a missing one is fine); return those that failed,
        each with its error."""
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(name: str) -> Exception | None:
            async with sem:
                try:
                    await self.request("DELETE", self.url("o", quote_name(name)),
                                       ok_statuses=(404,))
                except Exception as exc:
                    logger.debug("DELETE %s failed: %s", name, exc)
                    return exc
                return None

        done = await asyncio.gather(*(one(n) for n in names))
        return [(n, exc) for n, exc in zip(names, done, strict=True) if exc is not None]

    async def listing(self, prefix: str, *, delimiter: str | None = None,
                   start_offset: str = "") -> tuple[list[Listed], list[str]]:
        """Objects under ``prefix`` (one level of them with ``delimiter``), and with a
        delimiter the common prefixes."""
        items: list[Listed] = []
        prefixes: list[str] = []
        token: str | None = None
        while True:
            params = {"prefix": prefix, "maxResults": "1000",
                      "fields": "items(name,size,updated),prefixes,nextPageToken"}
            if delimiter:
                params["delimiter"] = delimiter
            if start_offset:
                params["startOffset"] = start_offset
            if token:
                params["pageToken"] = token
            _, _, raw = await self.request("GET", self.url("o"), params=params)
            page = _json(raw)
            items += [(i["name"], int(i.get("size", 0)), parse_time(i.get("updated")))
                      for i in page.get("items", []) if not i["name"].endswith("/")]
            prefixes += [str(p) for p in page.get("prefixes", [])]
            token = page.get("nextPageToken")
            if not token:
                return items, prefixes

    async def read_range(self, name: str, offset: int, outs: Sequence[memoryview],
                         checksums: dict[int, int | None] | None = None) -> None:
        """One ranged GET streamed into ``outs`` in order (no staging buffer).

        ``checksums``: indices of ``outs`` whose CRC32C to put there, each chunk
        checksummed right after it is copied in, while it is in the CPU's cache.
        """
        session = await self.client.session()
        # (index in outs, a byte view of it), empty buffers left out
        views = [(j, o if o.format == "B" and o.ndim == 1 else o.cast("B"))
                 for j, o in enumerate(outs) if len(o)]
        want = sum(len(v) for _, v in views)
        crc = 0
        url = self.url("o", quote_name(name))
        hdrs = self.client.headers(self._keyed(
            {"Range": f"bytes={offset}-{offset + want - 1}"}))
        pos, piece, filled = 0, 0, 0  # bytes taken; the destination being filled, its fill
        async with session.get(url, params=self.client.params({"alt": "media"}), headers=hdrs,
                               timeout=self._timeout()) as resp:
            if resp.status == 416:
                raise EOFError(f"gs://{self.bucket}/{name} is shorter than {offset + 1} bytes "
                               f"(asked for {want} bytes from offset {offset})")
            if resp.status >= 400:
                raise http_error(resp, await resp.read(), "GET", url)
            skip = offset if resp.status == 200 else 0  # server ignored the Range header
            async for chunk in resp.content.iter_any():
                view = memoryview(chunk)
                if skip:
                    cut = min(skip, len(view))
                    view, skip = view[cut:], skip - cut
                while view and pos < want:
                    j, dest = views[piece]
                    take = min(len(view), len(dest) - filled)
                    dest[filled:filled + take] = view[:take]
                    if checksums is not None and j in checksums:
                        crc = crc32c(dest[filled:filled + take], crc)
                    view = view[take:]
                    filled += take
                    pos += take
                    if filled == len(dest):
                        if checksums is not None and j in checksums:
                            checksums[j] = crc
                        piece, filled, crc = piece + 1, 0, 0
                if pos >= want:
                    break
        if pos < want:
            raise EOFError(f"gs://{self.bucket}/{name} ends at byte {offset + pos}, expected "
                           f"{want} bytes from offset {offset} (object truncated?)")

    async def download(self, name: str, offset: int = 0) -> bytes:
        """The object from ``offset`` on; a whole one checked against its CRC32C."""
        url = self.url("o", quote_name(name))
        extra = {"Range": f"bytes={offset}-"} if offset else None
        status, headers, body = await self.request("GET", url, params={"alt": "media"},
                                                   headers=self._keyed(extra),
                                                   ok_statuses=(416,))
        if status == 416:
            return b""
        if offset:
            return body[offset:] if status == 200 else body  # 200: Range ignored
        expected = _hash_from_headers(headers)
        encoding = headers.get("X-Goog-Stored-Content-Encoding", "identity")
        if expected is not None and encoding == "identity" and crc32c(body) != expected:
            raise ChecksumMismatch(
                f"gs://{self.bucket}/{name}: downloaded bytes have CRC32C "
                f"{crc_b64(crc32c(body))}, GCS reports {crc_b64(expected)}"
            )
        return body


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _json(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    out = json.loads(raw)
    return out if isinstance(out, dict) else {}


def http_error(resp: aiohttp.ClientResponse, body: bytes, method: str,
               url: str) -> GCSRequestError:
    """The :class:`GCSRequestError` of an error response (its JSON reason and request
    id kept)."""
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
                    return crc_from_b64(encoded)
    return None
