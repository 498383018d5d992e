"""A fault-injecting HTTP/1.1 reverse proxy for reliability tests of object-store backends.

Put it in front of an S3 or GCS stand-in on 127.0.0.1 and point a backend's
``endpoint_url`` at :attr:`FaultProxy.endpoint_url`::

    with FaultProxy(server.endpoint_url, FaultPlan(rate=0.1), seed=3) as proxy:
        dcpstore.save(state, "s3://bucket/ckpt", endpoint_url=proxy.endpoint_url)
        print(proxy.stats.faults)

In front of a stand-in served over HTTPS, give the proxy a server-side ``tls`` context
(``TLSFiles.server_context()`` of :mod:`dcpstore.testing.tls`): it then serves HTTPS with
that certificate, and reaches the ``https://`` upstream trusting ``upstream_tls``. It
reads every request in the clear between the two, so it counts and faults exactly as
over plain HTTP.

Every request is forwarded unchanged (``Host`` included, so SigV4 signatures stay
valid) except those the :class:`FaultPlan` picks, which get one of these faults:

``"503"`` / ``"500"``
    An S3-style XML error (``SlowDown`` / ``InternalError``) or, for GCS JSON API paths
    (``/storage/...``, ``/upload/...``), a GCS JSON error, with a request id header. The
    upstream never sees the request.
``"reset"``
    The client connection is reset (``SO_LINGER`` 0, so the client sees ``ECONNRESET``)
    after part of the request body was read, or after all of it, before any response.
    The upstream never sees the request.
``"truncate"``
    The request *is* forwarded and processed upstream; the client gets the real status
    and headers, but the response body is cut short (for a response without a body,
    the status line is cut) and the connection closed. This is the case that matters
    for non-idempotent requests: the client cannot tell that its request succeeded.
``"delay"``
    The proxy answers only after :attr:`FaultPlan.delay_s` (longer than the client's
    timeout): the client gives up first. If it is still connected then, the request is
    forwarded and answered normally.
``stall``
    (:attr:`FaultPlan.stall`) Matching requests are accepted and never answered, until
    the client gives up or :meth:`FaultProxy.stop`.

Besides faults, the proxy can stand in for a store that serves only so many requests at
once (``max_in_flight``): the requests beyond it wait for a free slot (``over_limit=
"queue"``, a server with that many workers) or are answered ``503 SlowDown`` (``"503"``,
a store that throttles). :attr:`ProxyStats.peak_in_flight` counts the most requests a
client had open at once either way.

The proxy is a small thread-per-connection design on the standard library only. Bodies
are streamed in both directions (``Content-Length`` or chunked, never buffered whole),
connections are kept alive on both sides, and ``Expect: 100-continue`` is answered by
the proxy itself. Fault decisions come from ``random.Random(seed)``, so a run with
sequential requests is reproducible. :meth:`FaultProxy.stop` returns promptly even
while requests are stalled: it shuts every socket down.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import random
import re
import select
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = [
    "FAULT_KINDS",
    "FaultPlan",
    "FaultProxy",
    "FaultRecord",
    "ProxyStats",
    "RequestInfo",
    "classify",
]

logger = logging.getLogger(__name__)

#: Fault kinds a :class:`FaultPlan` can pick from (``"stall"`` is :attr:`FaultPlan.stall`).
FAULT_KINDS: tuple[str, ...] = ("503", "500", "reset", "truncate", "delay")

_CHUNK = 256 * 1024
_MAX_HEAD = 64 * 1024
#: Bytes of a GCS multipart upload body inspected for the object name.
_PEEK = 16 * 1024
_S3_LIST_PARAMS = frozenset({
    "list-type", "prefix", "delimiter", "marker", "continuation-token", "max-keys",
    "uploads", "versions", "start-after",
})
_NO_BODY_STATUS = frozenset({204, 304})
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


class FaultRecord(NamedTuple):
    """One injected fault: the request's method and path, and the fault kind."""

    method: str
    path: str
    kind: str


