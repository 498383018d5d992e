"""The limits: the fastest way found to move a rank's bytes to and from each store.

A limit moves exactly the bytes of the rank's shards (back to back), with no DCP, no
serialization and no checksums, and with the durability dcpstore gives (local: data
``fsync``-ed and the directory ``fsync``-ed before the save counts as done; S3: the
object committed). Each limit has variants (the bracket in its label); the benchmark
runs several and the report calls the fastest, per operation, "the limit". Where
dcpstore beats every variant of a limit, the limit is not an upper bound and must be
fixed, not celebrated. See "Limits" in ``docs/performance.md``.

===================================  ===================================================
``limit-local[dd]``                  each rank writes its shards back to back into one
                                     file, 64 MiB ``write`` s, then ``fsync``; reads it
                                     back the same way into the destination tensors
``limit-local[wb16MiBx2]``           2 threads each ``pwrite`` a range of the rank's
                                     file in 16 MiB chunks and start each chunk's
                                     write-back at once (``sync_file_range``), so the
                                     disk writes while the CPU copies; ``fsync`` at the
                                     end. Load: 2 threads ``preadv`` their ranges
``limit-local[direct16MiBx4]``       ``O_DIRECT`` from a page-aligned (``mmap``) buffer:
                                     no page cache, no copy; 4 threads, 16 MiB each;
                                     ``fsync`` at the end (file size and extents). Load:
                                     ``O_DIRECT`` reads into an aligned buffer
``limit-s3[64MiBx8]``                boto3's client (botocore), one multipart upload per
(also ``client-64MiBx8``)            rank, 64 MiB parts, 8 in flight from a thread pool;
                                     ranged GETs read from the socket into a buffer
``limit-s3[objects-16MiBx8]``        boto3's client, the rank's bytes as many objects of
                                     part size, each one single ``PUT``, 8 in flight;
                                     whole-object GETs (no ``Range``) to load. On a store
                                     that copies an object per ranged GET or joins
                                     multipart uploads slowly (moto), many small
                                     objects are the fastest way
``limit-s3[transfer-32MiBx8]``       boto3's managed transfer (``upload_fileobj`` /
                                     ``download_fileobj``, s3transfer's classic threads)
``limit-s3[crt-32MiBx8]``            the AWS Common Runtime's S3 client (``awscrt.s3``,
                                     the engine of s3torchconnector and of s3transfer's
                                     CRT path): one ``PUT_OBJECT`` / ``GET_OBJECT`` meta
                                     request it splits into parts, at most 8 connections
``limit-gcs[32MiBx8]``               aiohttp straight to the JSON API: part-size
                                     objects, that many in flight
===================================  ===================================================

Every S3 variant sends ``UNSIGNED-PAYLOAD`` and no checksums (only where the API
requires one), over plain HTTP to the stand-in, like every other S3 client in the
benchmark.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch
from dcpstore_s3._zerocopy import PartStream, readinto

from .adapters import OpContext, Operation, System
from .wire import TLS_TRUST, botocore_path_config
from .workload import RankState, format_bytes, parse_size

__all__ = [
    "LimitGCS",
    "LimitLocal",
    "LimitS3",
    "LimitSystem",
    "parse_part_variant",
    "variant_name",
]

logger = logging.getLogger(__name__)

_MiB = 1 << 20
_CHUNK = 64 * _MiB  # the dd variant's write size
_ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (logical block size)
_SYNC_FILE_RANGE_WRITE = 2


def parse_part_variant(text: str) -> tuple[int, int]:
    """``"64MiBx8"`` -> (64 MiB, 8): a size and a count.

    Raises:
        ValueError: Not ``SIZExCOUNT``.
    """
    m = re.fullmatch(r"(.+?)x(\d+)", text)
    if m is None or int(m.group(2)) < 1:
        raise ValueError(f"bad limit variant {text!r} (use e.g. 64MiBx8)")
    return parse_size(m.group(1)), int(m.group(2))


def variant_name(part_size: int, concurrency: int) -> str:
    """(64 MiB, 8) -> ``"64MiBx8"``."""
    return f"{format_bytes(part_size).replace(' ', '')}x{concurrency}"


class LimitSystem(System):
    """A limit: raw I/O of the rank's bytes, selectable variants."""

    is_limit = True
    #: The variant a label without a bracket means.
    default_variant: ClassVar[str] = ""

    def __init__(self, variant: str = "") -> None:
        super().__init__(variant or self.default_variant)
        self.configure(self.variant)

    def configure(self, variant: str) -> None:
        """Parse ``variant`` into attributes.

        Raises:
            ValueError: A variant this limit does not know.
        """
        raise NotImplementedError


