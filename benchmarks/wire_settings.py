"""``python -m benchmarks.wire_settings``: what each S3 client of the benchmark puts on
the wire about payload signing and checksums.

A header-logging TCP relay sits in front of a moto server on 127.0.0.1; each client
uploads a 20 MiB object (multipart where the client splits it) and reads it back, with
the request settings the benchmark gives it (:data:`benchmarks.wire.BOTOCORE_S3_CONFIG`
for every botocore-based client; s3torchconnector's CRT client has no such setting) and,
for comparison, boto3 at its defaults. Printed per client: every distinct value of
``x-amz-content-sha256`` (the payload hash, or ``UNSIGNED-PAYLOAD``) and every checksum
header (``x-amz-checksum-*``, ``x-amz-sdk-checksum-algorithm``, ``x-amz-trailer``,
``Content-MD5``), by request method. ``docs/performance.md`` quotes the result.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["HeaderLog", "client_checks", "main", "observe"]

_SIGNING = "x-amz-content-sha256"
_CHECKSUM_HEADERS = ("x-amz-sdk-checksum-algorithm", "x-amz-trailer", "content-md5",
                     "x-amz-checksum-mode")


class HeaderLog:
    """A TCP relay to ``upstream_port`` that records the signing and checksum headers of
    every HTTP request going through it, under the current :attr:`client` name.

    Args:
        upstream_port: Port of the server on 127.0.0.1.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.client = "?"
        self.seen: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="wire-accept").start()

    def close(self) -> None:
        """Stop accepting connections."""
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._requests, args=(conn, up), daemon=True).start()
            threading.Thread(target=_relay, args=(up, conn), daemon=True).start()

    def _record(self, head: bytes) -> dict[str, str]:
        lines = head.decode("latin-1").split("\r\n")
        method = lines[0].split(" ", 1)[0]
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        with self._lock:
            counter = self.seen[self.client]
            for key, value in headers.items():
                if key == _SIGNING:
                    shown = value if not _is_hex_digest(value) else "<SHA-256 of the body>"
                    counter[f"{method} {key}: {shown}"] += 1
                elif key.startswith("x-amz-checksum-") and key != "x-amz-checksum-mode":
                    counter[f"{method} {key}: <value>"] += 1
                elif key in _CHECKSUM_HEADERS:
                    counter[f"{method} {key}: {value}"] += 1
        return headers

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        """Relay client -> server, parsing each request's head (bodies by length)."""
        buf = b""
        skip = 0  # body bytes of the current request still to pass through
        chunks = _forward(src, dst)
        for data in chunks:
            buf += data
            while True:
                if skip:
                    n = min(skip, len(buf))
                    buf, skip = buf[n:], skip - n
                    if skip:
                        break
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                headers = self._record(buf[:end])
                buf = buf[end + 4:]
                if "chunked" in headers.get("transfer-encoding", ""):
                    # no framing to follow: pass the rest through unparsed
                    collections.deque(chunks, maxlen=0)
                    return
                skip = int(headers.get("content-length", "0") or 0)


def _is_hex_digest(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower())


def _forward(src: socket.socket, dst: socket.socket) -> Iterator[bytes]:
    """Pass what ``src`` sends on to ``dst``, yielding each chunk, until either end
    closes; then shut both down."""
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            dst.sendall(data)
            yield data
    except OSError:
        pass
    finally:
        _shutdown(src, dst)


def _relay(src: socket.socket, dst: socket.socket) -> None:
    collections.deque(_forward(src, dst), maxlen=0)


