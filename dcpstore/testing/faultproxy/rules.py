"""Which requests a :class:`~dcpstore.testing.faultproxy.FaultProxy` faults, and how a
faulted request is answered.

A :class:`FaultPlan` picks requests by rate and by a ``match`` over
:class:`RequestInfo` (the request's method, path, :func:`classify` kind and object
name); :func:`error_response` is the S3 XML or GCS JSON error a ``"503"`` / ``"500"``
fault (and a throttled request) gets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

__all__ = [
    "FAULT_KINDS",
    "FaultPlan",
    "RequestInfo",
    "classify",
    "error_response",
]

#: Fault kinds a :class:`FaultPlan` can pick from (``"stall"`` is :attr:`FaultPlan.stall`).
FAULT_KINDS: tuple[str, ...] = ("503", "500", "reset", "truncate", "delay")

#: Bytes of a GCS multipart upload body inspected for the object name.
_PEEK = 16 * 1024
_S3_LIST_PARAMS = frozenset({
    "list-type", "prefix", "delimiter", "marker", "continuation-token", "max-keys",
    "uploads", "versions", "start-after",
})
_GCS_NAME = re.compile(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class RequestInfo:
    """What the proxy knows about a request when it decides on a fault.

    Attributes:
        method: HTTP method (upper case).
        path: URL path (still percent-encoded), e.g. ``/bucket/ckpt/.metadata``.
        query: Raw query string without ``?``.
        kind: :func:`classify` of the request.
        object_name: The object the request names, decoded: the S3 key after the
            bucket (path-style addressing), the GCS object name from the URL, the
            ``name`` query parameter or the metadata of a multipart upload; ``""`` for
            bucket-level requests (listings).
    """

    method: str
    path: str
    query: str
    kind: str
    object_name: str = ""


@dataclass
class FaultPlan:
    """Which requests get which faults.

    Attributes:
        rate: Probability that a (matching) request is faulted.
        kinds: Fault kinds to choose from, uniformly (see :data:`FAULT_KINDS`).
        delay_s: ``"delay"`` answers after this many seconds (beyond the client's
            timeout).
        stall: Every matching request hangs until the client gives up or the proxy
            stops (``rate`` and ``kinds`` are then ignored).
        match: Only requests for which this returns true may be faulted (all when
            ``None``).
        max_faults: Stop injecting after this many faults under this plan.
    """

    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    delay_s: float = 30.0
    stall: bool = False
    match: Callable[[RequestInfo], bool] | None = None
    max_faults: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")
        unknown = [k for k in self.kinds if k not in FAULT_KINDS]
        if unknown or (self.rate > 0 and not self.kinds):
            raise ValueError(f"kinds must be non-empty and from {FAULT_KINDS}, got {self.kinds}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")


def classify(method: str, path: str, query: str) -> str:
    """The kind of a request: ``"PUT"``, ``"GET"``, ``"HEAD"``, ``"LIST"``, ``"POST"``,
    ``"DELETE"`` (other methods as they are).

    ``LIST`` is a listing ``GET``: on S3 a bucket-level ``GET`` (``?list-type=2``,
    ``?prefix=``, ``?uploads``, ...), on GCS ``/storage/v1/b/<bucket>/o`` without an
    object name.
    """
    method = method.upper()
    if method != "GET":
        return method
    for prefix in ("/storage/v1/b/", "/download/storage/v1/b/"):
        if path.startswith(prefix):
            segments = path[len(prefix):].strip("/").split("/")
            return "LIST" if len(segments) == 2 and segments[1] == "o" else "GET"
    segments = path.strip("/").split("/", 1)
    if len(segments) == 1:  # "/", "/bucket" or "/bucket/": a bucket-level request
        params = parse_qs(query, keep_blank_values=True)
        if not params or _S3_LIST_PARAMS & set(params):
            return "LIST"
    return "GET"


def _object_name(path: str, query: str) -> str:
    """The object a request names (see :attr:`RequestInfo.object_name`)."""
    for prefix in ("/storage/v1/b/", "/download/storage/v1/b/", "/upload/storage/v1/b/"):
        if path.startswith(prefix):
            segments = path[len(prefix):].split("/")
            if len(segments) >= 3 and segments[1] == "o" and segments[2]:
                return unquote(segments[2])
            names = parse_qs(query).get("name")
            return names[0] if names else ""
    segments = path.lstrip("/").split("/", 1)
    return unquote(segments[1]) if len(segments) == 2 else ""


def _is_gcs_path(path: str) -> bool:
    return path.startswith(("/storage/", "/upload/", "/download/"))


def error_response(status: int, info: RequestInfo, request_id: str, *, close: bool
                   ) -> tuple[bytes, bytes]:
    """The head and the payload of the error a faulted (or throttled) request gets.

    Args:
        status: 500 (``InternalError``) or 503 (``SlowDown``).
        info: The request: a GCS JSON API path gets a GCS JSON error, any other an S3
            XML error.
        request_id: The request id header's value.
        close: Whether the head says ``Connection: close``.

    Returns:
        ``(head, payload)``: the status line and headers (through the blank line), and
        the body its ``Content-Length`` counts.
    """
    if _is_gcs_path(info.path):
        reason = "backendError"
        message = ("We encountered an internal error. Please try again." if status == 500
                   else "The service is currently unavailable (injected fault).")
        payload = json.dumps({"error": {
            "code": status, "message": message,
            "errors": [{"domain": "global", "reason": reason, "message": message}],
        }}).encode()
        headers = [("Content-Type", "application/json; charset=UTF-8"),
                   ("X-GUploader-UploadID", request_id)]
    else:
        code, message = (("InternalError", "We encountered an internal error. Please "
                          "try again.") if status == 500
                         else ("SlowDown", "Please reduce your request rate."))
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{info.path}</Resource><RequestId>{request_id}</RequestId>"
            "<HostId>faultproxy</HostId></Error>"
        ).encode()
        headers = [("Content-Type", "application/xml"), ("x-amz-request-id", request_id),
                   ("x-amz-id-2", "faultproxy")]
    reason_phrase = "Internal Server Error" if status == 500 else "Service Unavailable"
    lines = [f"HTTP/1.1 {status} {reason_phrase}"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines += [f"Content-Length: {len(payload)}",
              f"Connection: {'close' if close else 'keep-alive'}", "", ""]
    head = "\r\n".join(lines).encode("latin-1")
    return head, payload
