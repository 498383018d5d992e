"""Zero-copy request and response bodies: the one place that leans on botocore's and
urllib3's internals (pinned in ``requirements/constraints.txt``).

Uploads: a part's body is handed to botocore as the ``memoryview`` of its pooled
buffer. urllib3 then sends the whole view with one ``sendall``: no copy, and no
``Expect: 100-continue`` round trip, which botocore adds only for file-like bodies
(``botocore.handlers.add_expect_header`` tests ``hasattr(body, "read")``). Signing is
the exception: botocore's CRT signer (used whenever ``awscrt`` is installed) wraps any
body that is not ``bytes`` or a stream in a ``BytesIO``, a copy of the whole part. So
just for signing, the body is a :class:`PartStream` over the same bytes (the
``before-sign.s3`` event), swapped back to the view once the request is signed: botocore
signs in a ``request-created.s3`` handler of its own (which emits ``before-sign``), and
the swap back is registered last on that same event. Relied on: those events and that
order, and ``AWSRequest.data`` being what the prepared body is made from.

Downloads: :func:`readinto` fills the caller's buffer straight from the socket through
the ``http.client.HTTPResponse`` inside urllib3's response
(``StreamingBody._raw_stream._fp``), keeping urllib3's byte accounting
(``_fp_bytes_read``, ``length_remaining``) and handing the connection back
(``release_conn``) as its own ``read`` does. Where any of that is missing it falls back
to urllib3's ``readinto`` (correct, three copies slower).

``tests/test_backend_s3.py`` checks every internal named here against the pinned
versions, so an upgrade that changes them fails loudly instead of silently copying.
"""

from __future__ import annotations

import http.client
import io
from typing import Any

from botocore.exceptions import ReadTimeoutError, ResponseStreamingError

from dcpstore.plugin import http_body

__all__ = [
    "PartStream",
    "direct_response",
    "install_body_handlers",
    "readinto",
    "skip",
]

_SIGNED_BODY = "dcpstore_body"
#: The events the body swap hangs on (see the module docstring).
BEFORE_SIGN = "before-sign.s3"
AFTER_SIGN = "request-created.s3"


class PartStream(io.RawIOBase):
    """A seekable, read-only stream over a view: what the signer reads a part through."""

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


def _body_to_stream(request: Any, **kwargs: Any) -> None:
    """``before-sign``: let the signer read a view body through a stream (no copy)."""
    body = request.data  # AWSRequest.body is derived from it
    if isinstance(body, memoryview):
        request.context[_SIGNED_BODY] = body
        request.data = PartStream(body)


def _stream_to_body(request: Any, **kwargs: Any) -> None:
    """``request-created``, after signing: send the view itself again."""
    body = request.context.pop(_SIGNED_BODY, None)
    if body is not None:
        request.data = body


def install_body_handlers(client: Any) -> None:
    """Send upload bodies as views: one ``sendall`` each, signed through a stream."""
    events = client.meta.events
    events.register(BEFORE_SIGN, _body_to_stream)
    events.register_last(AFTER_SIGN, _stream_to_body)


def direct_response(body: Any) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under a botocore ``StreamingBody`` when its bytes can
    be read straight into a caller's buffer, else ``None``
    (:func:`dcpstore.plugin.http_body.direct_response`)."""
    return http_body.direct_response(getattr(body, "_raw_stream", None))


def readinto(body: Any, out: memoryview) -> int:
    """``body.readinto(out)``, straight from the socket when possible
    (:func:`dcpstore.plugin.http_body.readinto`); errors as botocore raises them."""
    try:
        n = http_body.readinto(getattr(body, "_raw_stream", None), out)
    except TimeoutError as exc:
        raise ReadTimeoutError(endpoint_url="", error=exc) from exc
    except (http.client.HTTPException, OSError) as exc:
        raise ResponseStreamingError(error=exc) from exc
    return int(body.readinto(out)) if n is None else n


def skip(body: Any, count: int) -> None:
    """Read and drop ``count`` bytes of a response body."""
    chunk = bytearray(min(count, 1024 * 1024))
    view = memoryview(chunk)
    left = count
    while left:
        n = body.readinto(view[: min(left, len(view))])
        if not n:
            raise EOFError("response ended while skipping to the requested offset")
        left -= n