def _shutdown(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def client_checks(endpoint: str, region: str, bucket: str, workdir: str
                  ) -> dict[str, Callable[[bytes], None]]:
    """Per client name: a function that uploads ``data`` and reads it back, configured
    as the benchmark configures that client."""
    from botocore.config import Config

    from .wire import BOTOCORE_S3_CONFIG, msc_profile

    def boto3_client(cfg: dict[str, Any]) -> Callable[[bytes], None]:
        def run(data: bytes) -> None:
            import boto3
            from boto3.s3.transfer import TransferConfig

            c = boto3.session.Session().client("s3", endpoint_url=endpoint,
                                               region_name=region, config=Config(**cfg))
            c.upload_fileobj(_Reader(data), bucket, "boto3", Config=TransferConfig(
                multipart_threshold=8 << 20, multipart_chunksize=8 << 20))
            c.get_object(Bucket=bucket, Key="boto3")["Body"].read()
            c.close()
        return run

    def s3fs_client(data: bytes) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint, client_kwargs={"region_name": region},
                               config_kwargs=copy.deepcopy(BOTOCORE_S3_CONFIG),
                               skip_instance_cache=True, default_block_size=8 << 20)
        with fs.open(f"{bucket}/s3fs", "wb") as f:
            f.write(data)
        fs.cat(f"{bucket}/s3fs")

    def msc_client(data: bytes) -> None:
        import multistorageclient as msc
        import yaml

        profile = msc_profile(endpoint, region, bucket, part_size=8 << 20)
        path = os.path.join(workdir, "msc.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({"profiles": {"wire": profile}}, f)
        os.environ["MSC_CONFIG"] = path
        with msc.open("msc://wire/msc", "wb") as f:
            f.write(data)
        with msc.open("msc://wire/msc", "rb") as f:
            f.read()

    def s3tc_client(data: bytes) -> None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        client = S3Client(region, endpoint=endpoint,
                          s3client_config=S3ClientConfig(force_path_style=True))
        writer = client.put_object(bucket, "s3tc")
        writer.write(data)
        writer.close()
        client.get_object(bucket, "s3tc").read()

    def dcpstore_client(data: bytes) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        import dcpstore

        uri = f"s3://{bucket}/dcpstore"
        opts = {"endpoint_url": endpoint, "region": region}
        state = {"t": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
        dcp.save(state, storage_writer=dcpstore.get_writer(uri, **opts), no_dist=True)
        dest = {"t": torch.empty_like(state["t"])}
        dcp.load(dest, storage_reader=dcpstore.get_reader(uri, **opts), no_dist=True)

    return {"boto3 at its defaults (for comparison)": boto3_client({}),
            "dcpstore-s3": dcpstore_client,
            "limit-s3 (boto3)": boto3_client(BOTOCORE_S3_CONFIG),
            "torch-fsspec-s3 (s3fs)": s3fs_client,
            "msc / dcpstore-msc (MSC profile)": msc_client,
            "s3torchconnector (CRT)": s3tc_client}


class _Reader:
    """A file-like over bytes (boto3's ``upload_fileobj`` wants one)."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n < 0 else min(len(self._view), self._pos + n)
        out = bytes(self._view[self._pos:end])
        self._pos = end
        return out


def observe(size: int = 20 << 20) -> dict[str, dict[str, int]]:
    """Run every client of :func:`client_checks` through a :class:`HeaderLog` in front
    of a fresh moto server; return, per client, how often each header value was seen."""
    from dcpstore.testing.servers import moto_server

    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    data = os.urandom(size)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "MSC_CONFIG")}
    with moto_server() as server, tempfile.TemporaryDirectory() as workdir:
        server.create_bucket("wire-settings")
        log = HeaderLog(int(server.endpoint_url.rsplit(":", 1)[1]))
        env = {**server.env(), "AWS_ENDPOINT_URL": log.endpoint_url}  # CRT reads it
        saved.update({k: os.environ.get(k) for k in env})
        os.environ.update(env)
        try:
            for name, run in client_checks(log.endpoint_url, server.region, "wire-settings",
                                           workdir).items():
                log.client = name
                run(data)
        finally:
            log.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return {k: dict(sorted(v.items())) for k, v in log.seen.items()}


def main(argv: list[str] | None = None) -> int:
    """Print what every client sent (JSON)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.wire_settings",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--size", type=int, default=20 << 20, help="bytes per object")
    args = p.parse_args(argv)
    print(json.dumps(observe(args.size), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
