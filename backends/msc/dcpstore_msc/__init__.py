"""dcpstore-msc: the NVIDIA multi-storage-client backend of dcpstore (``msc://``).

>>> import dcpstore
>>> writer = dcpstore.get_writer("msc://my-profile/run7/step-1200")
>>> writer = dcpstore.get_writer("s3://bucket/run7/step-1200", backend="msc")  # feature flag

See :mod:`dcpstore_msc.backend` for how dcpstore's primitives map onto MSC.
"""

from __future__ import annotations

from .backend import (
    MSCBackend,
    MSCConfigError,
    MSCOptions,
    ProfileNotFoundError,
    StorageNotFoundError,
)

__all__ = [
    "MSCBackend",
    "MSCConfigError",
    "MSCOptions",
    "ProfileNotFoundError",
    "StorageNotFoundError",
]