@dataclass
class ProxyStats:
    """What went through a :class:`FaultProxy` (since start or :meth:`FaultProxy.reset_stats`).

    Attributes:
        requests: Requests seen, by :func:`classify` kind (faulted ones included).
        faults: Faults injected, by fault kind (``"stall"`` included).
        bytes_up: Request body bytes received from clients.
        bytes_down: Response body bytes sent to clients.
        log: Every injected fault, in order.
        peak_in_flight: Most requests open at once (read, not yet answered).
        throttled: Requests answered ``503 SlowDown`` for exceeding ``max_in_flight``
            (not counted in :attr:`faults`).
    """

    requests: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    bytes_up: int = 0
    bytes_down: int = 0
    log: list[FaultRecord] = field(default_factory=list)
    peak_in_flight: int = 0
    throttled: int = 0

    @property
    def total_requests(self) -> int:
        """All requests seen."""
        return sum(self.requests.values())

    @property
    def total_faults(self) -> int:
        """All faults injected."""
        return sum(self.faults.values())


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


class _Closed(Exception):
    """The peer closed the connection in the middle of a message."""


class _BadMessage(Exception):
    """Not a well-formed HTTP/1.x message."""


class _Reader:
    """Buffered reads from a socket (head lines, bounded body reads)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(_CHUNK)
        if not data:
            return False
        self.buf += data
        return True

    def read_head(self) -> bytes | None:
        """One message head (through the blank line); ``None`` at a clean EOF."""
        while True:
            while self.buf[:2] == b"\r\n":  # stray CRLF between messages is allowed
                del self.buf[:2]
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self.buf[: end + 4])
                del self.buf[: end + 4]
                return head
            if len(self.buf) > _MAX_HEAD:
                raise _BadMessage("message head too large")
            if not self._fill():
                if self.buf:
                    raise _Closed("connection closed inside a message head")
                return None

    def readline(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[: end + 2])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > _MAX_HEAD:
                raise _BadMessage("line too long")
            if not self._fill():
                raise _Closed("connection closed inside a line")

    def read_some(self, limit: int) -> bytes:
        """Up to ``limit`` (> 0) bytes; ``b""`` only at EOF."""
        if self.buf:
            data = bytes(self.buf[:limit])
            del self.buf[:limit]
            return data
        return self.sock.recv(min(limit, _CHUNK))


@dataclass
class _Message:
    """A parsed request or response head."""

    start: str  # request line or status line
    headers: list[tuple[str, str]]
    raw: bytes

    def get(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def tokens(self, name: str) -> set[str]:
        name = name.lower()
        return {t.strip().lower() for k, v in self.headers if k.lower() == name
                for t in v.split(",")}

    def wants_close(self) -> bool:
        words = self.start.split(" ")
        version = words[0] if self.start.startswith("HTTP/") else words[-1]
        conn = self.tokens("connection")
        if "close" in conn:
            return True
        return version.endswith("/1.0") and "keep-alive" not in conn


def _parse_head(raw: bytes) -> _Message:
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError as exc:  # pragma: no cover - latin-1 decodes anything
        raise _BadMessage(str(exc)) from exc
    lines = text.split("\r\n")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadMessage(f"malformed header line {line!r}")
        headers.append((name.strip(), value.strip()))
    return _Message(lines[0], headers, raw)


class _Body:
    """Payload of one message, read incrementally (``Content-Length``, chunked or
    until EOF), with a peek buffer."""

    def __init__(self, reader: _Reader, *, length: int | None = None, chunked: bool = False,
                 until_eof: bool = False) -> None:
        self.reader = reader
        self.chunked = chunked
        self.until_eof = until_eof
        self.remaining = length or 0
        self.length = length
        self.done = not chunked and not until_eof and not length
        self.total = 0
        self.counted = 0  # of total, what is in the proxy's stats already
        self._chunk_left = 0
        self._pending = bytearray()

    @classmethod
    def of(cls, reader: _Reader, msg: _Message, *, request: bool, no_body: bool = False
           ) -> _Body:
        if no_body:
            return cls(reader)
        if "chunked" in msg.tokens("transfer-encoding"):
            return cls(reader, chunked=True)
        length = msg.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError as exc:
                raise _BadMessage(f"bad Content-Length {length!r}") from exc
            return cls(reader, length=n)
        return cls(reader) if request else cls(reader, until_eof=True)

    def _read_raw(self, limit: int) -> bytes:
        if self.done:
            return b""
        if self.chunked:
            if self._chunk_left == 0:
                line = self.reader.readline()
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.reader.readline() != b"\r\n":  # trailers
                        pass
                    self.done = True
                    return b""
                self._chunk_left = size
            data = self.reader.read_some(min(limit, self._chunk_left))
            if not data:
                raise _Closed("connection closed inside a chunked body")
            self._chunk_left -= len(data)
            if self._chunk_left == 0 and self.reader.readline() != b"\r\n":
                raise _BadMessage("chunk not followed by CRLF")
            return data
        if self.until_eof:
            data = self.reader.read_some(limit)
            if not data:
                self.done = True
            return data
        data = self.reader.read_some(min(limit, self.remaining))
        if not data:
            raise _Closed(f"connection closed with {self.remaining} body bytes missing")
        self.remaining -= len(data)
        if self.remaining == 0:
            self.done = True
        return data

    def read(self, limit: int = _CHUNK) -> bytes:
        """Up to ``limit`` payload bytes; ``b""`` at the end of the body."""
        if self._pending:
            data = bytes(self._pending[:limit])
            del self._pending[:limit]
            return data
        data = self._read_raw(limit)
        self.total += len(data)
        return data

    def peek(self, n: int) -> bytes:
        """The next (up to) ``n`` payload bytes, without consuming them."""
        while len(self._pending) < n and not self.done:
            data = self._read_raw(n - len(self._pending))
            self.total += len(data)
            self._pending += data
        return bytes(self._pending[:n])

    def drain(self) -> None:
        while self.read():
            pass

    def __iter__(self) -> Iterator[bytes]:
        while True:
            data = self.read()
            if not data:
                return
            yield data


class _Abort(Exception):
    """Close the client connection now (a fault or a broken peer)."""

    def __init__(self, reset: bool = False) -> None:
        super().__init__("abort")
        self.reset = reset


def _send_reset(sock: socket.socket) -> None:
    """Close ``sock`` with an RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


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


