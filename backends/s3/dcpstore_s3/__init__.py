"""dcpstore-s3: the S3 backend of dcpstore (``s3://`` and ``s3a://`` URIs).

Installing this distribution registers the backend through the ``dcpstore.backends``
entry-point group; nothing needs importing::

    import dcpstore
    writer = dcpstore.get_writer("s3://bucket/run7/step-1200", region="eu-west-1")
"""

from __future__ import annotations

from .backend import S3Backend, S3MultipartUpload, S3Options

__all__ = ["S3Backend", "S3MultipartUpload", "S3Options"]
