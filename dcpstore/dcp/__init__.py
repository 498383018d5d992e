"""The DCP adapter: one generic ``StorageWriter`` / ``StorageReader`` over any backend.

Save: :mod:`~dcpstore.dcp.writer` (planning, the sharding :mod:`~dcpstore.dcp.guard`,
streaming, the integrity :mod:`~dcpstore.dcp.manifest`, the commit protocol, incremental
:mod:`~dcpstore.dcp.references`). Load: :mod:`~dcpstore.dcp.reader` over
:mod:`~dcpstore.dcp.metadata_io`, :mod:`~dcpstore.dcp.read_plan`,
:mod:`~dcpstore.dcp.delivery` and :mod:`~dcpstore.dcp.read_share`. Shared:
:mod:`~dcpstore.dcp.codec` (one item's bytes), :mod:`~dcpstore.dcp.checksum` (CRC32C),
:mod:`~dcpstore.dcp.layout` (object names), :mod:`~dcpstore.dcp.safe_pickle` and
:mod:`~dcpstore.dcp.dist` (collective helpers). Depends on :mod:`dcpstore.storage` only.
"""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
