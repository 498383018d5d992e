"""The S3 backend against real S3 servers on 127.0.0.1 (moto and SeaweedFS)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from conftest import S3_TEST_BUCKET
from servers import S3Server

from dcpstore.testing import BackendConformance


class _S3Conformance(BackendConformance):
    server_fixture = "moto_s3"

    @pytest.fixture
    def server(self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
               ) -> S3Server:
        server: S3Server = request.getfixturevalue(self.server_fixture)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                     "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        return server

    @pytest.fixture
    def checkpoint_uri(self, server: S3Server) -> str:
        return f"s3://{S3_TEST_BUCKET}/conformance/{uuid.uuid4().hex}"

    @pytest.fixture
    def backend_options(self, server: S3Server) -> dict[str, Any]:
        return {"endpoint_url": server.endpoint_url, "part_size": 5 * 1024 * 1024}


class TestMotoConformance(_S3Conformance):
    server_fixture = "moto_s3"


class TestSeaweedFSConformance(_S3Conformance):
    server_fixture = "seaweedfs_s3"
