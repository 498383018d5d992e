"""Forwarding a request upstream and relaying the answer (whole, or cut short for a
``"truncate"`` fault), over one upstream connection per client connection."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from dcpstore.testing.faultproxy.rules import RequestInfo
from dcpstore.testing.faultproxy.stats import ProxyStats
from dcpstore.testing.faultproxy.wire import (
    _CHUNK,
    _Abort,
    _BadMessage,
    _Body,
    _Closed,
    _Message,
    _parse_head,
    _Reader,
)

if TYPE_CHECKING:
    from dcpstore.testing.faultproxy.proxy import FaultProxy

__all__: list[str] = []

logger = logging.getLogger(__name__)

_NO_BODY_STATUS = frozenset({204, 304})


class _Upstream:
    """The upstream connection of one client connection (kept alive between requests)."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.sock: socket.socket | None = None
        self.reader: _Reader | None = None

    def connect(self) -> tuple[socket.socket, _Reader]:
        if self.sock is not None and self.reader is not None:
            # an idle connection that is readable was closed (or broken) by the server
            readable, _, _ = select.select([self.sock], [], [], 0)
            pending = isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()
            if not readable and not pending and not self.reader.buf:
                return self.sock, self.reader
            self.close()
        sock = socket.create_connection(self.proxy._upstream, timeout=10)
        if self.proxy._upstream_tls is not None:
            try:
                sock = self.proxy._upstream_tls.wrap_socket(
                    sock, server_hostname=self.proxy._upstream[0])
            except BaseException:
                sock.close()
                raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.proxy._track(sock)
        self.sock, self.reader = sock, _Reader(sock)
        return sock, self.reader

    def close(self) -> None:
        sock, self.sock, self.reader = self.sock, None, None
        if sock is not None:
            self.proxy._untrack(sock)
            with contextlib.suppress(OSError):
                sock.close()


class _Relay:
    """The :class:`FaultProxy` methods that forward requests and count body bytes."""

    stats: ProxyStats
    _lock: threading.Lock

    def _count_up(self, body: _Body) -> None:
        """Add the request body bytes read so far to the stats (before the client can
        see an answer, so the stats are current once it has one)."""
        with self._lock:
            self.stats.bytes_up += body.total - body.counted
        body.counted = body.total

    def _count_down(self, n: int) -> None:
        with self._lock:
            self.stats.bytes_down += n

    def _forward(self, req: _Message, info: RequestInfo, body: _Body,
                 go_on: Callable[[], None], client: socket.socket, upstream: _Upstream,
                 truncate: float | None = None) -> bool:
        """Forward one request and relay the response; return keep-alive.

        With ``truncate`` (a fraction), the response is cut short and the caller closes
        the connection.
        """
        sock, up_reader = upstream.connect()
        head_lines = [req.start] + [f"{k}: {v}" for k, v in req.headers
                                    if k.lower() != "expect"]
        try:
            sock.sendall(("\r\n".join(head_lines) + "\r\n\r\n").encode("latin-1"))
            go_on()
            _send_body(sock, body)
        except OSError as exc:  # the server may answer early and close; read its answer
            logger.debug("fault proxy: sending to upstream failed: %s", exc)
        self._count_up(body)
        try:
            while True:
                raw = up_reader.read_head()
                if raw is None:
                    raise _Closed("upstream closed without a response")
                resp = _parse_head(raw)
                status = int(resp.start.split(" ", 2)[1])
                if 100 <= status < 200 and status != 101:
                    continue  # interim responses (we never forwarded an Expect)
                break
        except (OSError, _Closed, _BadMessage, ValueError, IndexError) as exc:
            upstream.close()
            logger.debug("fault proxy: no response from upstream: %s", exc)
            raise _Abort(reset=True) from exc
        no_body = info.method == "HEAD" or status in _NO_BODY_STATUS or status < 200
        resp_body = _Body.of(up_reader, resp, request=False, no_body=no_body)
        if truncate is not None:
            self._relay_truncated(resp, resp_body, client, truncate)
            upstream.close()
            return False
        try:
            client.sendall(resp.raw)
            _send_body(client, resp_body, self._count_down)
        except (_Closed, _BadMessage):
            upstream.close()
            raise _Abort() from None
        keep = not (req.wants_close() or resp.wants_close() or resp_body.until_eof)
        if resp.wants_close() or resp_body.until_eof:
            upstream.close()
        return keep

    def _relay_truncated(self, resp: _Message, body: _Body, client: socket.socket,
                         fraction: float) -> None:
        """Send the response head and only part of the body (or, for a response with
        no body, part of the head)."""
        if body.done:
            # No body to cut: cut the status line inside the status code, so the client
            # cannot mistake what it got for a complete response (http.client takes EOF
            # as the end of the headers, and "HTTP/1.1 200 O" as a status line).
            client.sendall(resp.raw[: int(fraction * (resp.raw.index(b" ") + 3))])
            return
        budget = int(fraction * (body.length if body.length is not None else _CHUNK))
        client.sendall(resp.raw)
        sent = 0
        while sent < budget:
            data = body.read(min(_CHUNK, budget - sent))
            if not data:
                break
            self._count_down(len(data))
            if body.chunked:
                client.sendall(b"%x\r\n" % len(data) + data + b"\r\n")
            else:
                client.sendall(data)
            sent += len(data)


def _send_body(sock: socket.socket, body: _Body,
               count: Callable[[int], None] | None = None) -> None:
    """Send ``body``'s pieces as they come, re-chunked if it was chunked; ``count`` is
    told each piece's length."""
    for data in body:
        if count is not None:
            count(len(data))
        sock.sendall(b"%x\r\n" % len(data) + data + b"\r\n" if body.chunked else data)
    if body.chunked:
        sock.sendall(b"0\r\n\r\n")