# -- buffers -------------------------------------------------------------------------------


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _buffer(state: RankState) -> memoryview:
    """The one scratch buffer of the rank's limits: page-aligned (an anonymous mapping),
    padded to the O_DIRECT alignment, reused by every variant and operation so that a
    rank holds one extra copy of its bytes, not one per variant."""
    size = max(_aligned(state.share_bytes), _ALIGN)
    buf = state.scratch.get("limit-buffer")
    if buf is None or len(buf) != size:
        buf = state.scratch["limit-buffer"] = mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memoryview(buf)


def _source(state: RankState) -> memoryview:
    """The rank's bytes back to back in the scratch buffer (copied untimed; the padding
    after them zeroed, for O_DIRECT's last block)."""
    view = _buffer(state)
    pos = 0
    for shard in state.local_views("source"):  # no concatenated copy: see concat()
        view[pos:pos + len(shard)] = shard
        pos += len(shard)
    view[pos:] = bytes(len(view) - pos)
    return view


def _destination(state: RankState) -> memoryview:
    """The scratch buffer zeroed (its pages resident), to load into."""
    import numpy as np

    view = _buffer(state)
    np.frombuffer(view, dtype=np.uint8)[:] = 0
    return view


def _matches(view: memoryview, state: RankState) -> bool:
    """Whether ``view`` starts with this rank's bytes. Compared as 32-bit words with
    torch (the shards are float32, so the length is a multiple of 4): ``memoryview``'s
    own ``==`` goes byte by byte, over a second per 256 MiB on these cores."""
    pos = 0
    for shard in state.local_views("source"):  # shard by shard: no concatenated copy
        n = len(shard)
        if n % 4 or pos % 4:
            if view[pos:pos + n] != shard:
                return False
        elif n and not torch.equal(
                torch.frombuffer(view, dtype=torch.int32, count=n // 4, offset=pos),
                torch.frombuffer(shard, dtype=torch.int32)):
            return False
        pos += n
    return True


# -- local ---------------------------------------------------------------------------------


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int]:
    """libc's ``sync_file_range`` (``os`` has none).

    Raises:
        OSError: Not Linux, or libc lacks it.
    """
    if not sys.platform.startswith("linux"):
        raise OSError("sync_file_range is Linux-only")
    fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _ranges(total: int, threads: int, align: int) -> list[tuple[int, int]]:
    """``threads`` contiguous (offset, length) ranges covering ``total`` bytes, cut at
    multiples of ``align``."""
    step = -(-total // threads)
    step = -(-step // align) * align
    return [(lo, min(step, total - lo)) for lo in range(0, total, step)] or [(0, 0)]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LimitLocal(LimitSystem):
    """The local disk's limit (see the module docstring for the variants)."""

    name = "limit-local"
    kinds = ("local",)
    default_variant = "dd"
    description = ("raw file I/O, fsync'd: dd-style, parallel with write-back "
                   "(sync_file_range) or O_DIRECT")

    mode: str
    chunk: int
    threads: int

    def configure(self, variant: str) -> None:
        if variant == "dd":
            self.mode, self.chunk, self.threads = "dd", _CHUNK, 1
            return
        m = re.fullmatch(r"(wb|direct)(.+)", variant)
        if m is None:
            raise ValueError(f"bad limit-local variant {variant!r} (use dd, wb16MiBx2 "
                             "or direct16MiBx4)")
        self.mode = m.group(1)
        self.chunk, self.threads = parse_part_variant(m.group(2))
        if self.mode == "direct" and self.chunk % _ALIGN:
            raise ValueError(f"{variant!r}: O_DIRECT chunks must be multiples of {_ALIGN}")

    def unavailable(self) -> str | None:
        if self.mode == "direct" and not hasattr(os, "O_DIRECT"):
            return "O_DIRECT is not available on this platform"
        if self.mode == "wb":
            try:
                _sync_file_range()
            except (OSError, AttributeError) as exc:
                return f"sync_file_range is not available: {exc}"
        return super().unavailable()

    def _file(self, ctx: OpContext) -> str:
        return os.path.join(ctx.store.root, ctx.path, f"limit_{ctx.rank}.bin")

    def _figures(self) -> dict[str, Any]:
        return {"mode": self.mode, "chunk": self.chunk, "threads": self.threads}

    # save

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        path = self._file(ctx)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if self.mode == "dd":
            return self._save_dd(path, state)
        direct = self.mode == "direct"
        data = _source(state)
        size = state.share_bytes
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="limit-local")
        kick = _sync_file_range() if self.mode == "wb" else None
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)

        def write_range(fd: int, lo: int, n: int) -> None:
            pos, end = lo, lo + (_aligned(n) if direct else n)
            while pos < end:
                step = min(self.chunk, end - pos)
                done = 0
                while done < step:
                    done += os.pwrite(fd, data[pos + done:pos + step], pos + done)
                if kick is not None and kick(fd, pos, step, _SYNC_FILE_RANGE_WRITE) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"sync_file_range: {os.strerror(err)}")
                pos += step

        def run() -> dict[str, Any]:
            fd = os.open(path, flags, 0o644)
            try:
                futures = [pool.submit(write_range, fd, lo, n)
                           for lo, n in _ranges(size, self.threads, _ALIGN) if n]
                for f in futures:
                    f.result()
                if direct:  # the last block was written padded
                    os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(os.path.dirname(path))
            return self._figures()

        return Operation(run, close=pool.shutdown)

    def _save_dd(self, path: str, state: RankState) -> Operation:
        views = state.local_views("source")

        def run() -> dict[str, Any]:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for view in views:
                    for lo in range(0, len(view), _CHUNK):
                        chunk = view[lo:lo + _CHUNK]
                        while chunk:
                            chunk = chunk[os.write(fd, chunk):]
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(os.path.dirname(path))
            return self._figures()

        return Operation(run)

    # load

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        path = self._file(ctx)
        if self.mode == "dd":
            return self._load_dd(path, state)
        direct = self.mode == "direct"
        buf = _destination(state)
        size = state.share_bytes
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="limit-local")
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

        def read_range(fd: int, lo: int, n: int) -> None:
            pos, end = lo, lo + n
            while pos < end:
                step = min(self.chunk, end - pos)
                # O_DIRECT: whole blocks (the file's last one is short: a short read)
                want = _aligned(step) if direct else step
                got = os.preadv(fd, [buf[pos:pos + want]], pos)
                if got <= 0:
                    raise EOFError(f"{path} ends at byte {pos}, expected {size}")
                pos += min(got, step)

        def run() -> dict[str, Any]:
            fd = os.open(path, flags)
            try:
                futures = [pool.submit(read_range, fd, lo, n)
                           for lo, n in _ranges(size, self.threads, _ALIGN) if n]
                for f in futures:
                    f.result()
            finally:
                os.close(fd)
            return self._figures()

        return Operation(run, verify=lambda: _matches(buf, state), close=pool.shutdown)

    def _load_dd(self, path: str, state: RankState) -> Operation:
        state.destination()
        views = state.local_views("destination")

        def run() -> dict[str, Any]:
            fd = os.open(path, os.O_RDONLY)
            try:
                for view in views:
                    for lo in range(0, len(view), _CHUNK):
                        chunk = view[lo:lo + _CHUNK]
                        while chunk:
                            n = os.readv(fd, [chunk])
                            if n == 0:
                                raise EOFError(f"{path} is short")
                            chunk = chunk[n:]
            finally:
                os.close(fd)
            return self._figures()

        return Operation(run)