class FaultProxy:
    """A fault-injecting reverse proxy on ``127.0.0.1`` (a random free port).

    Use as a context manager, or call :meth:`start` and :meth:`stop`.

    Args:
        upstream_url: ``http://host:port`` or ``https://host:port`` of the server to
            proxy.
        plan: Which faults to inject (default: none). Replace it at any time by
            assigning :attr:`plan`.
        seed: Seed of the fault decisions.
        max_in_flight: Requests served at once (``None``: no limit); see ``over_limit``.
        over_limit: What a request beyond ``max_in_flight`` gets: ``"queue"`` (it waits
            for a free slot) or ``"503"`` (a ``SlowDown`` / GCS 503 answer, counted in
            :attr:`ProxyStats.throttled`).
        tls: Serve HTTPS to clients with this server-side context (``None``: plain
            HTTP); :attr:`endpoint_url` is then ``https://``.
        upstream_tls: Client-side context for an ``https://`` upstream (``None``: the
            system's default trust, ``ssl.create_default_context()``).

    Attributes:
        stats: What went through (see :class:`ProxyStats`).
    """

    def __init__(self, upstream_url: str, plan: FaultPlan | None = None, *, seed: int = 0,
                 max_in_flight: int | None = None, over_limit: str = "queue",
                 tls: ssl.SSLContext | None = None,
                 upstream_tls: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream_url must be an http:// or https:// URL, got "
                             f"{upstream_url!r}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if over_limit not in ("queue", "503"):
            raise ValueError(f"over_limit must be 'queue' or '503', got {over_limit!r}")
        self.max_in_flight = max_in_flight
        self.over_limit = over_limit
        self._in_flight = 0
        self._slots = threading.Semaphore(max_in_flight) if max_in_flight else None
        self.upstream_url = upstream_url
        https = parts.scheme == "https"
        self._upstream = (parts.hostname, parts.port or (443 if https else 80))
        self._upstream_tls = (upstream_tls or ssl.create_default_context()) if https else None
        self._tls = tls
        self._plan = plan if plan is not None else FaultPlan()
        self._plan_faults = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.stats = ProxyStats()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._port = 0

    # -- public interface ----------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>`` (``https://`` with ``tls``; after :meth:`start`)."""
        if not self._port:
            raise RuntimeError("the proxy is not started")
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self._port}"

    @property
    def plan(self) -> FaultPlan:
        """The fault plan in force; assign a new one to change it (thread-safe)."""
        with self._lock:
            return self._plan

    @plan.setter
    def plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self._plan = plan
            self._plan_faults = 0

    def snapshot(self) -> ProxyStats:
        """A consistent copy of :attr:`stats` (safe while requests are in flight)."""
        with self._lock:
            st = self.stats
            return ProxyStats(Counter(st.requests), Counter(st.faults), st.bytes_up,
                              st.bytes_down, list(st.log), st.peak_in_flight, st.throttled)

    def reset_stats(self) -> None:
        """Zero :attr:`stats` (in place)."""
        with self._lock:
            self.stats.requests.clear()
            self.stats.faults.clear()
            self.stats.bytes_up = 0
            self.stats.bytes_down = 0
            self.stats.log.clear()
            self.stats.peak_in_flight = self._in_flight
            self.stats.throttled = 0

    def start(self) -> FaultProxy:
        """Bind and start accepting connections."""
        if self._listener is not None:
            raise RuntimeError("the proxy is already started")
        self._stopping.clear()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.settimeout(0.1)  # the accept loop polls for stop()
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"faultproxy-{self._port}")
        self._acceptor.start()
        logger.debug("fault proxy %s -> %s", self.endpoint_url, self.upstream_url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop: close the listener and every connection (stalled ones included).

        Args:
            timeout: Seconds to wait for the connection threads to finish.
        """
        self._stopping.set()
        listener, self._listener = self._listener, None
        if self._acceptor is not None:
            self._acceptor.join(timeout)
            self._acceptor = None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        with self._lock:
            sockets = list(self._sockets)
            threads = list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.endpoint_url if self._port else "not started"
        return f"FaultProxy({where} -> {self.upstream_url})"

    # -- connections ---------------------------------------------------------------------

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
        if self._stopping.is_set():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._track(client)
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True,
                                      name=f"faultproxy-{self._port}-conn")
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        upstream = _Upstream(self)
        reset = False
        try:
            if self._tls is not None:
                client = self._handshake(client)
            reader = _Reader(client)
            while not self._stopping.is_set():
                raw = reader.read_head()
                if raw is None:
                    return
                if not self._handle(_parse_head(raw), reader, client, upstream):
                    return
        except _Abort as abort:
            reset = abort.reset
        except (OSError, _Closed, _BadMessage, ValueError) as exc:
            if not self._stopping.is_set():
                logger.debug("fault proxy connection ended: %s: %s", type(exc).__name__, exc)
        finally:
            upstream.close()
            self._untrack(client)
            if reset:
                _send_reset(client)
            else:
                with contextlib.suppress(OSError):
                    client.close()
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _handshake(self, client: socket.socket) -> ssl.SSLSocket:
        """``client`` as a TLS server socket, handshake done (in this connection's
        thread; tracked first, so that :meth:`stop` can interrupt it)."""
        assert self._tls is not None
        self._untrack(client)
        try:
            wrapped = self._tls.wrap_socket(client, server_side=True,
                                            do_handshake_on_connect=False)
        except BaseException:
            with contextlib.suppress(OSError):
                client.close()
            raise
        self._track(wrapped)
        try:
            wrapped.do_handshake()
        except BaseException:  # e.g. a client that does not trust the certificate
            self._untrack(wrapped)
            with contextlib.suppress(OSError):
                wrapped.close()
            raise
        return wrapped

    # -- one request ---------------------------------------------------------------------

    def _handle(self, req: _Message, reader: _Reader, client: socket.socket,
                upstream: _Upstream) -> bool:
        """Serve one request; return whether the client connection stays open."""
        try:
            method, target, _version = req.start.split(" ", 2)
        except ValueError as exc:
            raise _BadMessage(f"malformed request line {req.start!r}") from exc
        if "://" in target:  # absolute-form
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        path, _, query = target.partition("?")
        method = method.upper()
        body = _Body.of(reader, req, request=True)
        expect = "100-continue" in req.tokens("expect")
        continued = False

        def go_on() -> None:  # the client may send its body now
            nonlocal continued
            if expect and not continued and not body.done:
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            continued = True

        name = _object_name(path, query)
        if not name and method == "POST" and path.startswith("/upload/") and not body.done:
            go_on()  # a GCS multipart upload names its object in the first body part
            match = _GCS_NAME.search(body.peek(_PEEK))
            if match is not None:
                with contextlib.suppress(ValueError):
                    name = json.loads(b'"' + match.group(1) + b'"')
        info = RequestInfo(method, path, query, classify(method, path, query), name)
        fault, u, v, delay = self._decide(info)
        with self._lock:
            self._in_flight += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self._in_flight)
            over = (self.max_in_flight is not None and self.over_limit == "503"
                    and self._in_flight > self.max_in_flight)
            if over:
                self.stats.throttled += 1
        slot = self._slots if fault is None and not over else None
        try:
            if over:
                go_on()
                body.drain()
                self._count_up(body)
                client.sendall(self._error_response(503, info, head_only=method == "HEAD",
                                                    close=req.wants_close()))
                return not req.wants_close()
            while slot is not None and not slot.acquire(timeout=0.2):  # a store with
                if self._stopping.is_set():  # max_in_flight workers (over_limit="queue")
                    slot = None
                    raise _Abort()
            try:
                if fault is None:
                    return self._forward(req, info, body, go_on, client, upstream)
                return self._inject(fault, u, v, delay, req, info, body, go_on, client,
                                    upstream)
            finally:
                if slot is not None:
                    slot.release()
        finally:
            with self._lock:
                self._in_flight -= 1
            self._count_up(body)

    def _count_up(self, body: _Body) -> None:
        """Add the request body bytes read so far to the stats (before the client can
        see an answer, so the stats are current once it has one)."""
        with self._lock:
            self.stats.bytes_up += body.total - body.counted
        body.counted = body.total

    def _count_down(self, n: int) -> None:
        with self._lock:
            self.stats.bytes_down += n

    def _decide(self, info: RequestInfo) -> tuple[str | None, float, float, float]:
        plan = self.plan
        matched = True
        if plan.match is not None:
            try:
                matched = bool(plan.match(info))
            except Exception as exc:
                logger.warning("fault plan match() raised %r for %s %s", exc, info.method,
                               info.path)
                matched = False
        with self._lock:
            self.stats.requests[info.kind] += 1
            if plan is not self._plan:  # replaced meanwhile: decide with the new one
                plan = self._plan
            fault: str | None = None
            if matched and plan.stall:
                fault = "stall"
            elif (matched and plan.rate > 0
                  and (plan.max_faults is None or self._plan_faults < plan.max_faults)
                  and self._rng.random() < plan.rate):
                fault = self._rng.choice(plan.kinds)
                self._plan_faults += 1
            if fault is None:
                return None, 0.0, 0.0, 0.0
            self.stats.faults[fault] += 1
            self.stats.log.append(FaultRecord(info.method, info.path, fault))
            u, v = self._rng.random(), self._rng.random()
        logger.info("fault proxy: %s on %s %s", fault, info.method, info.path)
        return fault, u, v, plan.delay_s

    def _inject(self, fault: str, u: float, v: float, delay: float, req: _Message,
                info: RequestInfo, body: _Body, go_on: Callable[[], None],
                client: socket.socket, upstream: _Upstream) -> bool:
        if fault == "stall":
            self._wait_for_close(client, None)
            raise _Abort()
        if fault in ("503", "500"):
            go_on()
            body.drain()
            self._count_up(body)
            client.sendall(self._error_response(int(fault), info, head_only=info.method == "HEAD",
                                                close=req.wants_close()))
            return not req.wants_close()
        if fault == "reset":
            if not body.done and v < 0.5:
                go_on()  # reset in the middle of the request body
                want = body.length if body.length is not None else 2 * _CHUNK
                left = int(u * want)
                while left > 0:
                    data = body.read(min(left, _CHUNK))
                    if not data:
                        break
                    left -= len(data)
            else:
                go_on()
                body.drain()
            raise _Abort(reset=True)
        if fault == "delay":
            go_on()
            body.drain()
            if self._wait_for_close(client, delay):
                raise _Abort()
            return self._forward(req, info, body, go_on, client, upstream)
        if fault == "truncate":
            self._forward(req, info, body, go_on, client, upstream, truncate=u)
            raise _Abort()
        raise ValueError(f"unknown fault kind {fault!r}")

    def _wait_for_close(self, client: socket.socket, timeout: float | None) -> bool:
        """Wait until the client closes or the proxy stops (``True``), or ``timeout``
        seconds pass (``False``). Whatever the client sends meanwhile is discarded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stopping.is_set():
            wait = 0.2
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                wait = min(wait, left)
            try:
                readable, _, _ = select.select([client], [], [], wait)
                if readable and not client.recv(_CHUNK):
                    return True
            except (OSError, ValueError):
                return True
        return True

    def _error_response(self, status: int, info: RequestInfo, *, head_only: bool,
                        close: bool) -> bytes:
        rid = f"faultproxy-{next(self._ids):08d}"
        if _is_gcs_path(info.path):
            reason = "backendError"
            message = ("We encountered an internal error. Please try again." if status == 500
                       else "The service is currently unavailable (injected fault).")
            payload = json.dumps({"error": {
                "code": status, "message": message,
                "errors": [{"domain": "global", "reason": reason, "message": message}],
            }}).encode()
            headers = [("Content-Type", "application/json; charset=UTF-8"),
                       ("X-GUploader-UploadID", rid)]
        else:
            code, message = (("InternalError", "We encountered an internal error. Please "
                              "try again.") if status == 500
                             else ("SlowDown", "Please reduce your request rate."))
            payload = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<Resource>{info.path}</Resource><RequestId>{rid}</RequestId>"
                "<HostId>faultproxy</HostId></Error>"
            ).encode()
            headers = [("Content-Type", "application/xml"), ("x-amz-request-id", rid),
                       ("x-amz-id-2", "faultproxy")]
        reason_phrase = "Internal Server Error" if status == 500 else "Service Unavailable"
        lines = [f"HTTP/1.1 {status} {reason_phrase}"]
        lines += [f"{k}: {v}" for k, v in headers]
        lines += [f"Content-Length: {len(payload)}",
                  f"Connection: {'close' if close else 'keep-alive'}", "", ""]
        head = "\r\n".join(lines).encode("latin-1")
        if head_only:
            return head
        self._count_down(len(payload))
        return head + payload

    # -- forwarding ----------------------------------------------------------------------

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
            for data in body:
                if body.chunked:
                    sock.sendall(b"%x\r\n" % len(data) + data + b"\r\n")
                else:
                    sock.sendall(data)
            if body.chunked:
                sock.sendall(b"0\r\n\r\n")
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
            for data in resp_body:
                self._count_down(len(data))
                if resp_body.chunked:
                    client.sendall(b"%x\r\n" % len(data) + data + b"\r\n")
                else:
                    client.sendall(data)
            if resp_body.chunked:
                client.sendall(b"0\r\n\r\n")
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
