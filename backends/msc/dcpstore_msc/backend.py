"""The framework's backend over :class:`~dcpstore_msc.store.MSCStore` (``MSCBackend``).

The registry wraps the store class (the ``dcpstore.backends`` entry point) in the
framework's backend; ``MSCBackend`` is that class, under the name it always had (this
module and name were the entry point before the plugin contract).

One thin override remains (in :mod:`dcpstore_msc.store`): the framework's ``from_uri``
hands a store only ``ParsedURI.location`` (``bucket/path``, without the scheme), but the
feature flag routes URIs of every scheme to MSC (``get_writer("s3://bucket/x",
backend="msc")``), and MSC resolves ``s3://bucket/x`` and ``gs://bucket/x`` differently.
Until the framework asks the store for its location (a classmethod like
:meth:`MSCStore.location_for` called by ``StoreBackend.from_uri``), the backend class's
``from_uri`` is replaced by one that does.
"""

from __future__ import annotations

from .config import MSCConfigError, MSCOptions, ProfileNotFoundError, StorageNotFoundError
from .store import MSCStore, MSCStoreBackend

__all__ = [
    "MSCBackend",
    "MSCConfigError",
    "MSCOptions",
    "MSCStore",
    "ProfileNotFoundError",
    "StorageNotFoundError",
]

#: The framework's backend class for :class:`MSCStore` (the one the registry hands out).
MSCBackend = MSCStoreBackend
