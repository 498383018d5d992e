"""The conformance suite every backend passes, split by concern like fsspec's
``tests/abstract``.

Use it from a backend's test module::

    from dcpstore.testing import BackendConformance

    class TestMyStore(BackendConformance):
        @pytest.fixture
        def checkpoint_uri(self, my_server):          # a fresh, empty location per test
            return f"mystore://bucket/{uuid.uuid4().hex}"

        @pytest.fixture
        def backend_options(self, my_server):         # options for open_backend/get_writer
            return {"endpoint_url": my_server.url}

Optional hooks (``missing_bucket_uri``, ``denied_backend_options``, ``http_endpoint``,
``store_faults``) switch on the error tests; see :class:`ConformanceBase`. A plugin
(an :class:`~dcpstore.plugin.ObjectStore`) is also checked method by method against the
contract's rules (``ContractTests``: a broken rule fails naming the method and the
rule). Class attributes tune expectations where stores legitimately differ. Each
concern is also a class of its own (``ObjectTests``, ``UploadTests``, ...) for a
backend that passes only some.
"""

from __future__ import annotations

from dcpstore.testing.conformance._base import ConformanceBase, HTTPEndpoint
from dcpstore.testing.conformance.checkpoints import CheckpointTests
from dcpstore.testing.conformance.contract import ContractTests, ContractViolation
from dcpstore.testing.conformance.errors import ErrorTests
from dcpstore.testing.conformance.listing import ListingTests
from dcpstore.testing.conformance.objects import ObjectTests
from dcpstore.testing.conformance.pickling import PicklingTests
from dcpstore.testing.conformance.ranges import RangeTests
from dcpstore.testing.conformance.uploads import UploadTests
from dcpstore.testing.state import assert_state_equal, many_dtypes_state

__all__ = [
    "BackendConformance",
    "CheckpointTests",
    "ConformanceBase",
    "ContractTests",
    "ContractViolation",
    "ErrorTests",
    "HTTPEndpoint",
    "ListingTests",
    "ObjectTests",
    "PicklingTests",
    "RangeTests",
    "UploadTests",
    "assert_state_equal",
    "many_dtypes_state",
]


class BackendConformance(
    ObjectTests, ListingTests, UploadTests, RangeTests, ErrorTests, PicklingTests,
    CheckpointTests, ContractTests,
):
    """The whole abstract suite. Override ``checkpoint_uri`` (and ``backend_options``
    when the backend needs options, e.g. an endpoint)."""
