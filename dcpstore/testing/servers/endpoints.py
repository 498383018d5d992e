"""What every stand-in server shares: a free port on 127.0.0.1, its TLS material
(:mod:`dcpstore.testing.tls`) and waiting until it answers HTTP."""

from __future__ import annotations

import contextlib
import socket
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from dcpstore.testing.tls import TLSFiles, make_tls_files

__all__ = ["free_port", "free_ports"]

_LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the one copy of this helper)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held open together while chosen)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((_LOOPBACK, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def _tls_files(tls: bool | TLSFiles) -> Iterator[TLSFiles | None]:
    """The TLS material a server is started with: ``tls`` itself, a throwaway CA made
    in a temporary directory removed on exit (``True``), or none (``False``: plain
    HTTP)."""
    if isinstance(tls, TLSFiles):
        yield tls
    elif tls:
        with tempfile.TemporaryDirectory(prefix="dcpstore-tls-") as directory:
            yield make_tls_files(directory)
    else:
        yield None


def _client_context(tls: TLSFiles | None) -> ssl.SSLContext | None:
    return tls.client_context() if tls is not None else None


def _wait_http(url: str, deadline: float, alive: Any = None,
               context: ssl.SSLContext | None = None) -> None:
    """Wait until ``url`` answers any HTTP response (over TLS: trusting ``context``)."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"the server for {url} exited during start-up")
        try:
            urllib.request.urlopen(url, timeout=2, context=context).close()
            return
        except urllib.error.HTTPError:
            return  # any answer will do (403 without credentials)
        except (OSError, urllib.error.URLError) as exc:
            last = exc
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in time: {last}")
