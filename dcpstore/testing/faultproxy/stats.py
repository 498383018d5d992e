"""What went through a :class:`~dcpstore.testing.faultproxy.FaultProxy`: requests by
kind, injected faults, body bytes and the most requests open at once."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["FaultRecord", "ProxyStats"]


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
