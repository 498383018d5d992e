"""Fixtures every conformance module shares, and the hooks a backend's test class fills.

A backend's test class overrides ``checkpoint_uri`` (required) and ``backend_options``;
the error tests use the optional hooks ``missing_bucket_uri``, ``denied_backend_options``,
``http_endpoint`` (faults through an HTTP proxy) and ``store_faults`` (the SDK's own
exceptions, for a store without HTTP). A hook left at its default (``None``) skips its
tests with the reason printed, for backends that have no such concept.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import dcpstore
from dcpstore.dcp.reader import Reader
from dcpstore.dcp.writer import Writer
from dcpstore.storage.backend import Backend

__all__ = ["ConformanceBase", "HTTPEndpoint", "payload"]


def payload(n: int, seed: int = 1) -> bytes:
    """``n`` pseudo-random bytes (reproducible per ``seed``)."""
    return random.Random(seed).randbytes(n)


@dataclass(frozen=True)
class HTTPEndpoint:
    """How to put a :class:`~dcpstore.testing.FaultProxy` in front of a backend.

    Attributes:
        upstream: The store's own ``http://127.0.0.1:<port>``.
        options: Given the proxy's endpoint URL, the backend options that send every
            request there (merged over ``backend_options``).
    """

    upstream: str
    options: Callable[[str], dict[str, Any]]


class ConformanceBase:
    """Fixtures and hooks of :class:`~dcpstore.testing.BackendConformance`."""

    #: Local files are visible under their unique name while being written.
    uploads_visible_before_commit: bool = False

    # -- fixtures a backend test overrides -----------------------------------------------

    @pytest.fixture
    def checkpoint_uri(self) -> str:
        """A fresh, empty location per test (required)."""
        raise NotImplementedError("override the checkpoint_uri fixture")

    @pytest.fixture
    def backend_options(self) -> dict[str, Any]:
        """Options for ``open_backend`` / ``get_writer`` / ``get_reader``."""
        return {}

    @pytest.fixture
    def missing_bucket_uri(self) -> str | None:
        """A URI in a bucket (container, profile bucket) that does not exist; ``None``
        when the backend has no buckets."""
        return None

    @pytest.fixture
    def denied_backend_options(self) -> dict[str, Any] | None:
        """Options (set up by the fixture, environment included) under which the store
        refuses writes to ``checkpoint_uri``; ``None`` when it cannot refuse them."""
        return None

    @pytest.fixture
    def http_endpoint(self) -> HTTPEndpoint | None:
        """The store's HTTP endpoint, for throttling through a proxy; ``None`` when the
        backend makes no HTTP requests."""
        return None

    @pytest.fixture
    def store_faults(self) -> dict[str, BaseException] | None:
        """The exceptions the store's SDK raises, by kind (``"throttled"``,
        ``"timeout"``, ``"unavailable"``, ``"denied"``, ``"not_found"``,
        ``"missing_bucket"``, ``"too_large"``, ``"precondition"``; any subset): the
        suite checks what ``map_error`` makes of each (class, ``retryable``) and, with
        a retryable kind, that the framework retries a request that raised it and then
        succeeds; no HTTP needed. ``None``: skipped."""
        return None

    # -- fixtures the suite provides -------------------------------------------------------

    @pytest.fixture
    def backend(self, checkpoint_uri: str, backend_options: dict[str, Any]) -> Iterator[Backend]:
        be = dcpstore.open_backend(checkpoint_uri, **backend_options)
        yield be
        be.close()

    def writer(self, uri: str, options: dict[str, Any], **kw: Any) -> Writer:
        return dcpstore.get_writer(uri, **options, **kw)

    def reader(self, uri: str, options: dict[str, Any], **kw: Any) -> Reader:
        return dcpstore.get_reader(uri, **options, **kw)