# -- S3 ------------------------------------------------------------------------------------


class _PartLimit(LimitSystem):
    """A limit with a part size and a number of requests in flight."""

    default_variant = "64MiBx8"
    part_size: int
    concurrency: int

    def configure(self, variant: str) -> None:
        self.part_size, self.concurrency = parse_part_variant(variant)

    def parts(self, state: RankState) -> list[bytes]:
        """The rank's bytes cut into part-size ``bytes`` (cached per part size; botocore
        sends ``bytes`` bodies without a copy)."""
        key = f"parts-{self.part_size}"
        cached = state.scratch.get(key)
        if cached is None:
            for k in [k for k in state.scratch if k.startswith("parts-")]:
                del state.scratch[k]  # one part size at a time
            data = memoryview(state.concat())
            cached = [bytes(data[lo:lo + self.part_size])
                      for lo in range(0, len(data), self.part_size)] or [b""]
            state.scratch[key] = cached
        return list(cached)

    def ranges(self, state: RankState) -> list[tuple[int, int]]:
        """(offset, length) of every part."""
        n = state.share_bytes
        return [(lo, min(self.part_size, n - lo)) for lo in range(0, n, self.part_size)]

    def _figures(self, parts: int) -> dict[str, Any]:
        return {"parts": parts, "part_size": self.part_size,
                "max_concurrency": self.concurrency}


