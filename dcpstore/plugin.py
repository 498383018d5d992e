"""The plugin author's API: everything a storage plugin needs, in one import.

>>> from dcpstore.plugin import MultipartStore, ObjectInfo, StoreLimits, StoreOptions

A plugin subclasses :class:`ObjectStore` (or :class:`MultipartStore`), implements its
methods (see :mod:`dcpstore.storage.contract` and ``docs/writing-a-backend.md``), maps
its SDK's exceptions to the failure kinds below in :meth:`ObjectStore.map_error`
(CRC32C helpers are here too, for stores that check what they assemble, and
:mod:`~dcpstore.storage.http_body`, zero-copy reads of urllib3 response bodies), and
registers the class in the ``dcpstore.backends`` entry-point group (or with
:func:`register_backend`). Its test runs :class:`dcpstore.testing.BackendConformance`.
"""

from __future__ import annotations

from dcpstore.dcp.checksum import crc32c, crc32c_combine
from dcpstore.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigurationError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PreconditionFailedError,
    StoreError,
    StoreThrottledError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from dcpstore.storage import http_body
from dcpstore.storage.backend import Upload
from dcpstore.storage.contract import (
    MultipartStore,
    ObjectInfo,
    ObjectStore,
    StoreLimits,
    StoreOptions,
)
from dcpstore.storage.customer_keys import load_customer_key
from dcpstore.storage.registry import available_backends, register_backend
from dcpstore.storage.uri import ParsedURI

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "ConfigurationError",
    "MultipartStore",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectStore",
    "ObjectTooLargeError",
    "ParsedURI",
    "PreconditionFailedError",
    "StoreError",
    "StoreLimits",
    "StoreOptions",
    "StoreThrottledError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "Upload",
    "available_backends",
    "crc32c",
    "crc32c_combine",
    "http_body",
    "load_customer_key",
    "register_backend",
]
