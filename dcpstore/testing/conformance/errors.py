"""Conformance: the same failure gives the same exception on every backend.

A missing key is ``FileNotFoundError``; a missing bucket is
:class:`dcpstore.errors.BucketNotFoundError` (deliberately not a ``FileNotFoundError``:
it is a configuration error, not an absent checkpoint); refused credentials are
``PermissionError``; throttling (``503 SlowDown``) is retried and then succeeds, and
retries that run out end in :class:`dcpstore.errors.StoreThrottledError`, which says so.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore.errors import BucketNotFoundError, StoreThrottledError
from dcpstore.storage.backend import Backend, ReadRange
from dcpstore.testing.conformance._base import ConformanceBase, HTTPEndpoint
from dcpstore.testing.faultproxy import FaultPlan, FaultProxy, RequestInfo

__all__ = ["ErrorTests"]

#: Fast retries for the throttling tests.
_RETRY = {"retry_backoff": 0.01, "retry_backoff_max": 0.05}


def _is_get(info: RequestInfo) -> bool:
    return info.method == "GET" and bool(info.object_name)


class ErrorTests(ConformanceBase):
    """Error translation and retries, through the hooks of :class:`ConformanceBase`."""

    def test_missing_key_is_file_not_found(self, backend: Backend) -> None:
        with pytest.raises(FileNotFoundError):
            backend.get("nope")
        with pytest.raises(FileNotFoundError):
            backend.stat("nope")
        assert not backend.exists("nope")
        with pytest.raises(FileNotFoundError):
            list(backend.read_ranges([ReadRange("nope", 0, 4)]))

    def test_missing_bucket(self, missing_bucket_uri: str | None,
                            backend_options: dict[str, Any]) -> None:
        if missing_bucket_uri is None:
            pytest.skip("this backend has no buckets (no missing_bucket_uri)")
        backend = dcpstore.open_backend(missing_bucket_uri, **backend_options)
        try:
            for op in (lambda: backend.get("k"), lambda: backend.put("k", b"x"),
                       lambda: backend.stat("k")):
                with pytest.raises(BucketNotFoundError) as info:
                    op()
                assert not isinstance(info.value, FileNotFoundError)
        finally:
            backend.close()
        with pytest.raises(BucketNotFoundError):
            dcpstore.load({"w": torch.zeros(1)}, missing_bucket_uri, **backend_options)

    def test_access_denied_is_permission_error(
        self, checkpoint_uri: str, denied_backend_options: dict[str, Any] | None
    ) -> None:
        if denied_backend_options is None:
            pytest.skip("this store cannot refuse a request here (no denied_backend_options)")
        backend = dcpstore.open_backend(checkpoint_uri, **denied_backend_options)
        try:
            with pytest.raises(PermissionError):
                backend.put("denied.bin", b"x")
            with pytest.raises(PermissionError), backend.open_upload("denied.distcp") as up:
                up.write(b"x" * 1000)
                up.commit()
        finally:
            backend.close()

    def test_throttling_is_retried(self, checkpoint_uri: str, backend_options: dict[str, Any],
                                   http_endpoint: HTTPEndpoint | None) -> None:
        if http_endpoint is None:
            pytest.skip("this backend makes no HTTP requests (no http_endpoint)")
        plan = FaultPlan(rate=1.0, kinds=("503",), match=_is_get, max_faults=2)
        with FaultProxy(http_endpoint.upstream, plan) as proxy:
            options = {**backend_options, **http_endpoint.options(proxy.endpoint_url),
                       "max_attempts": 5, **_RETRY}
            backend = dcpstore.open_backend(checkpoint_uri, **options)
            try:
                backend.put("throttled.bin", b"payload")
                assert backend.get("throttled.bin") == b"payload"
            finally:
                backend.close()
            assert proxy.snapshot().faults["503"] == 2

    def test_throttling_exhausted_is_clear(self, checkpoint_uri: str,
                                           backend_options: dict[str, Any],
                                           http_endpoint: HTTPEndpoint | None) -> None:
        if http_endpoint is None:
            pytest.skip("this backend makes no HTTP requests (no http_endpoint)")
        with FaultProxy(http_endpoint.upstream) as proxy:
            options = {**backend_options, **http_endpoint.options(proxy.endpoint_url),
                       "max_attempts": 2, **_RETRY}
            backend = dcpstore.open_backend(checkpoint_uri, **options)
            try:
                backend.put("throttled.bin", b"payload")
                proxy.plan = FaultPlan(rate=1.0, kinds=("503",), match=_is_get)
                with pytest.raises(OSError) as info:  # asserted below: the exact type
                    backend.get("throttled.bin")
            finally:
                backend.close()
            assert isinstance(info.value, StoreThrottledError), repr(info.value)
            assert re.search(r"503|SlowDown|throttl", str(info.value), re.IGNORECASE), info.value
            assert proxy.snapshot().faults["503"] >= 2, "the 503 was not retried"
