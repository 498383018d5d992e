"""Throwaway TLS material for the local stand-ins (tests and benchmarks).

:func:`make_tls_files` makes a certificate authority that exists only for one run
(``trustme``) and a server certificate it issued for ``127.0.0.1`` (an IP address
subject alternative name) and ``localhost``, and writes them as PEM files::

    with throwaway_tls() as tls:
        with seaweedfs_server(tls=tls) as s3:       # https://127.0.0.1:<port>
            os.environ.update(tls.client_env())      # AWS_CA_BUNDLE, SSL_CERT_FILE

A client trusts the servers by trusting :attr:`TLSFiles.ca_bundle` and nothing else: the
CA's private key is never written to disk, and the CA is never added to a system trust
store.

Nothing here imports ``trustme`` (or ``cryptography``) at import time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["TLS_HOSTS", "TLSFiles", "make_tls_files", "throwaway_tls"]

logger = logging.getLogger(__name__)

#: Names the server certificate is valid for (the stand-ins bind to 127.0.0.1 only).
TLS_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a throwaway CA and of a server certificate it issued.

    Attributes:
        ca_bundle: The CA's certificate: what a client trusts (``AWS_CA_BUNDLE``,
            ``SSL_CERT_FILE``, ``verify=``, ``cafile=``).
        cert_file: The server's certificate (valid for :data:`TLS_HOSTS`).
        key_file: The server certificate's private key (mode 0600).
    """

    ca_bundle: str
    cert_file: str
    key_file: str

    def server_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` for a server presenting :attr:`cert_file`."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` for a client that trusts this CA only (host names and
        certificates verified)."""
        return ssl.create_default_context(cafile=self.ca_bundle)

    def client_env(self) -> dict[str, str]:
        """Environment variables that make the usual clients trust this CA only.

        ``AWS_CA_BUNDLE``: botocore, boto3, aiobotocore (s3fs) and MSC's S3 provider.
        ``SSL_CERT_FILE``: OpenSSL's default verify paths, which Python's
        ``ssl.create_default_context()`` loads, and so aiohttp (gcsfs, dcpstore's GCS
        backend) -- aiohttp builds its default context when it is imported, so the
        variable must be set before that, e.g. in a new process's environment.
        """
        return {"AWS_CA_BUNDLE": self.ca_bundle, "SSL_CERT_FILE": self.ca_bundle}


def make_tls_files(directory: str | os.PathLike[str]) -> TLSFiles:
    """Make a throwaway CA and a server certificate for :data:`TLS_HOSTS` in ``directory``.

    Writes ``ca.pem`` (the CA's certificate), ``server.pem`` (the server's certificate)
    and ``server-key.pem`` (its private key, mode 0600). The CA's own key stays in
    memory and is gone when this returns: nothing else can ever be signed by it.

    Args:
        directory: An existing directory, private to the caller.

    Raises:
        RuntimeError: ``trustme`` is not installed (``requirements/core.txt``).
    """
    try:
        import trustme
    except ImportError as exc:  # pragma: no cover - a dev dependency
        raise RuntimeError(
            "TLS for the stand-ins needs trustme: pip install -c "
            "requirements/constraints.txt -r requirements/core.txt"
        ) from exc
    directory = os.fspath(directory)
    ca = trustme.CA(organization_name="dcpstore throwaway test CA")
    leaf = ca.issue_cert(*TLS_HOSTS, common_name=TLS_HOSTS[0])
    files = TLSFiles(os.path.join(directory, "ca.pem"),
                     os.path.join(directory, "server.pem"),
                     os.path.join(directory, "server-key.pem"))
    ca.cert_pem.write_to_path(files.ca_bundle)
    leaf.cert_chain_pems[0].write_to_path(files.cert_file)
    fd = os.open(files.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(leaf.private_key_pem.bytes())
    logger.debug("throwaway CA and server certificate for %s in %s", TLS_HOSTS, directory)
    return files


@contextlib.contextmanager
def throwaway_tls() -> Iterator[TLSFiles]:
    """:func:`make_tls_files` in a new temporary directory, removed on exit."""
    directory = tempfile.mkdtemp(prefix="dcpstore-tls-")
    try:
        yield make_tls_files(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
