"""Reading an HTTP response body straight into a caller's buffer, for plugins whose SDK
sits on urllib3 (botocore, azure-core's requests transport).

urllib3's ``readinto`` reads into a temporary ``bytes`` (which ``http.client`` fills
through a zeroed temporary of its own) and copies that into the caller's buffer: three
extra passes over every byte of a checkpoint. :func:`readinto` reads from the
``http.client.HTTPResponse`` under urllib3's response instead, keeping urllib3's byte
accounting (``_fp_bytes_read``, ``length_remaining``) and handing the connection back to
its pool (``release_conn``) as urllib3's own ``read`` does. Where any of those internals
is missing (another urllib3, a chunked or content-encoded body) it returns ``None`` and
the caller uses the SDK's public read. A plugin's tests check these internals against
its pinned versions (see the S3 and Azure plugins' tests).

Duck-typed: nothing here imports urllib3.
"""

from __future__ import annotations

import http.client
from typing import Any

__all__ = ["direct_response", "read_all", "readinto"]


def direct_response(raw: Any) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under urllib3 response ``raw`` when its bytes can be
    read straight into a caller's buffer (a plain body: not chunked, not
    content-encoded), else ``None``."""
    fp = getattr(raw, "_fp", None)
    if (not isinstance(fp, http.client.HTTPResponse) or fp.chunked
            or raw.headers.get("content-encoding") or not hasattr(raw, "_fp_bytes_read")
            or not hasattr(raw, "length_remaining") or not hasattr(raw, "release_conn")):
        return None
    return fp


def _account(raw: Any, fp: http.client.HTTPResponse, n: int) -> None:
    raw._fp_bytes_read += n
    if raw.length_remaining is not None:
        raw.length_remaining -= n
    if fp.isclosed():  # all of it read: hand the connection back to the pool
        raw.release_conn()


def readinto(raw: Any, out: memoryview) -> int | None:
    """Read the next bytes of ``raw``'s body into ``out``: their count (0 at its end), or
    ``None`` where :func:`direct_response` says it cannot (use the SDK's read).

    Raises:
        http.client.IncompleteRead: The connection ended before ``Content-Length``.
        OSError: From the socket (``TimeoutError`` for a read timeout).
    """
    fp = direct_response(raw)
    if fp is None:
        return None
    n = fp.readinto(out)
    left = raw.length_remaining
    _account(raw, fp, n)
    if not n and len(out) and left:
        raise http.client.IncompleteRead(b"", left)
    return n


def read_all(raw: Any) -> bytes | None:
    """The rest of ``raw``'s body, or ``None`` where :func:`direct_response` says it
    cannot (``http.client`` raises ``IncompleteRead`` for a body cut short)."""
    fp = direct_response(raw)
    if fp is None:
        return None
    data = fp.read()
    _account(raw, fp, len(data))
    return data
