"""dcpstore-msc: the NVIDIA multi-storage-client backend of dcpstore (``msc://``).

>>> import dcpstore
>>> writer = dcpstore.get_writer("msc://my-profile/run7/step-1200")
>>> writer = dcpstore.get_writer("s3://bucket/run7/step-1200", backend="msc")  # feature flag

The plugin is :class:`MSCStore` (see :mod:`dcpstore_msc.store` for how dcpstore's
contract maps onto MSC, :mod:`dcpstore_msc.config` for how a URL is resolved).
"""

from __future__ import annotations

# the package's public names are those of its backend module
from .backend import *  # noqa: F403
from .backend import __all__ as __all__
