"""moto's S3 in server mode, in this process (threads), on 127.0.0.1."""

from __future__ import annotations

import contextlib
import logging
import secrets
import ssl
import time
from collections.abc import Iterator
from typing import Any

from dcpstore.testing.servers.endpoints import (
    _LOOPBACK,
    _client_context,
    _tls_files,
    _wait_http,
    free_port,
)
from dcpstore.testing.servers.s3 import S3Server
from dcpstore.testing.tls import TLSFiles

__all__ = ["moto_server"]


@contextlib.contextmanager
def moto_server(*, start_timeout: float = 30.0, tls: bool | TLSFiles = False
                ) -> Iterator[S3Server]:
    """moto's S3 in server mode (``ThreadedMotoServer``) on 127.0.0.1:<free port>.

    moto accepts any credentials and does not enforce permissions.

    Args:
        start_timeout: Seconds to wait for the server to answer.
        tls: Serve HTTPS (werkzeug's ``ssl_context``) with a certificate from a
            throwaway CA (``True``) or from this one; the server's ``ca_bundle`` is the
            CA's certificate.
    """
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
    with _tls_files(tls) as files:
        port = free_port()
        server = _moto(port, files.server_context() if files else None)
        server.start()
        scheme = "https" if files else "http"
        endpoint = f"{scheme}://{_LOOPBACK}:{port}"
        try:
            _wait_http(endpoint + "/moto-api/", time.monotonic() + start_timeout,
                       context=_client_context(files))
            yield S3Server("moto", endpoint, "moto-access-key", "moto-" + secrets.token_hex(16),
                           ca_bundle=files.ca_bundle if files else None)
        finally:
            server.stop()


def _moto(port: int, context: ssl.SSLContext | None) -> Any:
    """A ``ThreadedMotoServer`` on 127.0.0.1:``port``, serving TLS with ``context``.

    moto's ``ThreadedMotoServer`` has no TLS option; with a context, its thread entry
    (``_server_entry``, the same four steps as moto 5.x's) passes ``ssl_context`` to
    werkzeug's ``make_server``. ``tests/test_tls.py`` fails if moto changes under it.
    """
    from moto.server import ThreadedMotoServer

    if context is None:
        return ThreadedMotoServer(ip_address=_LOOPBACK, port=port, verbose=False)

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    class TLSMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)
            self._server = make_server(self._ip_address, self._port, app, True,
                                       request_handler=MotoRequestHandler,
                                       ssl_context=context)
            self._server_ready_event.set()
            self._server.serve_forever()

    return TLSMotoServer(ip_address=_LOOPBACK, port=port, verbose=False)
