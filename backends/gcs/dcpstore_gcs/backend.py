"""Google Cloud Storage store, built on gcsfs: the plugin class :class:`GCSStore`.

URIs: ``gs://bucket/prefix`` (``gcs://`` is an alias). Everything goes through the GCS
JSON API with gcsfs's credentials, endpoint resolution (``STORAGE_EMULATOR_HOST``,
mTLS), aiohttp session and event loop; the requests themselves are issued by
:mod:`dcpstore_gcs.api` so that every one carries a timeout and a CRC32C, and errors
keep their HTTP status, GCS error reason and request id. Retries, concurrency, part
buffers and part sizes are dcpstore's framework's (:mod:`dcpstore.plugin`).

Writes
    An object that fits one part is stored with a single multipart/related upload
    carrying its CRC32C (GCS rejects the upload if the bytes do not match).

    A larger object is a *parallel composite upload*: every part becomes a temporary
    object ``<root>/.dcpstore-uploads/<upload id>/pNNNNN/<key>``, uploaded concurrently
    with its CRC32C while the writer keeps serializing. :meth:`GCSStore.complete_upload`
    composes the parts into the final object (in a tree of at most 32 sources per
    ``compose`` call), checks the composite's CRC32C against the parts' CRC32Cs
    combined, and deletes the parts. Until then nothing exists under the final key. A
    resumable upload session would be the alternative, but its chunks must be sent one
    after another, so it cannot keep several parts in flight. GCS allows 1024
    components per composite object (:attr:`GCSStore.limits`); the framework grows
    parts (2x after part 102, 4x after part 204) so one object can reach 3586 x
    ``part_size`` (112 GiB at the default 32 MiB) before an
    :class:`~dcpstore.errors.ObjectTooLargeError` asks for a larger ``part_size``.
    Parts left behind by a crash are found by :meth:`GCSStore.list_uploads` and removed
    by :meth:`GCSStore.abort_upload` (``dcpstore gc``). Buckets with a soft-delete policy
    keep deleted parts (and bill them) for the retention period.

Reads
    Ranged ``GET ...?alt=media`` requests with a ``Range`` header, streamed straight
    into the caller's buffers. Whole-object reads verify the CRC32C GCS returns in
    ``x-goog-hash``.

gcsfs itself is reached only through :mod:`dcpstore_gcs.gcsfs_adapter`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from dcpstore import errors
from dcpstore.plugin import (
    BucketNotFoundError,
    MultipartStore,
    ObjectInfo,
    StoreLimits,
    StoreOptions,
)
from dcpstore.plugin import load_customer_key as _load_key
from dcpstore.storage.store_backend import backend_class

from .api import (
    ChecksumMismatch,
    GCSRequestError,
    JsonApi,
    crc32c,
    crc32c_combine,
    crc_b64,
    crc_from_b64,
    parse_time,
)
from .gcsfs_adapter import GcsfsClient

__all__ = [
    "BucketNotFoundError",
    "CorruptDownloadError",
    "GCSBackend",
    "GCSOptions",
    "GCSRequestError",
    "GCSStore",
    "TLSHandshakeError",
]

logger = logging.getLogger(__name__)

#: Prefix (under the checkpoint root) of the temporary part objects of composite uploads.
UPLOADS_PREFIX = ".dcpstore-uploads/"
#: GCS limits: sources per compose request, components per composite object.
MAX_COMPOSE_SOURCES = 32
MAX_COMPONENTS = 1024
#: How GCS asks clients to slow down (429 rate limits, 503 "backend busy").
_THROTTLING_STATUS = frozenset({429, 503})
_SERVER_ERROR_STATUS = frozenset({500, 502, 504})


@dataclass
class GCSOptions(StoreOptions):
    """Options of the GCS store (also ``DCPSTORE_GS_<OPTION>`` variables, URI query).

    Attributes:
        endpoint_url: JSON API endpoint, e.g. ``http://127.0.0.1:4443`` for an emulator.
            Default: ``$STORAGE_EMULATOR_HOST`` if set, else Google's endpoint.
        project: Google Cloud project (billing project for ``requester_pays``).
        token: How to authenticate, as in gcsfs: ``None`` (the standard Google chain:
            ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud ADC, GCE metadata; anonymous
            when talking to ``STORAGE_EMULATOR_HOST``), ``"anon"``,
            ``"google_default"``, ``"cloud"``, a path to a service-account JSON file,
            or (as a keyword argument) a ``google.auth`` credentials object.
        requester_pays: Bill requests to ``project`` (requester-pays buckets).
        connect_timeout: Seconds to establish a connection (``timeout`` bounds each
            whole request).
        max_concurrency: Part uploads and ranged reads in flight per process.
        part_size: Bytes per part of a composite upload (objects of unknown size up to
            this are a single request; ``multipart_threshold`` stays 0, so part 1 is
            ``part_size`` too). At least 256 KiB.
        kms_key_name: CMEK: the Cloud KMS key of the objects written,
            ``projects/P/locations/L/keyRings/R/cryptoKeys/K`` (``kmsKeyName`` on every
            upload and compose; reads need nothing). Default: the bucket's default key,
            else Google-managed encryption. See ``docs/encryption.md``.
        encryption_key_file: CSEK: path of a file holding the 256-bit customer-supplied
            key, 32 raw bytes or their base64 (``openssl rand -base64 32``). Sent (with
            its SHA-256) on every request touching object data: uploads of every part,
            compose, downloads, ranged reads and object metadata; needed to read the
            checkpoint back. Only the path is an option: the key is never logged or shown.
        encryption_key_env: CSEK: name of an environment variable holding the base64 of
            the 256-bit key (instead of ``encryption_key_file``).
    """

    endpoint_url: str | None = None
    project: str | None = None
    # may carry credentials (a service-account dict, a credentials object): never shown
    token: str | None = field(default=None, repr=False)
    requester_pays: bool = False
    connect_timeout: float = 10.0
    max_concurrency: int = 16
    part_size: int = 32 * 1024 * 1024
    kms_key_name: str | None = None
    encryption_key_file: str | None = None
    encryption_key_env: str | None = None

    def validate(self) -> None:
        """Raise :class:`~dcpstore.errors.ConfigurationError` for values that make no
        sense."""
        super().validate()
        if self.connect_timeout <= 0:
            raise errors.ConfigurationError(
                f"connect_timeout must be > 0, got {self.connect_timeout}")
        if self.part_size < 256 * 1024:
            raise errors.ConfigurationError(
                f"part_size must be >= 256 KiB for GCS, got {self.part_size}")
        if self.endpoint_url is not None:
            url = self.endpoint_url if "://" in self.endpoint_url else f"http://{self.endpoint_url}"
            parts = urlsplit(url)
            if parts.username is not None or parts.password is not None:
                # never echo it: it carries a secret
                raise errors.ConfigurationError(
                    "endpoint_url carries credentials; credentials never belong in a URL. "
                    "Use GOOGLE_APPLICATION_CREDENTIALS, application-default credentials or "
                    "token=..."
                )
        if self.kms_key_name is not None and not _KMS_KEY_NAME.fullmatch(self.kms_key_name):
            raise errors.ConfigurationError(
                "kms_key_name must name a Cloud KMS key as projects/<project>/locations/"
                "<location>/keyRings/<ring>/cryptoKeys/<key>, got "
                f"{self.kms_key_name!r}")
        if self.encryption_key_file is not None and self.encryption_key_env is not None:
            raise errors.ConfigurationError(
                "set only one of encryption_key_file and encryption_key_env (both name the "
                "customer-supplied encryption key)")
        if self.customer_key_configured:
            if self.kms_key_name is not None:
                raise errors.ConfigurationError(
                    f"a customer-supplied key ({CUSTOMER_KEY_OPTIONS}) excludes kms_key_name: "
                    "GCS encrypts an object one way; unset one of them")
            load_customer_key(self.encryption_key_file, self.encryption_key_env)

    @property
    def customer_key_configured(self) -> bool:
        """Whether a customer-supplied key (CSEK) is configured."""
        return self.encryption_key_file is not None or self.encryption_key_env is not None


#: The options that name a customer-supplied key (for messages).
CUSTOMER_KEY_OPTIONS = "encryption_key_file or encryption_key_env"
_KMS_KEY_NAME = re.compile(r"projects/[^/]+/locations/[^/]+/keyRings/[^/]+/cryptoKeys/[^/]+")


def load_customer_key(path: str | None, env: str | None) -> bytes:
    """The 32-byte customer-supplied key from the file at ``path`` (raw or base64) or
    from the environment variable named ``env`` (base64); see
    :func:`dcpstore.plugin.load_customer_key`."""
    return _load_key(path=path, env=env, file_option="encryption_key_file",
                     env_option="encryption_key_env")


def encryption_headers(options: GCSOptions) -> dict[str, str]:
    """The ``x-goog-encryption-*`` headers of ``options``' customer-supplied key (empty
    without one)."""
    if not options.customer_key_configured:
        return {}
    key = load_customer_key(options.encryption_key_file, options.encryption_key_env)
    return {"x-goog-encryption-algorithm": "AES256",
            "x-goog-encryption-key": base64.b64encode(key).decode("ascii"),
            "x-goog-encryption-key-sha256":
                base64.b64encode(hashlib.sha256(key).digest()).decode("ascii")}


class CorruptDownloadError(errors.StoreError, errors.IntegrityError):
    """Downloaded bytes did not match the CRC32C GCS reported, through every attempt."""

    retryable = True


class TLSHandshakeError(errors.StoreUnavailableError):
    """The endpoint's certificate is not trusted: the same every time, never retried."""

    retryable = False


