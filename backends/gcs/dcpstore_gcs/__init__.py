"""dcpstore-gcs: the Google Cloud Storage plugin of dcpstore (``gs://``, ``gcs://``).

>>> import dcpstore
>>> writer = dcpstore.get_writer("gs://my-bucket/run7/step-1200")

See :mod:`dcpstore_gcs.backend` for how uploads and reads map onto the GCS JSON API.
"""

from __future__ import annotations

from .api import GCSRequestError
from .backend import BucketNotFoundError, GCSBackend, GCSOptions, GCSStore

__all__ = ["BucketNotFoundError", "GCSBackend", "GCSOptions", "GCSRequestError", "GCSStore"]