class LimitS3(_PartLimit):
    """The S3 limit: three client stacks (``client``, ``transfer``, ``crt``), and the
    client moving many single-PUT objects (``objects``)."""

    name = "limit-s3"
    kinds = ("s3",)
    requires = ("boto3",)
    description = ("boto3 client threads (one multipart object, or many single-PUT "
                   "objects), boto3 managed transfer or the CRT S3 client; unsigned "
                   "payload, no checksums")

    #: Client stacks and the modules each needs.
    CLIENTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "client": ("boto3",), "objects": ("boto3",), "transfer": ("boto3", "s3transfer"),
        "crt": ("awscrt",)}
    client_kind: str

    def configure(self, variant: str) -> None:
        kind, sep, rest = variant.partition("-")
        if not sep:
            kind, rest = "client", variant
        if kind not in self.CLIENTS:
            raise ValueError(f"bad limit-s3 variant {variant!r}: client {kind!r} is not "
                             f"one of {', '.join(self.CLIENTS)} (e.g. crt-32MiBx8)")
        self.client_kind = kind
        super().configure(rest)

    def tls_trust(self) -> str | None:
        return TLS_TRUST["crt" if self.client_kind == "crt" else "botocore"]

    def unavailable(self) -> str | None:
        import importlib.util

        for module in self.CLIENTS[self.client_kind]:
            if importlib.util.find_spec(module) is None:
                return f"python module {module!r} is not installed"
        return None

    def _key(self, ctx: OpContext) -> str:
        return f"{ctx.path}/limit_{ctx.rank}.bin"

    def object_keys(self, ctx: OpContext, count: int) -> list[str]:
        """The ``objects`` variant's keys: one object per part of the rank's bytes."""
        return [f"{ctx.path}/limit_{ctx.rank}/p{i:05d}" for i in range(count)]

    def _config(self) -> Any:
        return botocore_path_config(
            max_pool_connections=self.concurrency + 4,
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=10, read_timeout=300,
        )

    def _client(self, ctx: OpContext) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3", endpoint_url=ctx.store.endpoint_url, region_name=ctx.store.region,
            config=self._config())

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        if self.client_kind == "crt":
            return _crt_save(self, ctx, state)
        if self.client_kind == "transfer":
            return self._transfer_save(ctx, state)
        if self.client_kind == "objects":
            return self._objects_save(ctx, state)
        client = self._client(ctx)
        parts = self.parts(state)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="limit-s3")
        bucket, key = ctx.store.root, self._key(ctx)

        def run() -> dict[str, Any]:
            if len(parts) == 1:
                client.put_object(Bucket=bucket, Key=key, Body=parts[0])
                return self._figures(1)
            upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

            def put(i: int) -> dict[str, Any]:
                r = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id,
                                       PartNumber=i + 1, Body=parts[i])
                return {"ETag": r["ETag"], "PartNumber": i + 1}

            done = list(pool.map(put, range(len(parts))))
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                             MultipartUpload={"Parts": done})
            return self._figures(len(parts))

        def close() -> None:
            pool.shutdown()
            client.close()

        return Operation(run, close=close)

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        if self.client_kind == "crt":
            return _crt_load(self, ctx, state)
        if self.client_kind == "transfer":
            return self._transfer_load(ctx, state)
        client = self._client(ctx)
        view = _destination(state)
        ranges = self.ranges(state)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="limit-s3")
        bucket, key = ctx.store.root, self._key(ctx)
        # objects: each part is a whole object of its own (no Range header)
        keys = (self.object_keys(ctx, len(ranges)) if self.client_kind == "objects"
                else [key] * len(ranges))

        def get(i: int) -> None:
            lo, n = ranges[i]
            extra = {} if self.client_kind == "objects" else {
                "Range": f"bytes={lo}-{lo + n - 1}"}
            body = client.get_object(Bucket=bucket, Key=keys[i], **extra)["Body"]
            try:
                pos = lo
                while pos < lo + n:
                    got = readinto(body, view[pos:lo + n])
                    if not got:
                        raise EOFError(f"s3://{bucket}/{keys[i]} is short")
                    pos += got
            finally:
                body.close()

        def run() -> dict[str, Any]:
            list(pool.map(get, range(len(ranges))))
            return self._figures(len(ranges))

        def close() -> None:
            pool.shutdown()
            client.close()

        return Operation(run, verify=lambda: _matches(view, state), close=close)

    # many objects: one single PUT per part, as a checkpoint of many small files is

    def _objects_save(self, ctx: OpContext, state: RankState) -> Operation:
        client = self._client(ctx)
        parts = self.parts(state)
        keys = self.object_keys(ctx, len(parts))
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="limit-s3")
        bucket = ctx.store.root

        def put(i: int) -> None:
            client.put_object(Bucket=bucket, Key=keys[i], Body=parts[i])

        def run() -> dict[str, Any]:
            list(pool.map(put, range(len(parts))))
            return {**self._figures(len(parts)), "objects": len(parts)}

        def close() -> None:
            pool.shutdown()
            client.close()

        return Operation(run, close=close)

    # boto3's managed transfer (s3transfer, classic threads)

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.part_size,
                              multipart_chunksize=self.part_size,
                              max_concurrency=self.concurrency,
                              preferred_transfer_client="classic")

    def _transfer_save(self, ctx: OpContext, state: RankState) -> Operation:
        client = self._client(ctx)
        data = memoryview(state.concat())
        config = self._transfer_config()
        bucket, key = ctx.store.root, self._key(ctx)

        def run() -> dict[str, Any]:
            # s3transfer reads each part from the file into its own bytes
            client.upload_fileobj(_BufferFile(data), bucket, key, Config=config)
            return self._figures(len(self.ranges(state)))

        return Operation(run, close=client.close)

    def _transfer_load(self, ctx: OpContext, state: RankState) -> Operation:
        client = self._client(ctx)
        view = _destination(state)
        config = self._transfer_config()
        bucket, key = ctx.store.root, self._key(ctx)

        def run() -> dict[str, Any]:
            target = _BufferFile(view[:state.share_bytes])
            client.download_fileobj(bucket, key, target, Config=config)
            return self._figures(len(self.ranges(state)))

        return Operation(run, verify=lambda: _matches(view, state), close=client.close)


