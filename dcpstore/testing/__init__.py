"""Test helpers for dcpstore and its backend plugins.

``BackendConformance`` is the abstract pytest suite every backend passes; see
:mod:`dcpstore.testing.conformance`.
"""

from __future__ import annotations

from .conformance import BackendConformance, assert_state_equal, many_dtypes_state

__all__ = ["BackendConformance", "assert_state_equal", "many_dtypes_state"]
