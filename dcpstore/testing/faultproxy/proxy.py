"""The fault proxy's server: its life cycle, the listener and one thread per client
connection (TLS handshake included); each request is served by
:class:`~dcpstore.testing.faultproxy.exchange._Exchange`."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import socket
import ssl
import threading
import time
from collections import Counter
from types import TracebackType
from urllib.parse import urlsplit

from dcpstore.testing.faultproxy.exchange import _Exchange
from dcpstore.testing.faultproxy.forwarding import _Upstream
from dcpstore.testing.faultproxy.rules import FaultPlan
from dcpstore.testing.faultproxy.stats import ProxyStats
from dcpstore.testing.faultproxy.wire import (
    _Abort,
    _BadMessage,
    _Closed,
    _parse_head,
    _Reader,
    _send_reset,
)

__all__ = ["FaultProxy"]

logger = logging.getLogger(__name__)


class FaultProxy(_Exchange):
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
