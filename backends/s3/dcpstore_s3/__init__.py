"""dcpstore-s3: the S3 backend of dcpstore (``s3://`` and ``s3a://`` URIs).

Installing this distribution registers :class:`S3Store` through the
``dcpstore.backends`` entry-point group; nothing needs importing::

    import dcpstore
    writer = dcpstore.get_writer("s3://bucket/run7/step-1200", region="eu-west-1")

``S3Backend`` is the framework's ``Backend`` over :class:`S3Store` (what
``dcpstore.open_backend("s3://...")`` returns); its store is ``backend.store``.
"""

from __future__ import annotations

from .options import S3Options
from .store import S3Store
from .store import S3StoreBackend as S3Backend

__all__ = ["S3Backend", "S3Options", "S3Store"]
