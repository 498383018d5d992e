"""Shared fixtures for the trainer integration tests (tests/integrations/).

The object-store servers come from tests/conftest.py (session scoped, 127.0.0.1 only).
Here: the environment a test, its spawned ranks and its subprocesses need to reach them.
Ranks are spawned processes and inherit ``os.environ`` as it is when they start, so the
S3 fixture puts the endpoint in ``DCPSTORE_S3_ENDPOINT_URL`` rather than in options.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from stores import S3_TEST_BUCKET

from dcpstore.testing.servers import S3Server, isolate_env


@pytest.fixture
def s3_env(seaweedfs_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """SeaweedFS reachable through the environment alone, for ranks and subprocesses.

    Clears the developer's ``AWS_*`` / ``DCPSTORE_*`` variables, then sets the server's
    credentials and ``DCPSTORE_S3_ENDPOINT_URL``; so a plain ``s3://dcpstore-test/...``
    URI works in this process and in every process it starts.
    """
    isolate_env(monkeypatch, extra={**seaweedfs_s3.env(),
                                    "DCPSTORE_S3_ENDPOINT_URL": seaweedfs_s3.endpoint_url})
    yield seaweedfs_s3


@pytest.fixture
def s3_root(s3_env: S3Server) -> str:
    """A fresh ``s3://dcpstore-test/<unique>`` prefix on SeaweedFS (see ``s3_env``)."""
    return f"s3://{S3_TEST_BUCKET}/it-{uuid.uuid4().hex[:12]}"
