"""The MSC store: dcpstore's object-store contract on an MSC ``StorageClient``.

Methods map onto MSC: :meth:`MSCStore.read` onto ``read(path, byte_range=Range(...))``
(a range fetched as consecutive requests of at most ``read_chunk`` bytes, each copied
straight into the destination buffers it spans: MSC returns every ranged read as one
``bytes``), :meth:`~MSCStore.put` onto ``write``, :meth:`~MSCStore.head` onto ``info``,
:meth:`~MSCStore.list` onto ``list`` and :meth:`~MSCStore.delete` onto ``delete_many``.
POSIX profiles (no metadata provider) read with ``preadv`` straight into the buffers.

Uploads (:meth:`~MSCStore.open_stream`). MSC has no streaming multipart API, so a data
file is buffered in memory up to ``part_size`` bytes and sent with one ``write``; a
larger one spills to a temporary file (in ``spool_dir``) that is handed to MSC's
``upload_file`` at commit (for object stores, MSC's parallel multipart upload) and
deleted afterwards. On POSIX profiles the bytes stream straight into a hidden temporary
file beside the target, renamed over it at commit. Nothing is visible under the final
key before commit.

Errors (:meth:`~MSCStore.map_error`) are classified by MSC's exception types, refined by
the structured status of the provider error MSC chained to them (see
:mod:`dcpstore_msc.errors`), never by messages. MSC reports a missing bucket as a
missing object, so a ``FileNotFoundError`` from an object store is checked once by
listing the root: if that fails too, the storage itself is missing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, TypeVar

from typing_extensions import Buffer

from dcpstore.plugin import (
    AccessDeniedError,
    BucketNotFoundError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    PreconditionFailedError,
    StoreError,
    StoreLimits,
    StoreThrottledError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from dcpstore.storage.backend import Upload  # not exported by dcpstore.plugin
from dcpstore.storage.local import FileUpload, read_file_into
from dcpstore.storage.redact import install_log_redaction, redact
from dcpstore.storage.store_backend import backend_class
from dcpstore.storage.uri import ParsedURI

from .config import MSC_SCHEME, MSCOptions, resolve_url
from .errors import http_status, request_id, transport_failure

__all__ = ["MSCStore", "MSCStoreBackend", "SpooledUpload"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class MSCStore(ObjectStore):
    """A location MSC resolves: ``msc://profile/path``, or (feature flag) any URL or path.

    Args:
        location: The URL as MSC takes it: ``msc://profile/path``, ``s3://bucket/path``,
            ``gs://bucket/path`` or an absolute local path (see :meth:`location_for`).
        options: :class:`~dcpstore_msc.MSCOptions`.

    Attributes:
        profile: The MSC profile serving the location (known once resolved).
        root: The path of the location in that profile.
    """

    name = MSC_SCHEME
    schemes = ()  # any scheme: msc:// natively, others through the feature flag
    Options = MSCOptions
    limits = StoreLimits()  # large objects go through open_stream's spool + upload_file
    options: MSCOptions

    def __init__(self, location: str, options: MSCOptions | None = None) -> None:
        super().__init__(location.rstrip("/") or location, options)
        self.profile = ""
        self.root = ""
        #: Whether the storage root is known to exist (see :meth:`_storage_missing`).
        self._storage_exists = False
        # resolve the profile now: a bad one fails on every rank before anything is written
        self.client  # noqa: B018

    @classmethod
    def location_for(cls, uri: ParsedURI) -> str:
        """The URL MSC resolves for a parsed URI of any scheme (``msc://profile/path``,
        ``s3://bucket/path``, a local path): the store's location."""
        if uri.scheme == "file":
            return uri.location
        return f"{uri.scheme}://{uri.location}"

    @property
    def uri(self) -> str:
        return self.location

    # -- the client ----------------------------------------------------------------------

    def connect(self) -> Any:
        """Resolve the location (profile and root) and return MSC's client for it."""
        install_log_redaction()  # MSC's S3 provider is botocore: same DEBUG logs
        client, self.profile, self.root = resolve_url(self.location, self.options.config)
        return client

    def _full(self, key: str) -> str:
        self.client  # noqa: B018 (resolving sets the root)
        return f"{self.root}/{key}" if self.root else key

    def _posix_path(self, key: str) -> str | None:
        client = self.client
        if getattr(client, "_metadata_provider", None) is not None:
            return None
        try:
            path = client.get_posix_path(self._full(key))
        except Exception:
            return None
        return str(path) if path else None

    # -- the contract --------------------------------------------------------------------

    def read(self, key: str, offset: int = 0,
             buffers: Sequence[memoryview] | None = None) -> bytes | None:
        if buffers is None:
            data = bytes(self.client.read(self._full(key)))
            return data[offset:] if offset else data
        views = [_byte_view(b) for b in buffers if len(b)]
        total = sum(len(v) for v in views)
        path = self._posix_path(key)
        if path is not None:
            read_file_into(path, offset, views)
            return None
        from multistorageclient.types import Range

        client, full = self.client, self._full(key)
        chunk = self.options.read_chunk
        piece, filled = 0, 0  # the destination being filled, and how much of it is
        pos, end = offset, offset + total
        while pos < end:
            size = min(chunk, end - pos)
            try:
                data = client.read(full, byte_range=Range(offset=pos, size=size))
            except Exception as exc:
                if http_status(exc) == 416:  # the object ends before ``pos``
                    raise EOFError(
                        f"{self.location}/{key} ends before byte {pos}, expected {total} "
                        f"bytes from offset {offset} (object truncated?)"
                    ) from exc
                raise
            src = memoryview(data).cast("B")
            if len(src) < size:
                raise EOFError(
                    f"{self.location}/{key} ends at byte {pos + len(src)}, expected {total} "
                    f"bytes from offset {offset} (object truncated?)"
                )
            src = src[:size]
            while src:
                dest = views[piece]
                take = min(len(src), len(dest) - filled)
                dest[filled : filled + take] = src[:take]
                src = src[take:]
                filled += take
                if filled == len(dest):
                    piece, filled = piece + 1, 0
            del src, data  # the chunk is free before the next request
            pos += size
        return None

    def put(self, key: str, data: memoryview) -> None:
        # object-store PUTs and MSC's POSIX writes (temp file + rename) are atomic
        self.client.write(self._full(key), bytes(data))

    def head(self, key: str) -> ObjectInfo:
        meta = self.client.info(self._full(key))
        if getattr(meta, "type", "file") != "file":
            raise FileNotFoundError(errno.ENOENT, "not an object (a directory)", key)
        return _info(key, meta)

    def list(self, prefix: str, *, start_after: str = "",
             delimiter: str | None = None) -> list[ObjectInfo | str]:
        base = self.root.strip("/")
        full_prefix = f"{base}/{prefix}" if base else prefix
        if delimiter is None:
            directory = full_prefix.rpartition("/")[0]
            listing = (directory + "/") if directory else ""
        else:
            listing = full_prefix
        if self.root.startswith("/"):
            listing = "/" + listing
        try:
            # include_directories: one level, a delimiter listing on object stores
            entries = list(self.client.list(path=listing,
                                            include_directories=delimiter is not None))
        except FileNotFoundError:
            return []
        out: list[ObjectInfo | str] = []
        for meta in entries:
            name = str(meta.key).lstrip("/")
            if not name.startswith(full_prefix):
                continue
            is_file = getattr(meta, "type", "file") == "file"
            rest = name[len(full_prefix):]
            if delimiter is not None:
                segment, sep, _ = rest.rstrip("/").partition("/")
                if segment and (sep or not is_file):
                    out.append(segment)
                    continue
            if is_file:
                out.append(_info(name[len(base) + 1:] if base else name, meta))
        return out

    def delete(self, keys: Sequence[str]) -> None:
        self.client.delete_many([self._full(k) for k in keys])

    def open_stream(self, key: str) -> Upload:
        path = self._posix_path(key)
        if path is not None:
            # straight into ``.<name>.<id>.tmp`` beside the target, renamed over it at commit
            return FileUpload(key, path, fsync=self.options.fsync, via_temp=True)
        return SpooledUpload(self, key)

    # -- errors --------------------------------------------------------------------------

    def map_error(self, exc: Exception, key: str | None) -> StoreError | None:
        from multistorageclient.types import PreconditionFailedError as MSCPrecondition
        from multistorageclient.types import RetryableError

        where = f"{self.location}/{key}" if key else self.location
        profile = f" (MSC profile {self.profile!r})" if self.profile else ""
        text = redact(str(exc))  # the client's message, quoted
        rid = request_id(exc)
        status = http_status(exc)
        if isinstance(exc, FileNotFoundError):
            if self._storage_missing():
                return BucketNotFoundError(
                    f"the bucket/container behind {self.location}{profile} does not exist: "
                    f"{text}; create it or fix the profile's base_path", request_id=rid)
            return ObjectNotFoundError(f"no such object {where}{profile}: {text}",
                                       request_id=rid)
        if isinstance(exc, PermissionError) or status in (401, 403):
            return AccessDeniedError(f"permission denied for {where}{profile}: {text}",
                                     request_id=rid)
        if isinstance(exc, MSCPrecondition) or status == 412:
            return PreconditionFailedError(
                f"precondition failed for {where}{profile}: {text}", request_id=rid)
        if status == 416:
            return StoreError(f"{where}: byte range past the end of the object: {text}",
                              request_id=rid)
        transport = transport_failure(exc)
        if transport == "timeout":
            return StoreTimeoutError(f"request for {where}{profile} timed out: {text}",
                                     request_id=rid)
        if transport == "connection":
            return StoreUnavailableError(
                f"cannot reach the storage of {where}{profile}: {text}. Check the profile's "
                "endpoint and that the server is running", request_id=rid)
        if status in (429, 503):
            return StoreThrottledError(
                f"the storage of {where}{profile} kept throttling requests (HTTP {status}): "
                f"{text}; lower max_concurrency or raise max_attempts", request_id=rid)
        if isinstance(exc, RetryableError) or (status is not None and status >= 500):
            return StoreUnavailableError(f"MSC request for {where}{profile} failed: {text}",
                                         request_id=rid)
        if isinstance(exc, RuntimeError):
            return StoreError(f"MSC request for {where}{profile} failed: {text}",
                              request_id=rid)
        return None  # raised unchanged (ConnectionError / TimeoutError retried)

    def _storage_missing(self) -> bool:
        """Whether the bucket / container behind the profile is missing.

        MSC raises the same ``FileNotFoundError`` for a missing object and a missing
        bucket, so the root is listed once: a listing fails (``FileNotFoundError``, or
        the provider's own HTTP 404) only when the bucket is gone (an empty prefix lists
        nothing). POSIX profiles have no buckets; once the bucket was seen, it is not
        checked again.
        """
        if self._storage_exists or self._posix_path("x") is not None:
            return False
        base = self.root.strip("/")
        listing = f"{base}/" if base else ""
        try:
            next(iter(self.client.list(path=listing)), None)
        except Exception as exc:
            # MSC translates some providers' listing errors, and passes others through
            if isinstance(exc, FileNotFoundError) or http_status(exc) == 404:
                return True
            # cannot tell (e.g. no list permission): not missing
            logger.debug("%s: checking the storage root failed: %s", self.location, exc)
            return False
        self._storage_exists = True
        return False

    def call(self, fn: Callable[..., T], *args: Any, key: str) -> T:
        """Run one request of an upload's commit with ``max_attempts`` attempts (what
        the framework does for the contract's methods; an ``open_stream`` upload is
        outside it), raising what :meth:`map_error` says."""
        o = self.options
        for attempt in range(1, o.max_attempts + 1):
            try:
                return fn(*args)
            except Exception as exc:
                error = self.map_error(exc, key)
                retryable = (error.retryable if error is not None
                             else isinstance(exc, (ConnectionError, TimeoutError)))
                if retryable and attempt < o.max_attempts:
                    logger.warning("%s: attempt %d/%d failed (%s); retrying", self.uri,
                                   attempt, o.max_attempts, error or exc)
                    time.sleep(random.uniform(0, min(o.retry_backoff_max,
                                                     o.retry_backoff * 2 ** attempt)))
                    continue
                if error is None:
                    raise
                raise error from exc
        raise AssertionError("unreachable")  # pragma: no cover


class SpooledUpload(Upload):
    """Memory up to ``part_size``, then a temporary file handed to ``upload_file``."""

    def __init__(self, store: MSCStore, key: str) -> None:
        self.store = store
        self.key = key
        self._memory = bytearray()
        self._spool: IO[bytes] | None = None
        self._size = 0
        self._closed = False

    def write(self, data: Buffer) -> int:
        if self._closed:
            raise ValueError(f"upload of {self.key!r} is already closed")
        view = memoryview(data).cast("B")
        options = self.store.options
        if self._spool is None and len(self._memory) + len(view) > options.part_size:
            self._spool = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in _cleanup)
                prefix="dcpstore-msc-", suffix=".spool", dir=options.spool_dir,
                delete=False,
            )
            self._spool.write(self._memory)
            self._memory = bytearray()
        if self._spool is not None:
            self._spool.write(view)
        else:
            self._memory += view
        self._size += len(view)
        return len(view)

    def commit(self) -> ObjectInfo:
        if self._closed:
            raise ValueError(f"upload of {self.key!r} is already closed")
        store = self.store
        try:
            client, full = store.client, store._full(self.key)
            if self._spool is None:
                store.call(client.write, full, bytes(self._memory), key=self.key)
            else:
                self._spool.flush()
                store.call(client.upload_file, full, self._spool.name, key=self.key)
        finally:
            self._cleanup()
        return ObjectInfo(self.key, self._size)

    def abort(self) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        self._closed = True
        self._memory = bytearray()
        spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spool.name)


#: The framework's backend class for :class:`MSCStore`: the one the registry hands out
#: for the entry point, bound here under the name and module the framework gives it, so
#: that the class itself pickles (process-mode saves pickle writer state holding it).
MSCStoreBackend = backend_class(MSCStore)


def _info(key: str, meta: Any) -> ObjectInfo:
    modified = getattr(meta, "last_modified", None)
    return ObjectInfo(key, int(meta.content_length),
                      modified.timestamp() if modified is not None else None)


def _byte_view(out: memoryview) -> memoryview:
    """``out`` as a flat view of unsigned bytes (what ``bytes`` slices assign into)."""
    return out if out.format == "B" and out.ndim == 1 else out.cast("B")
