"""Shared pytest fixtures: local stand-ins for object stores (see tests/servers.py).

Each server is started once per session, on 127.0.0.1 only, and stopped at the end.
A server that cannot start makes the tests using it ERROR (never skip).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers import S3Server, moto_server, seaweedfs_server

# -- S3 stand-ins: moto (server mode) and SeaweedFS ---------------------------------------

S3_TEST_BUCKET = "dcpstore-test"


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    """moto's S3 server with bucket ``dcpstore-test`` (any credentials accepted)."""
    with moto_server() as server:
        server.create_bucket(S3_TEST_BUCKET)
        yield server


@pytest.fixture(scope="session")
def seaweedfs_s3() -> Iterator[S3Server]:
    """SeaweedFS with bucket ``dcpstore-test``, an admin and a read-only identity."""
    with seaweedfs_server(bucket=S3_TEST_BUCKET) as server:
        yield server
