"""Adaptive concurrency: how many requests a backend keeps in flight.

A :class:`ConcurrencyLimit` gates one direction of a backend's traffic (upload parts, or
ranged reads). Callers take a slot with :meth:`ConcurrencyLimit.acquire` before a request
and give it back with :meth:`ConcurrencyLimit.release`, saying how many bytes moved, and
report throttling (HTTP 503 SlowDown, 429) with :meth:`ConcurrencyLimit.throttled`.

The limit moves between ``floor`` and ``ceiling`` (the backend's ``max_concurrency``,
which is also what the memory bound is computed from), decided once per *window* of
completed requests (at least ``max(limit, min_window)`` of them):

1. **Slow start.** The limit starts at ``initial`` and doubles after each window whose
   throughput (bytes completed / window time) grew by at least ``gain`` over the previous
   one; the first window that did not grow ends slow start at the previous (smaller)
   limit, the one that already reached that throughput (a *plateau*).
2. **Steady.** Every ``probe_every`` windows the limit is raised by one; the probe is
   kept only if the next window's throughput grew by ``gain``. A window whose mean latency
   per byte exceeds ``latency_factor`` times that of the window the limit settled on,
   without more throughput, lowers the limit by one, window after window while that
   lasts, until a cut costs throughput (then it is undone and that latency is the new
   reference): the store got busier, fewer requests move as much.
3. **Throttling.** A throttled request halves the limit at once (at most once per
   window; never below ``floor``) and slow start does not resume: only probes grow it.

Windows in which the limit was never reached (the caller, not the store, was the
bottleneck: a slow serializer, a consumer that reads slowly) change nothing. With
``adaptive=False`` the limit stays at ``ceiling``: a plain counting semaphore, the
fixed behaviour.

Every change is a :class:`Decision`, logged at DEBUG and kept (the last
:data:`KEEP_DECISIONS`) with counters in :meth:`ConcurrencyLimit.figures`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["KEEP_DECISIONS", "ConcurrencyLimit", "Decision", "LearntLimits", "learnt_limits"]

logger = logging.getLogger(__name__)

#: Decisions kept by a :class:`ConcurrencyLimit` (the oldest are dropped).
KEEP_DECISIONS = 200


@dataclass(frozen=True)
class Decision:
    """One change of a :class:`ConcurrencyLimit` (or the window that ended slow start).

    Attributes:
        at: Clock time of the decision.
        old: Limit before.
        new: Limit after.
        reason: ``"grow"`` (throughput grew), ``"plateau"`` (it did not: back to the
            smaller limit), ``"probe"`` (steady state: try one more), ``"latency"``
            (latency grew without throughput), ``"throttle"`` (the store asked to slow
            down) or ``"ceiling"`` (slow start reached the ceiling).
        throughput: Bytes per second of the window that decided (0 for a throttle).
    """

    at: float
    old: int
    new: int
    reason: str
    throughput: float


class ConcurrencyLimit:
    """A thread-safe, adaptive limit on requests in flight (see the module docstring).

    Args:
        ceiling: Most requests in flight (the backend's ``max_concurrency``).
        adaptive: Adapt between ``floor`` and ``ceiling``; ``False``: always ``ceiling``.
        floor: Fewest requests in flight the limit goes down to.
        initial: Limit to start from (default ``min(2, ceiling)``, clamped to the range).
        name: What the limit gates, for logs (``"s3://bucket/run upload"``).
        min_window: Fewest completed requests per decision window.
        gain: Relative throughput growth that counts as growth (0.1: 10%).
        probe_every: Steady-state windows between probes of one more request.
        latency_factor: Latency growth (per byte, over the settled window's) that lowers
            the limit by one when throughput did not grow.
        clock: Monotonic clock in seconds (a synthetic one in tests).
    """

    # the algorithm's state (see _restart): in slow start; steady windows since the last
    # probe; throughput before a probe; (limit, throughput) of the last window; seconds
    # per byte when settled; throughput before latency cuts
    _slow_start: bool
    _steady_windows: int
    _probing_from: float | None
    _prev: tuple[int, float] | None
    _settled_latency: float | None
    _cut_from: float | None
    # the window (see _new_window): its start, completed requests, their bytes and busy
    # seconds, whether the limit was reached and whether a throttle already cut it
    _w_start: float
    _w_done: int
    _w_bytes: int
    _w_busy: float
    _saturated: bool
    _w_throttled: bool

    def __init__(
        self,
        ceiling: int,
        *,
        adaptive: bool = True,
        floor: int = 1,
        initial: int | None = None,
        name: str = "",
        min_window: int = 2,
        gain: float = 0.1,
        probe_every: int = 4,
        latency_factor: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling}")
        if not 1 <= floor <= ceiling:
            raise ValueError(f"floor must be in [1, ceiling={ceiling}], got {floor}")
        if min_window < 1 or probe_every < 1 or gain < 0 or latency_factor <= 1:
            raise ValueError("min_window and probe_every must be >= 1, gain >= 0 and "
                             "latency_factor > 1")
        self.ceiling = ceiling
        self.floor = floor
        self.adaptive = adaptive
        self.name = name
        self._min_window = min_window
        self._gain = gain
        self._probe_every = probe_every
        self._latency_factor = latency_factor
        self._clock = clock
        start = ceiling if not adaptive else min(2, ceiling) if initial is None else initial
        self._limit = max(floor, min(ceiling, start))
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = 0
        self.peak = 0
        self.requests = 0
        self.bytes = 0
        self.throttles = 0
        self.lowest = self._limit
        self.highest = self._limit
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=KEEP_DECISIONS)
        self.counts: collections.Counter[str] = collections.Counter()
        self._restart(slow_start=adaptive)
        self._new_window()

    # -- slots -------------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """Requests allowed in flight now."""
        return self._limit

    @property
    def in_flight(self) -> int:
        """Requests in flight now."""
        return self._in_flight

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> float | None:
        """Take a slot, waiting while ``limit`` requests are in flight.

        Args:
            blocking: Wait for a slot; ``False``: return ``None`` at once if none is free.
            timeout: Most seconds to wait (``None``: no bound).

        Returns:
            The clock time the slot was taken (pass it to :meth:`release`), or ``None``
            when no slot was free in time.
        """
        with self._cond:
            if self._in_flight >= self._limit:
                self._saturated = True  # the store, not the caller, is the bottleneck
                if not blocking:
                    return None
                if not self._cond.wait_for(lambda: self._in_flight < self._limit, timeout):
                    return None
            self._in_flight += 1
            if self._in_flight >= self._limit:
                self._saturated = True
            self.peak = max(self.peak, self._in_flight)
            return self._clock()

    def release(self, started: float, nbytes: int = 0, *, ok: bool = True) -> None:
        """Give a slot back.

        Args:
            started: What :meth:`acquire` returned.
            nbytes: Bytes the request moved (payload).
            ok: Whether the request succeeded; failed ones free the slot and count for
                nothing else.
        """
        with self._cond:
            self._in_flight -= 1
            if ok and self.adaptive:
                now = self._clock()
                self.requests += 1
                self.bytes += nbytes
                self._w_done += 1
                self._w_bytes += nbytes
                self._w_busy += max(0.0, now - started)
                if self._w_done >= max(self._limit, self._min_window):
                    self._end_window(now)
            elif ok:
                self.requests += 1
                self.bytes += nbytes
            self._cond.notify_all()

    def throttled(self) -> None:
        """The store asked to slow down (503 SlowDown, 429): halve the limit (once per
        window)."""
        with self._cond:
            self.throttles += 1
            if not self.adaptive or self._w_throttled:
                return
            self._restart(slow_start=False)
            self._set(max(self.floor, self._limit // 2), "throttle", 0.0, self._clock())
            self._new_window()
            # answers to requests sent under the old limit arrive in this window: one cut
            self._w_throttled = True

    # -- figures -----------------------------------------------------------------------

    def figures(self) -> dict[str, Any]:
        """What the limit did: the limit now, its range, the peak in flight, requests,
        throttles and decisions by reason."""
        with self._cond:
            return {
                "adaptive": self.adaptive,
                "limit": self._limit,
                "ceiling": self.ceiling,
                "lowest": self.lowest,
                "highest": self.highest,
                "peak_in_flight": self.peak,
                "requests": self.requests,
                "throttles": self.throttles,
                "decisions": dict(self.counts),
            }

    def __repr__(self) -> str:
        return (f"ConcurrencyLimit({self.name!r}, limit={self._limit}, "
                f"floor={self.floor}, ceiling={self.ceiling}, adaptive={self.adaptive})")

    # -- the algorithm (called with the lock held) ---------------------------------------

    def _restart(self, slow_start: bool) -> None:
        """Forget what the windows so far taught (at the start, and after a throttle)."""
        self._slow_start = slow_start
        self._steady_windows = 0
        self._probing_from = None
        self._prev = None
        self._settled_latency = None
        self._cut_from = None

    def _new_window(self) -> None:
        self._w_start = self._clock()
        self._w_done = 0
        self._w_bytes = 0
        self._w_busy = 0.0
        self._saturated = self._in_flight >= self._limit
        self._w_throttled = False

    def _set(self, new: int, reason: str, throughput: float, now: float) -> None:
        old = self._limit
        new = max(self.floor, min(self.ceiling, new))
        self._limit = new
        self.lowest = min(self.lowest, new)
        self.highest = max(self.highest, new)
        self.counts[reason] += 1
        self.decisions.append(Decision(now, old, new, reason, throughput))
        logger.debug("%s: concurrency %d -> %d (%s, %.1f MB/s)", self.name or "limit", old,
                     new, reason, throughput / 1e6)
        if new > old:
            self._cond.notify_all()

    def _end_window(self, now: float) -> None:
        elapsed = now - self._w_start
        saturated = self._saturated
        throughput = self._w_bytes / elapsed if elapsed > 0 else 0.0
        latency = self._w_busy / self._w_bytes if self._w_bytes else 0.0
        self._new_window()
        if not saturated or throughput <= 0:
            return  # the caller was the bottleneck: nothing learnt about the store
        limit = self._limit
        if self._slow_start:
            prev = self._prev
            if prev is None or throughput >= prev[1] * (1 + self._gain):
                self._prev = (limit, throughput)
                if limit >= self.ceiling:
                    self._settle(limit, "ceiling", throughput, latency, now)
                else:
                    self._set(limit * 2, "grow", throughput, now)
            else:
                self._settle(prev[0], "plateau", prev[1], latency * prev[0] / limit, now)
            return
        if self._probing_from is not None:  # the window after a probe
            before, self._probing_from = self._probing_from, None
            if throughput >= before * (1 + self._gain):
                self._settled_latency = latency
                self._set(limit, "grow", throughput, now)
                self._prev = (limit, throughput)
            else:
                self._set(limit - 1, "plateau", throughput, now)
            return
        if self._cut_from is not None:  # the window after a latency cut
            if throughput < self._cut_from * (1 - self._gain):  # it cost throughput:
                self._cut_from = None  # undo it, and take this latency as the new normal
                self._settled_latency = latency
                self._set(limit + 1, "plateau", throughput, now)
                return
            if latency <= self._settled_latency * self._latency_factor if (
                    self._settled_latency) else True:
                self._cut_from = None
        if self._settled_latency is None:
            self._settled_latency = latency
        elif (latency > self._settled_latency * self._latency_factor and limit > self.floor
              and (self._prev is None or throughput < self._prev[1] * (1 + self._gain))):
            if self._cut_from is None:
                self._cut_from = throughput
            self._set(limit - 1, "latency", throughput, now)
            return
        self._prev = (limit, throughput)
        self._steady_windows += 1
        if self._steady_windows >= self._probe_every and limit < self.ceiling:
            self._steady_windows = 0
            self._probing_from = throughput
            self._set(limit + 1, "probe", throughput, now)

    def _settle(self, limit: int, reason: str, throughput: float, latency: float,
                now: float) -> None:
        """End slow start at ``limit``."""
        self._slow_start = False
        self._steady_windows = 0
        self._settled_latency = latency or None
        self._prev = (limit, throughput)
        self._set(limit, reason, throughput, now)


class LearntLimits:
    """Where the adaptive limits of a store settled, kept for the next backend on it.

    A backend is often short-lived (``dcpstore.save`` / ``load`` and every
    ``Checkpointer`` step open one), while the store's capacity is not: a new backend's
    limit slow-starts from the level the last one on the same store and direction
    settled on, instead of from 2 again (so a limit that a busy spell cut grows back
    within a window or two). Kept per process, per store key (a backend's client key:
    endpoint, credentials and client settings) and direction.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._limits: dict[tuple[Any, str], int] = {}

    def recall(self, store: Any, direction: str) -> int | None:
        """The limit last settled on for ``store`` and ``direction``, if any."""
        with self._lock:
            return self._limits.get((store, direction))

    def remember(self, store: Any, direction: str, limit: ConcurrencyLimit) -> None:
        """Keep where ``limit`` settled, once it decided something (an adaptive limit
        that completed at least one window beyond its start)."""
        if not limit.adaptive or not limit.counts:
            return
        with self._lock:
            self._limits[(store, direction)] = limit.limit

    def clear(self) -> None:
        """Forget every learnt limit."""
        with self._lock:
            self._limits.clear()


#: The learnt limits of this process.
learnt_limits = LearntLimits()
