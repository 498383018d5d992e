"""NVIDIA multi-storage-client (MSC) backend: every store MSC reaches, through dcpstore.

URIs: ``msc://profile/path``, resolved through MSC's configuration (``MSC_CONFIG``, its
search paths such as ``~/.msc_config.yaml``, or a config given as the ``config``
option). With the feature flag (``backend="msc"`` or ``DCPSTORE_BACKEND=msc``), a
plain ``s3://``, ``gs://``, ``ais://`` URI or a local path is resolved exactly as MSC
resolves it: its ``path_mapping`` first, then MSC's implicit profiles
(``_s3-<bucket>``, ``__filesystem__``) — the Megatron ``MultiStorageClientFeature``
pattern.

Primitives map onto MSC's ``StorageClient``: ``read(path, byte_range=Range(...))`` for
ranged reads (run concurrently by the base class), ``write`` for small objects,
``info``, ``list`` and ``delete_many``. MSC returns every ranged read as one ``bytes``
object, so a range is fetched as consecutive requests of at most ``read_chunk`` bytes,
each copied straight into the destination buffers it spans: the transient memory per
range in flight is one chunk, not the range. POSIX profiles (no metadata provider) read
with ``preadv`` straight into the destinations. Retries and timeouts are MSC's own (the
profile's ``retry`` section and the provider's options, e.g. ``connect_timeout``,
``read_timeout``, ``retries`` for S3): dcpstore does not retry on top of them.

Errors are classified by MSC's own exception types (``FileNotFoundError``,
``PermissionError``, ``PreconditionFailedError``, ``RetryableError``, and
``RuntimeError`` for anything else), refined where needed by the structured status of
the provider error MSC chained to them, never by messages. MSC reports a missing bucket
as a missing object, so a ``FileNotFoundError`` from an object store is checked once by
listing the root: if that fails too, the storage itself is missing
(:class:`~dcpstore.errors.BucketNotFoundError`).

Uploads. MSC has no streaming multipart API, so a data file is buffered in memory up to
``part_size`` bytes and sent with one ``write``; a larger one spills to a temporary
file (in ``spool_dir``) that is handed to MSC's ``upload_file`` on commit — for object
stores that is MSC's parallel multipart upload — and deleted afterwards. For profiles
on a POSIX file system (no metadata provider) the bytes stream straight into a hidden
temporary file beside the target and are renamed over it at commit, with no spooling.
Nothing is visible under the final key before commit.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import IO, Any
from urllib.parse import urlsplit

from typing_extensions import Buffer

from dcpstore.errors import (
    BucketNotFoundError,
    DcpstoreError,
    StoreThrottledError,
    StoreTimeoutError,
)
from dcpstore.storage.backend import Backend, BackendOptions, Failure, ObjectInfo, Upload
from dcpstore.storage.local import FileUpload, read_file_into
from dcpstore.storage.redact import install_log_redaction, redact
from dcpstore.storage.uri import ParsedURI

__all__ = [
    "MSCBackend",
    "MSCConfigError",
    "MSCOptions",
    "ProfileNotFoundError",
    "StorageNotFoundError",
]

logger = logging.getLogger(__name__)

MSC_SCHEME = "msc"


@dataclass
class MSCOptions(BackendOptions):
    """Options of the MSC backend (also ``DCPSTORE_MSC_<OPTION>`` variables, URI query).

    Attributes:
        config: The MSC configuration: a dict (as in ``msc_config.yaml``) or the path of
            a YAML/JSON config file. Default: MSC's own lookup (``MSC_CONFIG``, then its
            search paths).
        part_size: Objects up to this size are uploaded from memory in one request;
            larger ones are spooled to a temporary file and uploaded by MSC.
        spool_dir: Directory of the temporary spool files (default: the system's).
        fsync: On POSIX profiles, ``fsync`` data files before they are renamed into place.
        max_attempts: dcpstore's own attempts per request. MSC retries by itself (the
            profile's ``retry`` section), so the default is one.
        read_chunk: Largest single ``read`` request. MSC returns each ranged read as a
            whole ``bytes`` object, so a range the reader asks for (up to 64 MiB) is
            fetched as consecutive requests of at most this many bytes, each copied
            straight into its destination buffers: the transient memory per range in
            flight is one chunk, not the range. POSIX profiles read with ``preadv``
            straight into the destinations and ignore it.
    """

    # a config dict may hold credentials (credentials_provider options): never shown
    config: dict[str, Any] | str | None = field(default=None, repr=False)
    spool_dir: str | None = None
    fsync: bool = True
    max_attempts: int = 1
    part_size: int = 64 * 1024 * 1024
    read_chunk: int = 16 * 1024 * 1024

    def validate(self) -> None:
        """Raise ``ValueError`` for values that make no sense."""
        super().validate()
        if self.read_chunk < 1:
            raise ValueError(f"read_chunk must be > 0, got {self.read_chunk}")


class MSCConfigError(DcpstoreError, ValueError):
    """The MSC configuration is missing, unreadable or invalid."""


class ProfileNotFoundError(MSCConfigError, LookupError):
    """An ``msc://`` URI names a profile the MSC configuration does not define."""


#: The bucket / container behind an MSC profile does not exist: the error every backend
#: raises for a missing bucket (kept under its old name).
StorageNotFoundError = BucketNotFoundError


# -- configuration and resolution --------------------------------------------------------

_CLIENTS: dict[tuple[int, str, str], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _load_config(config: dict[str, Any] | str | None) -> tuple[dict[str, Any], str]:
    """The MSC config dict and where it came from (``""`` when none was found)."""
    from multistorageclient.config import StorageClientConfig

    if isinstance(config, dict):
        return config, "the config option"
    paths = [config] if isinstance(config, str) and config else None
    if paths and not os.path.isfile(paths[0]):
        raise MSCConfigError(f"MSC config file {paths[0]!r} (config option) does not exist")
    try:
        found, path = StorageClientConfig.read_msc_config(config_file_paths=paths)
    except Exception as exc:
        raise MSCConfigError(f"invalid MSC configuration: {exc}") from exc
    return dict(found or {}), path or ""


def _rclone_profiles() -> dict[str, Any]:
    try:
        from multistorageclient.rclone import read_rclone_config

        found, _ = read_rclone_config()
    except Exception:
        return {}
    return dict((found or {}).get("profiles", {}))


def _search_paths() -> list[str]:
    from multistorageclient import config as msc_config

    paths = []
    if os.environ.get("MSC_CONFIG"):
        paths.append(f"$MSC_CONFIG={os.environ['MSC_CONFIG']}")
    paths += list(msc_config._find_config_file_paths())
    return paths


def _split_msc_url(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    path = "/".join(s for s in parts.path.split("/") if s)
    return parts.netloc, path


def _implicit(url: str, config: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """Resolve a non-msc URL against an explicit config, as MSC does for its own config:
    ``path_mapping`` first, then implicit profiles."""
    from multistorageclient.config import (
        RESERVED_POSIX_PROFILE_NAME,
        SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS,
        PathMapping,
        create_implicit_profile_config,
    )

    found = PathMapping.from_config(config).find_mapping(url)
    if found is not None:
        return found[0], found[1], config
    parts = urlsplit(url)
    protocol = parts.scheme.lower() if "://" in url else "file"
    if protocol == "file":
        profile, path, base = RESERVED_POSIX_PROFILE_NAME, parts.path or url, "/"
    else:
        if protocol not in SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS:
            raise MSCConfigError(
                f"MSC cannot serve {url}: no path_mapping entry matches it and {protocol}:// "
                f"has no implicit profile (MSC supports "
                f"{', '.join(p + '://' for p in SUPPORTED_IMPLICIT_PROFILE_PROTOCOLS)})"
            )
        profile = f"_{protocol}-{parts.netloc}"
        path, base = parts.path.lstrip("/"), parts.netloc
    merged = copy.deepcopy(config)
    merged.setdefault("profiles", {})
    if profile not in merged["profiles"]:
        merged["profiles"].update(
            create_implicit_profile_config(profile, protocol, base)["profiles"])
    return profile, path, merged


def _check_endpoint(config: dict[str, Any], profile: str) -> None:
    """Refuse a profile whose endpoint URL carries ``user:password@`` (never echoed: the
    client libraries would print it in their logs and errors)."""
    endpoint: Any = config.get("profiles") or {}
    for name in (profile, "storage_provider", "options", "endpoint_url"):
        endpoint = endpoint.get(name) if isinstance(endpoint, dict) else None
    if isinstance(endpoint, str) and "@" in urlsplit(endpoint).netloc:
        raise MSCConfigError(
            f"the endpoint_url of MSC profile {profile!r} carries credentials; credentials "
            "never belong in a URL: put them in the profile's credentials_provider"
        )


def _client_for(config: dict[str, Any], profile: str) -> Any:
    """An MSC StorageClient for ``profile`` of an explicit config (cached per process)."""
    from multistorageclient import StorageClient, StorageClientConfig

    key = (os.getpid(), json.dumps(config, sort_keys=True, default=str), profile)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            try:
                cfg = StorageClientConfig.from_dict(config, profile=profile)
            except Exception as exc:
                raise MSCConfigError(f"MSC profile {profile!r} is invalid: {exc}") from exc
            client = StorageClient(cfg)
            _CLIENTS[key] = client
        return client


# -- uploads -------------------------------------------------------------------------------


class _SpooledUpload(Upload):
    """Memory up to ``part_size``, then a temporary file handed to ``upload_file``."""

    def __init__(self, backend: MSCBackend, key: str) -> None:
        self.backend = backend
        self.key = key
        self._memory = bytearray()
        self._spool: IO[bytes] | None = None
        self._size = 0
        self._closed = False

    def write(self, data: Buffer) -> int:
        if self._closed:
            raise ValueError(f"upload of {self.key!r} is already closed")
        view = memoryview(data).cast("B")
        if self._spool is None and len(self._memory) + len(view) > self.backend.options.part_size:
            self._spool = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in _cleanup)
                prefix="dcpstore-msc-", suffix=".spool", dir=self.backend.options.spool_dir,
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
        be = self.backend
        try:
            client, full = be.client, be._full(self.key)
            if self._spool is None:
                be._call(client.write, full, bytes(self._memory), key=self.key)
            else:
                self._spool.flush()
                be._call(client.upload_file, full, self._spool.name, key=self.key)
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


# -- the backend ---------------------------------------------------------------------------


class MSCBackend(Backend):
    """A location MSC resolves: ``msc://profile/path``, or (feature flag) any URL or path.

    Args:
        location: The URL as MSC takes it: ``msc://profile/path``, ``s3://bucket/path``,
            ``gs://bucket/path`` or an absolute local path.
        options: :class:`MSCOptions`.
    """

    Options = MSCOptions
    name = MSC_SCHEME
    schemes = ()  # any scheme: msc:// natively, others through the feature flag
    options: MSCOptions

    @classmethod
    def from_uri(cls, uri: ParsedURI, options: BackendOptions) -> MSCBackend:
        """Accept ``msc://`` and, routed by the feature flag, any other URI or path.

        The profile is resolved (and the config checked) here, so a bad profile or a
        missing config fails on every rank before anything is written.
        """
        if uri.scheme == MSC_SCHEME:
            url = f"msc://{uri.location}"
        elif uri.scheme == "file":
            url = uri.location
        else:
            url = f"{uri.scheme}://{uri.location}"
        backend = cls(url, options)
        backend.client  # noqa: B018 (resolve now: a bad profile fails on every rank)
        return backend

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        super().__init__(location.rstrip("/") or location, options)
        self.profile = ""
        self.root = ""
        #: Whether the storage root is known to exist (see :meth:`_storage_missing`).
        self._storage_exists = False

    @property
    def uri(self) -> str:
        return self.location

    # -- resolution --------------------------------------------------------------------

    def _make_client(self) -> Any:
        install_log_redaction()  # MSC's S3 provider is botocore: same DEBUG logs
        client, self.profile, self.root = self._resolve()
        return client

    def _resolve(self) -> tuple[Any, str, str]:
        url = self.location
        explicit = self.options.config
        if url.startswith("msc://"):
            profile, path = _split_msc_url(url)
            config, source = _load_config(explicit)
            self._check_profile(profile, config, source)
            _check_endpoint(config, profile)
            if explicit is None:
                import multistorageclient as msc

                client, path = msc.resolve_storage_client(url)
                return client, profile, path.strip("/")
            return _client_for(config, profile), profile, path
        if explicit is None:
            import multistorageclient as msc

            try:
                client, path = msc.resolve_storage_client(url)
            except ValueError as exc:
                raise MSCConfigError(f"MSC cannot resolve {url}: {exc}") from exc
            return client, client.profile, _root(path)
        config, _ = _load_config(explicit)
        profile, path, merged = _implicit(url, config)
        _check_endpoint(merged, profile)
        return _client_for(merged, profile), profile, _root(path)

    def _check_profile(self, profile: str, config: dict[str, Any], source: str) -> None:
        from multistorageclient.config import RESERVED_POSIX_PROFILE_NAME

        if not profile:
            raise MSCConfigError(f"{self.location} names no profile: use msc://profile/path")
        profiles = {**_rclone_profiles(), **dict(config.get("profiles") or {})}
        if profile in profiles or profile == RESERVED_POSIX_PROFILE_NAME or (
            profile.startswith("_") and "-" in profile
        ):
            return
        if not source:
            raise MSCConfigError(
                f"no MSC configuration found for {self.location}: set MSC_CONFIG to a "
                "config file, pass config={...} (or config='path/to/msc_config.yaml'), or "
                f"create one of: {', '.join(_search_paths())}"
            )
        known = ", ".join(sorted(profiles)) or "(none)"
        raise ProfileNotFoundError(
            f"MSC profile {profile!r} is not defined in {source}; known profiles: {known}"
        )

    def _full(self, key: str) -> str:
        self.client  # noqa: B018 (resolving sets the root)
        return f"{self.root}/{key}" if self.root else key

    def _posix_path(self, key: str) -> str | None:
        client = self.client
        if getattr(client, "_metadata_provider", None) is not None:
            return None
        try:
            return client.get_posix_path(self._full(key))
        except Exception:
            return None

    # -- primitives ----------------------------------------------------------------------

    def _open_upload(self, key: str) -> Upload:
        path = self._posix_path(key)
        if path is not None:
            # straight into ``.<name>.<id>.tmp`` beside the target, renamed over it at commit
            return FileUpload(key, path, fsync=self.options.fsync, via_temp=True)
        return _SpooledUpload(self, key)

    def _read_into(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fill ``outs`` in order from ``offset``: ``preadv`` on POSIX profiles, otherwise
        consecutive ``read`` requests of at most ``read_chunk`` bytes, each copied into the
        pieces of ``outs`` it spans (no staging buffer for the whole range)."""
        views = [_byte_view(o) for o in outs if len(o)]
        total = sum(len(v) for v in views)
        if not total:
            return
        path = self._posix_path(key)
        if path is not None:
            read_file_into(path, offset, views)
            return
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
                if _http_status(exc) == 416:  # the object ends before ``pos``
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

    def _put(self, key: str, data: bytes, *, atomic: bool) -> None:
        # object-store PUTs and MSC's POSIX writes (temp file + rename) are atomic
        self.client.write(self._full(key), bytes(data))

    def _get(self, key: str) -> bytes:
        return bytes(self.client.read(self._full(key)))

    def _stat(self, key: str) -> ObjectInfo:
        meta = self.client.info(self._full(key))
        if getattr(meta, "type", "file") != "file":
            raise FileNotFoundError(errno.ENOENT, "not an object (a directory)", key)
        modified = getattr(meta, "last_modified", None)
        return ObjectInfo(key, int(meta.content_length),
                          modified.timestamp() if modified is not None else None)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        client = self.client
        base = self.root.strip("/")
        full_prefix = f"{base}/{prefix}" if base else prefix
        directory = full_prefix.rpartition("/")[0]
        listing = (directory + "/") if directory else ""
        if self.root.startswith("/"):
            listing = "/" + listing
        try:
            entries = list(client.list(path=listing))
        except FileNotFoundError:
            return
        for meta in entries:
            if getattr(meta, "type", "file") != "file":
                continue
            name = str(meta.key).lstrip("/")
            if not name.startswith(full_prefix):
                continue
            key = name[len(base) + 1:] if base else name
            modified = getattr(meta, "last_modified", None)
            yield ObjectInfo(key, int(meta.content_length),
                             modified.timestamp() if modified is not None else None)

    def _list_dirs(self, prefix: str, start_after: str) -> Iterator[str]:
        base = self.root.strip("/")
        full_prefix = f"{base}/{prefix}" if base else prefix
        listing = ("/" + full_prefix) if self.root.startswith("/") else full_prefix
        try:
            # include_directories: one level, a delimiter listing on object stores
            entries = list(self.client.list(path=listing, include_directories=True))
        except FileNotFoundError:
            return
        for meta in entries:
            name = str(meta.key).lstrip("/")
            if not name.startswith(full_prefix):
                continue
            rest = name[len(full_prefix):]
            segment, sep, _ = rest.rstrip("/").partition("/")
            if segment and (sep or getattr(meta, "type", "file") == "directory"):
                yield segment

    def _delete(self, keys: Sequence[str]) -> None:
        self.client.delete_many([self._full(k) for k in keys])

    # -- errors --------------------------------------------------------------------------

    def _classify(self, exc: Exception, key: str | None) -> Failure | None:
        from multistorageclient.types import PreconditionFailedError, RetryableError

        where = f"{self.location}/{key}" if key else self.location
        profile = f" (MSC profile {self.profile!r})" if self.profile else ""
        text = redact(str(exc))  # the client's message (request ids included), quoted
        if isinstance(exc, FileNotFoundError):
            if self._storage_missing():
                return Failure(BucketNotFoundError(
                    errno.ENOENT,
                    f"the bucket/container behind {self.location}{profile} does not exist: "
                    f"{text}; create it or fix the profile's base_path",
                ))
            return Failure(FileNotFoundError(
                errno.ENOENT, f"no such object {where}{profile}: {text}"))
        if isinstance(exc, PermissionError):
            return Failure(PermissionError(
                errno.EACCES, f"permission denied for {where}{profile}: {text}"))
        if isinstance(exc, PreconditionFailedError):
            return Failure(FileExistsError(
                errno.EEXIST, f"precondition failed for {where}{profile}: {text}"))
        # MSC retried these itself; dcpstore only does when max_attempts > 1
        retryable = isinstance(exc, RetryableError)
        if _http_status(exc) == 416:
            return Failure(OSError(f"{where}: byte range past the end of the object: {text}"))
        transport = _transport_failure(exc)
        if transport == "timeout":
            return Failure(StoreTimeoutError(
                f"request for {where}{profile} timed out: {text}"), retryable)
        if transport == "connection":
            return Failure(ConnectionError(
                f"cannot reach the storage of {where}{profile}: {text}. Check the profile's "
                "endpoint and that the server is running"
            ), retryable)
        if retryable and _http_status(exc) in (429, 503):
            return Failure(StoreThrottledError(
                errno.EAGAIN,
                f"the storage of {where}{profile} kept throttling requests (HTTP "
                f"{_http_status(exc)}) through MSC's retries: {text}; lower "
                "max_concurrency or raise the profile's retry attempts",
            ), retryable)
        if isinstance(exc, (RetryableError, RuntimeError)):
            return Failure(OSError(f"MSC request for {where}{profile} failed: {text}"),
                           retryable)
        return Failure(exc)  # raised unchanged, never retried by dcpstore

    def _storage_missing(self) -> bool:
        """Whether the bucket / container behind the profile is missing.

        MSC raises the same ``FileNotFoundError`` for a missing object and a missing
        bucket, so the root is listed once: a listing fails (``FileNotFoundError``, or
        the provider's own HTTP 404) only when the bucket is gone (an empty prefix lists
        nothing). POSIX profiles have no buckets; once the bucket
        was seen, it is not checked again.
        """
        if self._storage_exists or self._posix_path("x") is not None:
            return False
        try:
            next(iter(self.client.list(path=self._list_root())), None)
        except Exception as exc:
            # MSC translates some providers' listing errors, and passes others through
            if isinstance(exc, FileNotFoundError) or _http_status(exc) == 404:
                return True
            # cannot tell (e.g. no list permission): not missing
            logger.debug("%s: checking the storage root failed: %s", self.location, exc)
            return False
        self._storage_exists = True
        return False

    def _list_root(self) -> str:
        base = self.root.strip("/")
        listing = f"{base}/" if base else ""
        return "/" + listing if self.root.startswith("/") else listing


def _byte_view(out: memoryview) -> memoryview:
    """``out`` as a flat view of unsigned bytes (what ``bytes`` slices assign into)."""
    return out if out.format == "B" and out.ndim == 1 else out.cast("B")


def _root(path: str) -> str:
    path = path.rstrip("/")
    return path if path.startswith("/") else path.strip("/")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the provider errors MSC chained to it (``__cause__``/``__context__``)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 10:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of the provider error behind ``exc``, read from the provider
    client's own exception types (botocore, MSC's Rust client, google-api-core, Azure)."""
    for e in _chain(exc):
        for kind, status in _status_readers():
            if isinstance(e, kind):
                value = status(e)
                if isinstance(value, int) and value:
                    return value
    return None


@lru_cache(maxsize=1)
def _status_readers() -> tuple[tuple[type[BaseException], Any], ...]:
    readers: list[tuple[type[BaseException], Any]] = []
    with contextlib.suppress(ImportError):
        from botocore.exceptions import ClientError

        readers.append((ClientError, lambda e: e.response.get("ResponseMetadata", {})
                        .get("HTTPStatusCode")))
    with contextlib.suppress(ImportError):
        from multistorageclient_rust import RustClientError, RustRetryableError

        def rust_status(e: BaseException) -> Any:
            return e.args[1] if len(e.args) > 1 else None

        readers += [(RustClientError, rust_status), (RustRetryableError, rust_status)]
    with contextlib.suppress(ImportError):
        from google.api_core.exceptions import GoogleAPICallError

        readers.append((GoogleAPICallError, lambda e: e.code))
    with contextlib.suppress(ImportError):
        from azure.core.exceptions import HttpResponseError

        readers.append((HttpResponseError, lambda e: e.status_code))
    return tuple(readers)


def _transport_failure(exc: BaseException) -> str | None:
    """``"timeout"`` or ``"connection"`` when a request behind ``exc`` timed out or could
    not connect (the outermost such error in the chain decides), else ``None``."""
    for e in _chain(exc):
        if isinstance(e, _connection_types()[:1]):
            return "connection"  # urllib3's NewConnectionError is also a ConnectTimeoutError
        if isinstance(e, _timeout_types()):
            return "timeout"
        if isinstance(e, _connection_types()):
            return "connection"
    return None


@lru_cache(maxsize=1)
def _timeout_types() -> tuple[type[BaseException], ...]:
    """Timeouts, as the providers' client libraries raise them."""
    types: list[type[BaseException]] = [TimeoutError]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

        types += [ConnectTimeoutError, ReadTimeoutError]
    with contextlib.suppress(ImportError):
        from urllib3.exceptions import TimeoutError as Urllib3Timeout

        types.append(Urllib3Timeout)  # (NewConnectionError, a subclass, is checked first)
    with contextlib.suppress(ImportError):
        from requests.exceptions import Timeout

        types.append(Timeout)
    return tuple(types)


@lru_cache(maxsize=1)
def _connection_types() -> tuple[type[BaseException], ...]:
    """Connections refused, reset or dropped, as the providers' client libraries raise
    them; the first entry is the type that wins over a timeout type it subclasses."""
    types: list[type[BaseException]] = []
    try:
        from urllib3.exceptions import NewConnectionError

        types.append(NewConnectionError)
    except ImportError:  # pragma: no cover
        types.append(ConnectionRefusedError)
    types.append(ConnectionError)
    with contextlib.suppress(ImportError):
        from botocore.exceptions import ConnectionClosedError
        from botocore.exceptions import ConnectionError as BotocoreConnectionError

        types += [BotocoreConnectionError, ConnectionClosedError]
    with contextlib.suppress(ImportError):
        from urllib3.exceptions import ProtocolError

        types.append(ProtocolError)
    with contextlib.suppress(ImportError):
        from requests.exceptions import ConnectionError as RequestsConnectionError

        types.append(RequestsConnectionError)
    with contextlib.suppress(ImportError):
        from azure.core.exceptions import ServiceRequestError

        types.append(ServiceRequestError)
    return tuple(types)