class _BufferFile(PartStream):
    """dcpstore_s3's zero-copy upload body (a seekable, readable file over a buffer,
    without a copy of it), writable too: the body of the managed-transfer and CRT
    uploads, and the file ``download_fileobj`` seeks in and writes each part into."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        end = self._pos + len(chunk)
        if end > len(self._view):
            raise EOFError(f"download is longer than the {len(self._view)}-byte buffer")
        self._view[self._pos:end] = chunk
        self._pos = end
        return len(chunk)


# -- S3 through the AWS Common Runtime -------------------------------------------------------


class _CRT:
    """An ``awscrt.s3.S3Client`` for one store: plain HTTP, or HTTPS for an ``https://``
    endpoint (``--tls``; the CRT's default trust store, which takes the throwaway CA
    from ``SSL_CERT_FILE`` like s3torchconnector's CRT client), SigV4 with
    ``UNSIGNED-PAYLOAD`` (awscrt's default S3 signing) and no checksums, at most
    ``concurrency`` connections per request."""

    def __init__(self, ctx: OpContext, part_size: int, concurrency: int) -> None:
        import urllib.parse

        from awscrt.auth import AwsCredentialsProvider
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode

        url = urllib.parse.urlsplit(ctx.store.endpoint_url or "")
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"the CRT limit needs an http:// or https:// endpoint, got "
                             f"{ctx.store.endpoint_url!r}")
        self.host = url.netloc
        env = ctx.store.env
        credentials = AwsCredentialsProvider.new_static(
            env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", ""))
        elg = EventLoopGroup()
        bootstrap = ClientBootstrap(elg, DefaultHostResolver(elg))
        self.concurrency = concurrency
        self.client = S3Client(
            bootstrap=bootstrap, region=ctx.store.region, credential_provider=credentials,
            tls_mode=(S3RequestTlsMode.ENABLED if url.scheme == "https"
                      else S3RequestTlsMode.DISABLED), part_size=part_size,
            multipart_upload_threshold=part_size,
            max_active_connections_override=concurrency)

    def request(self, method: str, path: str, *, body: Any = None, size: int = 0,
                on_body: Callable[..., None] | None = None) -> None:
        """One ``PUT_OBJECT`` or ``GET_OBJECT`` meta request; waits for it to finish.

        Raises:
            RuntimeError: The request failed (with the server's answer).
        """
        import urllib.parse

        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        headers = HttpHeaders([("Host", self.host)])
        if method == "PUT":
            headers.add("Content-Length", str(size))
            headers.add("Content-Type", "application/octet-stream")
        request = HttpRequest(method, urllib.parse.quote(path), headers, body)
        failure: list[str] = []

        def on_done(error: Exception | None = None, error_body: bytes | None = None,
                    status_code: int | None = None, **_: Any) -> None:
            if error is not None:
                failure.append(f"{error} (HTTP {status_code}): "
                               f"{(error_body or b'')[:300]!r}")

        meta = self.client.make_request(
            type=S3RequestType.PUT_OBJECT if method == "PUT" else S3RequestType.GET_OBJECT,
            request=request, on_body=on_body, on_done=on_done,
            max_active_connections_override=self.concurrency)
        meta.finished_future.result()
        if failure:
            raise RuntimeError(f"CRT {method} {path}: {failure[0]}")


def _crt_save(limit: LimitS3, ctx: OpContext, state: RankState) -> Operation:
    crt = _CRT(ctx, limit.part_size, limit.concurrency)
    data = memoryview(state.concat())
    path = f"/{ctx.store.root}/{limit._key(ctx)}"

    def run() -> dict[str, Any]:
        crt.request("PUT", path, body=_BufferFile(data), size=len(data))
        return limit._figures(len(limit.ranges(state)))

    return Operation(run)


def _crt_load(limit: LimitS3, ctx: OpContext, state: RankState) -> Operation:
    crt = _CRT(ctx, limit.part_size, limit.concurrency)
    view = _destination(state)
    path = f"/{ctx.store.root}/{limit._key(ctx)}"
    lock = threading.Lock()
    received = [0]

    def on_body(chunk: Any, offset: int, **_: Any) -> None:
        n = len(chunk)
        view[offset:offset + n] = chunk
        with lock:
            received[0] += n

    def run() -> dict[str, Any]:
        received[0] = 0
        crt.request("GET", path, on_body=on_body)
        if received[0] != state.share_bytes:
            raise EOFError(f"CRT GET {path}: {received[0]} bytes, expected "
                           f"{state.share_bytes}")
        return limit._figures(len(limit.ranges(state)))

    return Operation(run, verify=lambda: _matches(view, state))


# -- GCS -----------------------------------------------------------------------------------


class LimitGCS(_PartLimit):
    """The GCS limit: aiohttp to the JSON API, part-size objects, concurrent."""

    name = "limit-gcs"
    kinds = ("gcs",)
    requires = ("aiohttp",)
    default_variant = "32MiBx8"
    description = "aiohttp to the JSON API: part-size objects, concurrent"
    client_stack = "aiohttp"

    def _names(self, ctx: OpContext, count: int) -> list[str]:
        return [f"{ctx.path}/limit_{ctx.rank}/p{i:05d}" for i in range(count)]

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        import asyncio
        import urllib.parse

        import aiohttp

        parts = self.parts(state)
        names = self._names(ctx, len(parts))
        url = f"{ctx.store.endpoint_url}/upload/storage/v1/b/{ctx.store.root}/o"
        loop = asyncio.new_event_loop()

        async def main() -> None:
            limit = asyncio.Semaphore(self.concurrency)
            connector = aiohttp.TCPConnector(limit=self.concurrency)
            async with aiohttp.ClientSession(connector=connector) as session:
                async def put(name: str, data: bytes) -> None:
                    async with limit:
                        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
                        async with session.post(
                                f"{url}?{query}", data=data,
                                headers={"Content-Type": "application/octet-stream"}) as r:
                            r.raise_for_status()
                            await r.read()

                await asyncio.gather(*(put(n, p) for n, p in zip(names, parts, strict=True)))

        def run() -> dict[str, Any]:
            loop.run_until_complete(main())
            return self._figures(len(parts))

        return Operation(run, close=loop.close)

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        import asyncio
        import urllib.parse

        import aiohttp

        view = _destination(state)
        ranges = self.ranges(state)
        names = self._names(ctx, len(ranges))
        base = f"{ctx.store.endpoint_url}/storage/v1/b/{ctx.store.root}/o"
        loop = asyncio.new_event_loop()

        async def main() -> None:
            limit = asyncio.Semaphore(self.concurrency)
            connector = aiohttp.TCPConnector(limit=self.concurrency)
            async with aiohttp.ClientSession(connector=connector) as session:
                async def get(name: str, lo: int, n: int) -> None:
                    async with limit, session.get(
                            f"{base}/{urllib.parse.quote(name, safe='')}?alt=media") as r:
                        r.raise_for_status()
                        pos = lo
                        async for chunk in r.content.iter_any():
                            view[pos:pos + len(chunk)] = chunk
                            pos += len(chunk)
                        if pos != lo + n:
                            raise EOFError(f"{name}: {pos - lo} bytes, expected {n}")

                await asyncio.gather(*(get(name, lo, n)
                                       for name, (lo, n) in zip(names, ranges, strict=True)))

        def run() -> dict[str, Any]:
            loop.run_until_complete(main())
            return self._figures(len(ranges))

        return Operation(run, verify=lambda: _matches(view, state), close=loop.close)
