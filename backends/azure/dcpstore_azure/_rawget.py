"""One Get Blob per read, its body read straight into the caller's buffers: the one place
that leans on azure-storage-blob's and urllib3's internals (pinned in
``requirements/constraints.txt``).

Why: ``BlobClient.download_blob`` returns a ``StorageStreamDownloader``, whose
``_initial_request`` and ``_download_chunk`` retry a broken body themselves (3 tries, a
1 s sleep each) whatever ``retry_total`` says, then raise a status-less
``HttpResponseError``. dcpstore's framework must be the only retry layer, so a read is
one request. The SDK has no public bare Get Blob, so :func:`get` calls the generated
operation the downloader itself calls (``BlobClient._client.blob.download``) with a
``cls`` that returns the pipeline response, body unread: the request is built, signed
and its error statuses mapped by the SDK's own pipeline (whose retry policy is off).

Body: :func:`readinto` and :func:`read_all` read from the ``http.client.HTTPResponse``
inside urllib3's response (``internal_response.raw._fp``: straight into the caller's
buffer, no temporary), keeping urllib3's byte accounting (``_fp_bytes_read``,
``length_remaining``) and handing the connection back (``release_conn``) as urllib3's
own ``read`` does. Where any of that is missing they fall back to urllib3's public
``readinto`` / ``read`` (correct, one copy more). A body cut short raises
``IncompleteReadError``, a read timeout ``ServiceResponseTimeoutError``: never a short
read.

``tests/test_backend_azure.py`` checks every internal named here against the pinned
versions, so an upgrade that changes them fails loudly.
"""

from __future__ import annotations

import contextlib
import http.client
from collections.abc import Iterator
from typing import Any

import urllib3.exceptions
from azure.core.exceptions import IncompleteReadError, ServiceResponseTimeoutError

__all__ = ["close", "direct_response", "get", "read_all", "readinto"]


def _pipeline_response(pipeline_response: Any, deserialized: Any, headers: Any) -> Any:
    return pipeline_response


def get(blob: Any, range_header: str | None) -> Any:
    """One Get Blob of ``blob`` (a ``BlobClient``) with ``range_header`` (``bytes=a-b``,
    ``bytes=a-``, or ``None``: all of it): the SDK's ``HttpResponse``, its body unread.
    An error status raises the SDK's ``HttpResponseError`` (416 included)."""
    pipeline_response = blob._client.blob.download(range=range_header,
                                                   cls=_pipeline_response)
    return pipeline_response.http_response


def direct_response(response: Any) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under the SDK's response when its bytes can be read
    straight into a caller's buffer (a plain body: not chunked, not content-encoded),
    else ``None``."""
    raw: Any = getattr(getattr(response, "internal_response", None), "raw", None)
    fp = getattr(raw, "_fp", None)
    if (not isinstance(fp, http.client.HTTPResponse) or fp.chunked
            or raw.headers.get("content-encoding") or not hasattr(raw, "_fp_bytes_read")
            or not hasattr(raw, "length_remaining") or not hasattr(raw, "release_conn")):
        return None
    return fp


@contextlib.contextmanager
def _broken_body() -> Iterator[None]:
    """A timeout or a cut connection while reading the body, as the SDK's errors."""
    try:
        yield
    except (TimeoutError, urllib3.exceptions.ReadTimeoutError) as exc:
        raise ServiceResponseTimeoutError(f"reading the body timed out: {exc!r}",
                                          error=exc) from exc
    except (http.client.HTTPException, OSError, urllib3.exceptions.HTTPError) as exc:
        raise IncompleteReadError(f"the body was cut short: {exc!r}", error=exc) from exc


def _account(raw: Any, fp: http.client.HTTPResponse, n: int) -> None:
    raw._fp_bytes_read += n
    if raw.length_remaining is not None:
        raw.length_remaining -= n
    if fp.isclosed():  # all of it read: hand the connection back to the pool
        raw.release_conn()


def readinto(response: Any, out: memoryview) -> int:
    """Read the next bytes of the body into ``out``: their count, 0 at its end."""
    fp = direct_response(response)
    raw: Any = response.internal_response.raw
    with _broken_body():
        if fp is None:
            return int(raw.readinto(out))
        n = fp.readinto(out)
    left = raw.length_remaining
    _account(raw, fp, n)
    if not n and len(out) and left:  # the connection ended before Content-Length
        raise IncompleteReadError(f"the body was cut short: {left} bytes missing")
    return n


def read_all(response: Any) -> bytes:
    """The rest of the body (http.client raises ``IncompleteRead`` if it is cut short)."""
    fp = direct_response(response)
    raw: Any = response.internal_response.raw
    with _broken_body():
        if fp is None:
            return bytes(raw.read())
        data = fp.read()
    _account(raw, fp, len(data))
    return data


def close(response: Any) -> None:
    """Drop a response whose body was not read to its end (its connection too)."""
    with contextlib.suppress(Exception):
        response.close()
