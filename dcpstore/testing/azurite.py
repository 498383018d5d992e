"""Azurite (the official Azure Storage emulator) on 127.0.0.1, for the Azure backend tests.

Azurite is a Node.js program, installed from the npm registry into a project-local
directory by ``backends/azure/install-azurite.sh`` (``.servers/azurite``, git-ignored).
:func:`azurite_server` starts its blob service on a free port of 127.0.0.1 with a
throwaway data directory, waits until it answers, and stops it on exit.

The account is Azurite's well-known development account (``devstoreaccount1``, a key
published in Azure's documentation): :attr:`AzuriteServer.connection_string` is what
``AZURE_STORAGE_CONNECTION_STRING`` should hold for the SDK to reach it, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dcpstore.testing.servers.process import stop_process_group

__all__ = ["ACCOUNT", "AzuriteServer", "azurite_binary", "azurite_server"]

#: Azurite's development account and its (public) key.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")
#: Where ``backends/azure/install-azurite.sh`` installs it (relative to the repository).
INSTALL_DIR = Path(__file__).resolve().parents[2] / ".servers" / "azurite"


@dataclass
class AzuriteServer:
    """A running Azurite blob service.

    Attributes:
        port: Its port on 127.0.0.1.
        process: The ``azurite-blob`` process.
    """

    port: int
    process: subprocess.Popen[bytes]

    @property
    def endpoint_url(self) -> str:
        """The account's blob endpoint (path-style, as Azurite serves it)."""
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def upstream(self) -> str:
        """The server itself, ``http://127.0.0.1:<port>`` (for a proxy in front of it)."""
        return f"http://127.0.0.1:{self.port}"

    def connection_string(self, key: str = ACCOUNT_KEY, endpoint: str | None = None) -> str:
        """A connection string for the dev account (``key``: a wrong one to be refused;
        ``endpoint``: the blob endpoint, default :attr:`endpoint_url`)."""
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
                f"BlobEndpoint={endpoint or self.endpoint_url};")

    def env(self) -> dict[str, str]:
        """Environment the SDK needs to reach this server (and nothing else)."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}


def azurite_binary() -> str | None:
    """The ``azurite-blob`` executable: ``$AZURITE_BLOB``, the project-local install, or
    one on ``PATH``; ``None`` when there is none."""
    for candidate in (os.environ.get("AZURITE_BLOB"),
                      str(INSTALL_DIR / "node_modules" / ".bin" / "azurite-blob")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("azurite-blob")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    # any HTTP answer (a 4xx for an unsigned account request) means it is serving
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/{ACCOUNT}?comp=list",
                                    timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@contextlib.contextmanager
def azurite_server(timeout: float = 30.0) -> Iterator[AzuriteServer]:
    """Start ``azurite-blob`` on a free port of 127.0.0.1; stop it on exit.

    Raises:
        FileNotFoundError: Azurite is not installed (run
            ``backends/azure/install-azurite.sh``).
        RuntimeError: It exited or did not answer within ``timeout`` seconds.
    """
    binary = azurite_binary()
    if binary is None:
        raise FileNotFoundError("azurite-blob not found: run backends/azure/install-azurite.sh "
                                "(npm install azurite@3 into .servers/azurite)")
    with tempfile.TemporaryDirectory(prefix="dcpstore-azurite-") as location:
        for _ in range(3):  # the port may be taken between choosing and binding it
            port = _free_port()
            log = open(os.path.join(location, "azurite.log"), "wb")  # noqa: SIM115
            process = subprocess.Popen(
                [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port),
                 "--location", os.path.join(location, "data"), "--silent",
                 "--skipApiVersionCheck", "--loose"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + timeout
            while process.poll() is None and time.monotonic() < deadline:
                if _answers(port):
                    break
                time.sleep(0.1)
            if process.poll() is None and _answers(port):
                break
            stop_process_group(process)
            log.close()
        else:
            with open(os.path.join(location, "azurite.log"), "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"azurite-blob did not start on 127.0.0.1: {tail}")
        try:
            yield AzuriteServer(port, process)
        finally:
            stop_process_group(process)
            log.close()

