"""One request through the fault proxy: read its head, decide on a fault under the
plan, then inject the fault, throttle it (``max_in_flight``) or forward it."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

from dcpstore.testing.faultproxy.forwarding import _Relay, _Upstream
from dcpstore.testing.faultproxy.rules import (
    _GCS_NAME,
    _PEEK,
    FaultPlan,
    RequestInfo,
    _object_name,
    classify,
    error_response,
)
from dcpstore.testing.faultproxy.stats import FaultRecord
from dcpstore.testing.faultproxy.wire import (
    _CHUNK,
    _Abort,
    _BadMessage,
    _Body,
    _Message,
    _Reader,
)

__all__: list[str] = []

logger = logging.getLogger(__name__)


class _Exchange(_Relay):
    """The :class:`~dcpstore.testing.faultproxy.FaultProxy` methods that serve one
    request: fault decisions and their injection."""

    plan: FaultPlan
    max_in_flight: int | None
    over_limit: str
    _in_flight: int
    _slots: threading.Semaphore | None
    _stopping: threading.Event
    _plan: FaultPlan
    _plan_faults: int
    _rng: random.Random
    _ids: Iterator[int]

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
        head, payload = error_response(status, info, f"faultproxy-{next(self._ids):08d}",
                                       close=close)
        if head_only:
            return head
        self._count_down(len(payload))
        return head + payload