class GCSStore(MultipartStore):
    """Objects under ``gs://bucket/prefix`` (see the module docstring).

    Args:
        location: ``bucket/prefix``.
        options: :class:`GCSOptions`.
    """

    name = "gs"
    schemes = ("gs", "gcs")
    Options = GCSOptions
    limits = StoreLimits(max_parts=MAX_COMPONENTS)
    conditional_writes = True
    options: GCSOptions

    def __init__(self, location: str, options: StoreOptions | None = None) -> None:
        super().__init__(location.strip("/"), options)
        bucket, _, prefix = self.location.partition("/")
        if not bucket:
            raise errors.ConfigurationError(f"GCS location {location!r} has no bucket")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._bucket_exists = False
        # the customer-supplied key's headers, read on first use in each process
        self._csek: dict[str, str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_csek"] = None  # a key never travels: each process reads its own
        return state

    # -- plumbing ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The JSON API endpoint requests go to."""
        if self.options.endpoint_url:
            url = self.options.endpoint_url.rstrip("/")
            return url if "://" in url else f"http://{url}"
        return str(self.client.endpoint)

    def connect(self) -> GcsfsClient:
        o = self.options
        return GcsfsClient(token=self._token(), project=o.project,
                           requester_pays=o.requester_pays,
                           endpoint_url=self.endpoint if o.endpoint_url else None)

    def _token(self) -> Any:
        o = self.options
        if o.token is not None:
            return o.token
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        target = o.endpoint_url or (emulator if emulator not in ("", "default") else "")
        if target:
            host = urlsplit(target if "://" in target else f"http://{target}").hostname or ""
            if host in ("localhost", "::1") or host.startswith("127."):
                return "anon"  # like google-cloud-storage: emulators take no credentials
        return None

    def api(self) -> JsonApi:
        """The JSON API requests of this store's bucket."""
        o = self.options
        if self._csek is None:
            self._csek = encryption_headers(o)
        return JsonApi(self.client, self.endpoint, self.bucket, o.timeout,
                       o.connect_timeout, o.max_concurrency,
                       encryption_headers=self._csek, kms_key_name=o.kms_key_name)

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, name: str) -> str:
        return name[len(self.prefix) + 1:] if self.prefix else name

    def _part_name(self, key: str, upload_id: str, tag: str) -> str:
        return self._name(f"{UPLOADS_PREFIX}{upload_id}/{tag}/{key}")

    # -- objects -------------------------------------------------------------------------

    def read(self, key: str, offset: int = 0,
             buffers: Sequence[memoryview] | None = None) -> bytes | None:
        api = self.api()
        if buffers is None:
            return bytes(api.run(api.download(self._name(key), offset)))
        api.run(api.read_range(self._name(key), offset, buffers))
        return None

    def read_checksummed(self, key: str, offset: int, buffers: Sequence[memoryview],
                         checksums: dict[int, int | None]) -> None:
        # each chunk aiohttp hands over is checksummed right after its copy, in cache
        api = self.api()
        api.run(api.read_range(self._name(key), offset, buffers, checksums))

    def put(self, key: str, data: memoryview, *, if_absent: bool = False,
            if_match: str | None = None) -> None:
        # a GCS object upload is atomic: readers see the old object or the new one
        api = self.api()
        generation = "0" if if_absent else if_match  # generation 0: no live object
        api.run(api.upload_object(self._name(key), data, crc32c(data),
                                  if_generation_match=generation))

    def head(self, key: str) -> ObjectInfo:
        api = self.api()
        meta = api.run(api.metadata(self._name(key), fields="name,size,updated,generation"))
        generation = meta.get("generation")
        return ObjectInfo(key, int(meta.get("size", 0)), parse_time(meta.get("updated")),
                          None if generation is None else str(generation))

    def list(self, prefix: str, *, start_after: str = "",
             delimiter: str | None = None) -> Iterable[ObjectInfo | str]:
        api = self.api()
        base = self._name(prefix) if self.prefix else prefix
        start = base + start_after if delimiter and start_after else ""
        items, prefixes = api.run(api.listing(base, delimiter=delimiter, start_offset=start))
        out: list[ObjectInfo | str] = []
        for name, size, mtime in items:
            key = self._key(name)
            if not key.startswith(UPLOADS_PREFIX) or prefix.startswith(UPLOADS_PREFIX):
                out.append(ObjectInfo(key, size, mtime))  # parts are not checkpoint objects
        for name in prefixes:
            segment = name[len(base):].rstrip("/")
            if segment and not (prefix + segment + "/").startswith(UPLOADS_PREFIX):
                out.append(segment)
        return out

    def delete(self, keys: Sequence[str]) -> None:
        api = self.api()
        api.run(api.delete_objects([self._name(k) for k in keys]))

    # -- composite uploads -----------------------------------------------------------------

    def start_upload(self, key: str) -> str:
        self.client  # noqa: B018 (fail here, on credentials, before any part)
        return uuid.uuid4().hex[:16]

    def upload_part(self, key: str, upload_id: str, number: int, data: memoryview) -> str:
        """Store the part as a temporary object; its tag is ``<crc32c hex>:<length>``."""
        crc = crc32c(data)
        api = self.api()
        api.run(api.upload_object(self._part_name(key, upload_id, f"p{number:05d}"), data, crc))
        return f"{crc:08x}:{len(data)}"

    def complete_upload(self, key: str, upload_id: str,
                        parts: Sequence[tuple[int, str]]) -> None:
        # Retried as a whole by the framework: every compose is idempotent (same sources,
        # same target), so the parts are deleted only once the final object is there. A
        # failed attempt (even one whose compose landed but whose response was lost) must
        # leave them for the next one; if every attempt fails, abort_upload removes them.
        api = self.api()
        names = [self._part_name(key, upload_id, f"p{number:05d}") for number, _ in parts]
        temporary = list(names)
        level = 0
        while len(names) > MAX_COMPOSE_SOURCES:
            groups = [names[i:i + MAX_COMPOSE_SOURCES]
                      for i in range(0, len(names), MAX_COMPOSE_SOURCES)]
            targets = [self._part_name(key, upload_id, f"c{level}-{i:04d}")
                       for i in range(len(groups))]
            temporary += targets
            api.run(api.gather([api.compose(group, target)
                                for group, target in zip(groups, targets, strict=True)]))
            names = targets
            level += 1
        final = self._name(key)
        stored = api.run(api.compose(names, final)).get("crc32c")
        expected = 0
        for _, tag in parts:
            crc, _, size = tag.partition(":")
            expected = crc32c_combine(expected, int(crc, 16), int(size))
        if stored and crc_from_b64(stored) != expected:
            api.run(api.delete_objects([final]))
            raise errors.IntegrityError(
                f"gs://{self.bucket}/{final}: composed object has CRC32C {stored}, its "
                f"uploaded parts {crc_b64(expected)}; the object was deleted"
            )
        self._delete_parts(api, key, temporary)

    def _delete_parts(self, api: JsonApi, key: str, names: Sequence[str]) -> None:
        """Delete temporary parts, each attempt retrying only the deletes that failed
        (one failure among hundreds must not restart them all); leftovers are logged and
        found by ``list_uploads`` / ``dcpstore gc``. Never raises: the object is
        committed."""
        o = self.options
        left = list(names)
        for attempt in range(o.max_attempts):
            failed = api.run(api.delete_each(left))
            left = [name for name, _ in failed]
            if not failed:
                return
            error = self.map_error(failed[0][1], key)
            logger.debug("deleting temporary parts of %s failed: %s", key, error or failed[0][1])
            if (error is not None and not error.retryable) or attempt + 1 == o.max_attempts:
                break
            time.sleep(min(o.retry_backoff * 2 ** attempt, o.retry_backoff_max))
        logger.warning("could not delete %d of %d temporary parts of %s; `dcpstore gc` "
                       "removes them", len(left), len(names), key)

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Delete the parts of one unfinished composite upload."""
        api = self.api()
        items, _ = api.run(api.listing(self._name(f"{UPLOADS_PREFIX}{upload_id}/")))
        if items:
            api.run(api.delete_objects([name for name, _, _ in items]))

    def list_uploads(self, prefix: str) -> Iterator[tuple[str, str]]:
        """Composite uploads that left parts behind, as ``(key, upload_id)``."""
        api = self.api()
        items, _ = api.run(api.listing(self._name(UPLOADS_PREFIX)))
        found: dict[tuple[str, str], None] = {}
        for name, _, _ in items:
            segments = self._key(name)[len(UPLOADS_PREFIX):].split("/")
            key = "/".join(segments[2:])
            if len(segments) >= 3 and key.startswith(prefix):
                found[key, segments[0]] = None
        return iter(found)

    # -- errors --------------------------------------------------------------------------

    def map_error(self, exc: Exception, key: str | None) -> errors.StoreError | None:
        where = f"gs://{self.bucket}/{self._name(key)}" if key else f"gs://{self.location}"
        if isinstance(exc, GCSRequestError):
            return self._http_error(exc, where)
        if isinstance(exc, ChecksumMismatch):
            return CorruptDownloadError(str(exc))
        if isinstance(exc, asyncio.TimeoutError) or _is_fs_timeout(exc):
            return errors.StoreTimeoutError(
                f"GCS request for {where} at {self._safe_endpoint()} timed out after "
                f"{self.options.timeout:g}s ({self.options.max_attempts} attempts); raise "
                "timeout= or check the network")
        if isinstance(exc, aiohttp.ClientSSLError):
            return TLSHandshakeError(
                f"TLS handshake with GCS at {self._safe_endpoint()} failed for {where}: "
                f"{exc}. For an endpoint with a private CA, set SSL_CERT_FILE to a bundle "
                "holding it before the process starts")
        if isinstance(exc, (aiohttp.ClientConnectionError, ConnectionError)):
            return errors.StoreUnavailableError(
                f"cannot reach GCS at {self._safe_endpoint()} for {where}: {exc}. Check "
                "endpoint_url / STORAGE_EMULATOR_HOST and that the server is running")
        if isinstance(exc, aiohttp.ClientPayloadError):  # a response cut short
            return errors.StoreUnavailableError(
                f"connection to GCS at {self._safe_endpoint()} dropped during a request for "
                f"{where} ({self.options.max_attempts} attempt(s)): {exc}")
        if _is_auth_error(exc):
            return errors.AccessDeniedError(
                f"could not get Google credentials for {where}: {exc}. Set "
                "GOOGLE_APPLICATION_CREDENTIALS, run `gcloud auth application-default login`, "
                "or pass token='anon' for public buckets and emulators")
        return None

    def _http_error(self, exc: GCSRequestError, where: str) -> errors.StoreError:
        """The failure kind of an HTTP error of GCS, from its status (a 404 from whether
        the bucket is there), with its request id."""
        rid = exc.request_id or None
        failed = f"GCS {exc.method} {where} failed: HTTP {exc.status} {exc.message}"
        encryption = self._encryption_refusal(exc)
        if encryption is not None:
            return errors.AccessDeniedError(
                f"GCS refused {exc.method} {where} (HTTP {exc.status} {exc.reason} "
                f"{exc.message}): {encryption}", request_id=rid)
        if exc.status == 404:
            if self._bucket_missing():
                return errors.BucketNotFoundError(
                    f"GCS bucket {self.bucket!r} does not exist (at {self._safe_endpoint()}); "
                    "create it first or fix the URI", request_id=rid)
            return errors.ObjectNotFoundError(f"no such object {where}", request_id=rid)
        if exc.status == 401:
            return errors.AccessDeniedError(
                f"GCS rejected the credentials for {exc.method} {where}: {exc.message}. "
                "Check GOOGLE_APPLICATION_CREDENTIALS / `gcloud auth application-default "
                "login`, or pass token=...", request_id=rid)
        if exc.status == 403:
            return errors.AccessDeniedError(
                f"permission denied: {exc.method} {where}: {exc.message}", request_id=rid)
        if exc.status == 412:
            return errors.PreconditionFailedError(f"precondition failed for {where}",
                                                  request_id=rid)
        if exc.status in _THROTTLING_STATUS:
            return errors.StoreThrottledError(
                f"{failed}; throttled through {self.options.max_attempts} attempt(s): lower "
                "max_concurrency or raise max_attempts / retry_backoff_max", request_id=rid)
        if exc.status == 408:
            return errors.StoreTimeoutError(failed, request_id=rid)
        if exc.status in _SERVER_ERROR_STATUS:
            return errors.StoreUnavailableError(failed, request_id=rid)
        return errors.StoreError(failed, request_id=rid)

    def _encryption_refusal(self, exc: GCSRequestError) -> str | None:
        """What to do, when GCS refused a request for the object's encryption (``None``:
        it did not): the options to set."""
        text = f"{exc.reason} {exc.message}".lower()
        if exc.status == 400 and ("encryptionkey" in text or "encryption key" in text):
            if self.options.customer_key_configured:
                return ("the object is not encrypted with a customer-supplied key, or not "
                        f"with this one: check {CUSTOMER_KEY_OPTIONS} (unset them for "
                        "objects stored without one)")
            return ("the object is encrypted with a customer-supplied key and the request "
                    f"carried none: set {CUSTOMER_KEY_OPTIONS} to the key it was written "
                    "with")
        if exc.status == 403 and ("kms" in text or "cryptokey" in text):
            return ("GCS could not use the Cloud KMS key: check kms_key_name and that the "
                    "bucket's Cloud Storage service agent holds "
                    "roles/cloudkms.cryptoKeyEncrypterDecrypter on it")
        if exc.status == 403 and self.options.customer_key_configured:
            return ("the credentials refuse it, or the customer-supplied key "
                    f"({CUSTOMER_KEY_OPTIONS}) is not the one the object was written with")
        return None

    def _bucket_missing(self) -> bool:
        """Whether the bucket is known not to exist (asked once it is there)."""
        if self._bucket_exists:
            return False
        api = self.api()
        try:
            api.run(api.metadata(fields="name"))
        except GCSRequestError as exc:
            if exc.status == 404:
                return True
        except Exception:
            return False
        self._bucket_exists = True  # or no storage.buckets.get permission: can't tell
        return False

    def _safe_endpoint(self) -> str:
        try:
            return self.endpoint
        except Exception:
            return "<unknown endpoint>"


#: The framework's backend over :class:`GCSStore` (what ``dcpstore.open_backend``
#: returns for ``gs://``), under its former name and under the one the framework gives
#: it (``GCSStoreBackend``, in this module), where pickle looks the class up: a pickled
#: writer holds it (``Resolved.backend_cls``).
GCSBackend = GCSStoreBackend = backend_class(GCSStore)


def _is_fs_timeout(exc: BaseException) -> bool:
    try:
        from fsspec.exceptions import FSTimeoutError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, FSTimeoutError)


def _is_auth_error(exc: BaseException) -> bool:
    try:
        import google.auth.exceptions
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, google.auth.exceptions.GoogleAuthError)
