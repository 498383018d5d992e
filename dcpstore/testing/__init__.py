"""Test helpers for dcpstore and its backend plugins.

``BackendConformance`` is the abstract pytest suite every backend passes; see
:mod:`dcpstore.testing.conformance`.
"""

from __future__ import annotations

from .conformance import BackendConformance, assert_state_equal, many_dtypes_state
from .faultproxy import FaultPlan, FaultProxy, ProxyStats, RequestInfo, classify

__all__ = [
    "BackendConformance",
    "FaultPlan",
    "FaultProxy",
    "ProxyStats",
    "RequestInfo",
    "assert_state_equal",
    "classify",
    "many_dtypes_state",
]
