"""The CLI against the object-store backends: S3 (moto), GCS (fake-gcs-server), MSC.

Every command runs as a process of its own configured only through the environment, as
a user would run it: ``python -m dcpstore ARGS`` forked from a server that imported
torch, dcpstore and the store clients once (:class:`cli_fork.ForkedCLI`).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_fork import ForkedCLI

import dcpstore
from dcpstore.testing.servers import FakeGCSServer, S3Server, msc_s3_profile, scrubbed_environ

BUCKET = "dcpstore-cli"


@pytest.fixture(scope="module")
def env(
    moto_s3: S3Server, gcs_server: FakeGCSServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The subprocesses' environment: no developer configuration, the servers' only."""
    moto_s3.create_bucket(BUCKET)
    gcs_server.create_bucket(BUCKET)
    cfg = tmp_path_factory.mktemp("msc") / "msc.yaml"
    cfg.write_text(json.dumps({"profiles": {"cli": msc_s3_profile(moto_s3, BUCKET)}}))
    return scrubbed_environ(extra={
        **moto_s3.env(),
        "AWS_ENDPOINT_URL_S3": moto_s3.endpoint_url,
        "DCPSTORE_GS_ENDPOINT_URL": gcs_server.endpoint_url,
        "DCPSTORE_GS_TOKEN": "anon",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "MSC_CONFIG": str(cfg),
    })


#: Imported once by the fork server (the store clients' libraries and dcpstore's plugins).
PRELOAD = ("boto3", "gcsfs", "multistorageclient", "dcpstore_s3", "dcpstore_gcs",
           "dcpstore_msc")


@pytest.fixture(scope="module")
def server(env: dict[str, str]) -> Iterator[ForkedCLI]:
    """Runs the commands, each in a fresh process with the environment ``env``."""
    with ForkedCLI(env, preload=PRELOAD) as forked:
        yield forked


def cli(server: ForkedCLI, *args: str, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    proc = server.run(*args)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_commands_across_backends(
    env: dict[str, str], server: ForkedCLI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = uuid.uuid4().hex[:8]
    local = tmp_path / "run" / "step-000000001"
    state: dict[str, Any] = {"w": torch.randn(300, 7), "b": torch.arange(9), "meta": {"k": 1}}
    dcpstore.save(state, local, files_per_rank=2)
    s3 = f"s3://{BUCKET}/{run}/step-000000001"
    gs = f"gs://{BUCKET}/{run}/step-000000001"
    msc = f"msc://cli/{run}-msc/step-000000001"

    cli(server, "cp", str(local), s3)  # local -> s3
    cli(server, "cp", s3, gs)  # s3 -> gcs
    cli(server, "cp", gs, msc)  # gcs -> msc
    for uri in (s3, gs, msc):
        assert json.loads(cli(server, "verify", uri, "--json").stdout)["ok"] is True
        info = json.loads(cli(server, "inspect", uri, "--json").stdout)
        assert {k["key"] for k in info["keys"]} == {"w", "b", "meta.k"}
        root = uri.rsplit("/", 1)[0]
        rows = json.loads(cli(server, "ls", root, "--json").stdout)
        assert [(r["step"], r["committed"]) for r in rows] == [(1, True)]

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out: dict[str, Any] = {
        "w": torch.zeros(300, 7),
        "b": torch.zeros(9, dtype=torch.int64),
        "meta": {"k": 0},
    }
    dcpstore.load(out, msc)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])

    cli(server, "export", gs, str(tmp_path / "w.safetensors"), "--format", "safetensors")
    for uri in (s3, gs, msc):
        cli(server, "rm", uri)
        missing = cli(server, "inspect", uri, check=False)
        assert missing.returncode == 1 and "CheckpointNotFoundError" in missing.stderr
        gc = json.loads(cli(server, "gc", uri.rsplit("/", 1)[0], "--min-age", "0", "--json").stdout)
        assert gc["objects"] == []
