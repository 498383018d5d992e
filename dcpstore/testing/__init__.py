"""Test helpers for dcpstore and its backend plugins.

- ``BackendConformance``: the abstract pytest suite every backend passes
  (:mod:`dcpstore.testing.conformance`, split by concern); ``ContractTests`` checks a
  plugin's methods against the contract's rules, failing with a ``ContractViolation``
  that names the method and the rule;
- ``MemoryBackend`` and ``FaultBackend``: an in-memory store and a fault-injecting
  wrapper, for protocol tests without HTTP (:mod:`dcpstore.testing.memory`,
  :mod:`dcpstore.testing.faults`);
- ``FaultProxy``: a fault-injecting HTTP proxy in front of a real server
  (:mod:`dcpstore.testing.faultproxy`);
- the local server stand-ins (:mod:`dcpstore.testing.servers`), over HTTPS with a
  throwaway CA (:mod:`dcpstore.testing.tls`), and ``RunningStore``, one of them up, as
  the tests and the benchmarks describe it (:mod:`dcpstore.testing.stores`);
- state helpers (:mod:`dcpstore.testing.state`).

Attributes are imported on first use, so ``import dcpstore.testing.servers`` pulls in
neither pytest nor any cloud client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcpstore.testing.conformance import (
        BackendConformance,
        ContractTests,
        ContractViolation,
        HTTPEndpoint,
    )
    from dcpstore.testing.faultproxy import FaultPlan, FaultProxy, ProxyStats, RequestInfo, classify
    from dcpstore.testing.faults import Fault, FaultBackend
    from dcpstore.testing.memory import MemoryBackend
    from dcpstore.testing.state import assert_state_equal, empty_like_state, many_dtypes_state
    from dcpstore.testing.stores import RunningStore

__all__ = [
    "BackendConformance",
    "ContractTests",
    "ContractViolation",
    "Fault",
    "FaultBackend",
    "FaultPlan",
    "FaultProxy",
    "HTTPEndpoint",
    "MemoryBackend",
    "ProxyStats",
    "RequestInfo",
    "RunningStore",
    "assert_state_equal",
    "classify",
    "empty_like_state",
    "many_dtypes_state",
]

_WHERE = {
    "BackendConformance": "conformance",
    "ContractTests": "conformance",
    "ContractViolation": "conformance",
    "HTTPEndpoint": "conformance",
    "Fault": "faults",
    "FaultBackend": "faults",
    "FaultPlan": "faultproxy",
    "FaultProxy": "faultproxy",
    "ProxyStats": "faultproxy",
    "RequestInfo": "faultproxy",
    "classify": "faultproxy",
    "MemoryBackend": "memory",
    "assert_state_equal": "state",
    "empty_like_state": "state",
    "many_dtypes_state": "state",
    "RunningStore": "stores",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
