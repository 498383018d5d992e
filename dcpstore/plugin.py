"""The plugin author's API: everything a storage plugin needs, in one import.

>>> from dcpstore.plugin import MultipartStore, ObjectInfo, StoreLimits, StoreOptions

A plugin subclasses :class:`ObjectStore` (or :class:`MultipartStore`), implements its
methods (see :mod:`dcpstore.storage.contract` and ``docs/writing-a-backend.md``), maps
its SDK's exceptions to the failure kinds below in :meth:`ObjectStore.map_error`, and
registers the class in the ``dcpstore.backends`` entry-point group (or with
:func:`register_backend`). Its test runs :class:`dcpstore.testing.BackendConformance`.
"""

from __future__ import annotations

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
from dcpstore.storage.contract import (
    MultipartStore,
    ObjectInfo,
    ObjectStore,
    StoreLimits,
    StoreOptions,
)
from dcpstore.storage.registry import available_backends, register_backend

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "ConfigurationError",
    "MultipartStore",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectStore",
    "ObjectTooLargeError",
    "PreconditionFailedError",
    "StoreError",
    "StoreLimits",
    "StoreOptions",
    "StoreThrottledError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "available_backends",
    "register_backend",
]
