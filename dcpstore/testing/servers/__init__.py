"""Local stand-ins for object stores, shared by the tests and the benchmarks.

Every server binds to 127.0.0.1 only, on random free ports, and is stopped when its
context manager exits. A server that does not come up raises (a test ERROR, never a
skip)::

    with seaweedfs_server() as s3:
        s3.create_bucket("ckpt")
        writer = dcpstore.get_writer("s3://ckpt/run", endpoint_url=s3.endpoint_url)

- :func:`moto_server` and :func:`seaweedfs_server` give an :class:`S3Server`;
  ``S3Server.env()`` gives the ``AWS_*`` variables that point botocore (and s3fs) at the
  server with its credentials and keep them away from any real AWS configuration;
- :func:`fake_gcs_server` gives a :class:`FakeGCSServer` (the GCS JSON API);
- :func:`msc_s3_profile` describes an MSC profile over an S3 server;
- ``tls=True`` (or a :class:`~dcpstore.testing.tls.TLSFiles` to share one CA between
  servers) serves HTTPS on ``https://127.0.0.1:<port>`` with a certificate from a
  throwaway CA (:mod:`dcpstore.testing.tls`), whose certificate is the server's
  ``ca_bundle``; nothing is served over plain HTTP then;
- :func:`free_port` / :func:`free_ports` and :func:`scrubbed_environ` /
  :func:`isolate_env` are the one copy of those helpers for tests and benchmarks.

Nothing here imports boto3, botocore, gcsfs, moto or MSC at import time.

One module per stand-in (:mod:`~dcpstore.testing.servers.moto`,
:mod:`~dcpstore.testing.servers.seaweedfs`, :mod:`~dcpstore.testing.servers.fake_gcs`),
the S3 server's description and MSC profile (:mod:`~dcpstore.testing.servers.s3`), the
ports, TLS material and start-up wait they share
(:mod:`~dcpstore.testing.servers.endpoints`) and the scrubbed environment
(:mod:`~dcpstore.testing.servers.env`).
"""

from __future__ import annotations

from dcpstore.testing.servers.endpoints import free_port, free_ports
from dcpstore.testing.servers.env import ISOLATION_ENV, isolate_env, scrubbed_environ
from dcpstore.testing.servers.env import KEPT as KEPT
from dcpstore.testing.servers.env import SCRUBBED_PREFIXES as SCRUBBED_PREFIXES
from dcpstore.testing.servers.fake_gcs import (
    FakeGCSServer,
    fake_gcs_binary,
    fake_gcs_server,
    gcs_object_names,
)
from dcpstore.testing.servers.moto import moto_server
from dcpstore.testing.servers.s3 import S3Server, msc_s3_profile
from dcpstore.testing.servers.seaweedfs import seaweedfs_server

__all__ = [
    "ISOLATION_ENV",
    "FakeGCSServer",
    "S3Server",
    "fake_gcs_binary",
    "fake_gcs_server",
    "free_port",
    "free_ports",
    "gcs_object_names",
    "isolate_env",
    "moto_server",
    "msc_s3_profile",
    "scrubbed_environ",
    "seaweedfs_server",
]
