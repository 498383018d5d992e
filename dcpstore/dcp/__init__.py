"""The DCP adapter: one generic ``StorageWriter`` / ``StorageReader`` over any backend.

Entry points: :mod:`~dcpstore.dcp.api` (``get_writer``, ``get_reader``, ``save``,
``load``). Save: :mod:`~dcpstore.dcp.writer` (DCP's call order) over
:mod:`~dcpstore.dcp.save_plan` (what each rank writes, plan caching),
:mod:`~dcpstore.dcp.guard` (the sharding guard), :mod:`~dcpstore.dcp.packing` (items into
data files), :mod:`~dcpstore.dcp.upload_window` (the uploads' byte window),
:mod:`~dcpstore.dcp.data_file` (streaming one file), :mod:`~dcpstore.dcp.commit` (the
commit protocol), :mod:`~dcpstore.dcp.incremental` and :mod:`~dcpstore.dcp.references`
(incremental saves), :mod:`~dcpstore.dcp.staging` (snapshots into staging memory).
Load: :mod:`~dcpstore.dcp.reader` over :mod:`~dcpstore.dcp.metadata_io`,
:mod:`~dcpstore.dcp.read_plan`, :mod:`~dcpstore.dcp.delivery` and
:mod:`~dcpstore.dcp.read_share`. Shared: :mod:`~dcpstore.dcp.bound` (what writer and
reader share), :mod:`~dcpstore.dcp.manifest`, :mod:`~dcpstore.dcp.codec` (one item's
bytes), :mod:`~dcpstore.dcp.checksum` (CRC32C), :mod:`~dcpstore.dcp.layout` (object
names), :mod:`~dcpstore.dcp.safe_pickle` and :mod:`~dcpstore.dcp.dist` (collective
helpers). Depends on :mod:`dcpstore.storage` only.
"""

from dcpstore._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
