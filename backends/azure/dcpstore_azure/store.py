"""Azure Blob Storage for dcpstore: ``az://container/prefix``, on azure-storage-blob 12.x.

A plugin of the public contract (:mod:`dcpstore.plugin`) and nothing else:

- multipart uploads are staged blocks: ``upload_part`` is one Put Block, whose block id
  is derived from the upload id and the part number (equal length for every block of a
  blob; the SDK base64-encodes it), ``complete_upload`` one Put Block List. Uncommitted
  blocks need no abort: Azure discards them at the blob's next commit or after 7 days;
- ``read`` is one ranged Get Blob read straight into the caller's buffers (never the
  SDK's downloader, which retries by itself: see :func:`_get`);
- ``put`` is one Put Blob (``overwrite=True``), ``head`` Get Blob Properties, ``list``
  List Blobs (``walk_blobs(delimiter="/")`` for one level), ``delete`` a blob batch.

Credentials come from the environment only, never from options, and are never printed:
``AZURE_STORAGE_CONNECTION_STRING``, else ``AZURE_STORAGE_ACCOUNT`` +
``AZURE_STORAGE_KEY``, else ``DefaultAzureCredential`` (when azure-identity is
installed), else anonymous (public containers). The SDK's own retries are off: the
framework retries what :meth:`AzureBlobStore.map_error` says is retryable.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import requests.exceptions
import urllib3.exceptions
from azure.core import MatchConditions
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    DecodeError,
    HttpResponseError,
    IncompleteReadError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceRequestTimeoutError,
    ServiceResponseError,
    ServiceResponseTimeoutError,
)
from azure.storage.blob import BlobBlock, BlobPrefix, BlobServiceClient, ContainerClient

from dcpstore import errors
from dcpstore.plugin import MultipartStore, ObjectInfo, StoreLimits, StoreOptions, http_body

__all__ = ["AzureBlobStore", "AzureOptions"]

MiB = 1024 * 1024
MAX_PUT, MAX_BLOCK = 5000 * MiB, 4000 * MiB  # Put Blob / Put Block (API 2019-12-12+)
CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_ENV, KEY_ENV = "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY"


@dataclass
class AzureOptions(StoreOptions):
    """Options of ``az://`` stores (also ``DCPSTORE_AZ_<OPTION>`` and the URI query).

    Attributes:
        account_url: The account's blob endpoint, ``https://<account>.blob.core.windows.net``
            (default: the connection string's, else from ``AZURE_STORAGE_ACCOUNT``).
        endpoint_url: Same as ``account_url``, and wins over it (an emulator such as
            ``http://127.0.0.1:10000/devstoreaccount1``, or a proxy).
    """

    account_url: str | None = None
    endpoint_url: str | None = None

    def validate(self) -> None:
        super().validate()
        for url in (self.account_url, self.endpoint_url):
            if url is not None and not url.startswith(("https://", "http://")):
                raise ValueError(f"account_url / endpoint_url must be an http(s):// URL, "
                                 f"got {url!r}")


# -- the error table: (status, x-ms-error-code) -> kind; decided from codes, not text -------

_BY_CODE: dict[str, type[errors.StoreError]] = {
    "BlobNotFound": errors.ObjectNotFoundError,
    "ContainerNotFound": errors.BucketNotFoundError,
    "ContainerBeingDeleted": errors.BucketNotFoundError,
    "AuthenticationFailed": errors.AccessDeniedError,
    "AuthorizationFailure": errors.AccessDeniedError,
    "AuthorizationPermissionMismatch": errors.AccessDeniedError,
    "InsufficientAccountPermissions": errors.AccessDeniedError,
    "ServerBusy": errors.StoreThrottledError,
    "OperationTimedOut": errors.StoreTimeoutError,
    "RequestBodyTooLarge": errors.ObjectTooLargeError,
    "BlockCountExceedsLimit": errors.ObjectTooLargeError,
    "BlockListTooLong": errors.ObjectTooLargeError,
    "ConditionNotMet": errors.PreconditionFailedError,
    "BlobAlreadyExists": errors.PreconditionFailedError,  # a Put Blob with If-None-Match: *
}
_BY_STATUS: dict[int, type[errors.StoreError]] = {
    401: errors.AccessDeniedError, 403: errors.AccessDeniedError,
    408: errors.StoreTimeoutError, 412: errors.PreconditionFailedError,
    413: errors.ObjectTooLargeError, 429: errors.StoreThrottledError,
    503: errors.StoreThrottledError, 504: errors.StoreTimeoutError,
}
_TIMEOUTS = (ServiceRequestTimeoutError, ServiceResponseTimeoutError,
             urllib3.exceptions.TimeoutError, requests.exceptions.Timeout)
_BROKEN = (ServiceRequestError, ServiceResponseError, DecodeError,  # IncompleteReadError too
           http.client.HTTPException, urllib3.exceptions.ProtocolError,
           requests.exceptions.ConnectionError,
           requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError)
_ADVICE: dict[type[errors.StoreError], str] = {
    errors.ObjectNotFoundError: "there is no such blob",
    errors.BucketNotFoundError: "the container does not exist: create it or fix the URI",
    errors.AccessDeniedError: (
        "the credentials were refused: check AZURE_STORAGE_CONNECTION_STRING "
        "or AZURE_STORAGE_ACCOUNT/AZURE_STORAGE_KEY and the role assignment"),
    errors.StoreThrottledError: "Azure is throttling (ServerBusy): lower max_concurrency",
    errors.StoreTimeoutError: "the request timed out: raise timeout or check the network",
    errors.StoreUnavailableError: "Azure Blob Storage is unavailable or unreachable",
    errors.ObjectTooLargeError: "the request is over Azure's size limit: lower part_size",
    errors.PreconditionFailedError: (
        "the blob exists already or changed since it was read (a conditional write "
        "lost to another writer)"),
}


class AzureBlobStore(MultipartStore):
    """``az://container/prefix``: a container and an optional prefix in it."""

    name = "az"
    schemes = ("az",)
    Options = AzureOptions
    limits = StoreLimits(max_put_size=MAX_PUT, max_parts=50_000, max_part_size=MAX_BLOCK)
    conditional_writes = True

    def __init__(self, location: str, options: StoreOptions | None = None) -> None:
        super().__init__(location, options)
        self.container, _, prefix = location.strip("/").partition("/")
        if not self.container:
            raise errors.ConfigurationError(f"az://{location}: no container; use az://container/prefix")
        self.root = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._key: Hashable | None = None

    # -- client --------------------------------------------------------------------------

    def _settings(self) -> tuple[str, str, Callable[[], Any]]:
        """(account URL, credential source, a function making the credential), from the
        options and the environment (the credential is made by :meth:`connect` only)."""
        opts: AzureOptions = self.options  # type: ignore[assignment]
        url = opts.endpoint_url or opts.account_url
        conn = os.environ.get(CONNECTION_STRING_ENV)
        if conn:
            fields = dict(part.split("=", 1) for part in conn.split(";") if "=" in part)
            fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
            name = fields.get("accountname", "")
            if not url:
                url = fields.get("blobendpoint") or (
                    f"{fields.get('defaultendpointsprotocol', 'https')}://{name}.blob."
                    f"{fields.get('endpointsuffix', 'core.windows.net')}")
            if fields.get("accountkey"):
                key = fields["accountkey"]
                return url, "connection string", lambda: AzureNamedKeyCredential(name, key)
            if fields.get("sharedaccesssignature"):
                sas = fields["sharedaccesssignature"]
                return url, "connection string", lambda: AzureSasCredential(sas)
            raise errors.ConfigurationError(f"{CONNECTION_STRING_ENV} holds neither AccountKey nor "
                                            "SharedAccessSignature")
        account = os.environ.get(ACCOUNT_ENV)
        url = url or (f"https://{account}.blob.core.windows.net" if account else None)
        if not url:
            raise errors.ConfigurationError(
                f"{self.uri}: no Azure account: set {CONNECTION_STRING_ENV}, or {ACCOUNT_ENV} "
                f"(+ {KEY_ENV}), or the account_url option")
        if account and os.environ.get(KEY_ENV):
            key = os.environ[KEY_ENV]
            return url, "account key", lambda: AzureNamedKeyCredential(account, key)
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            return url, "anonymous", lambda: None
        return url, "DefaultAzureCredential", DefaultAzureCredential

    def connect(self) -> ContainerClient:
        url, _, make_credential = self._settings()
        opts: AzureOptions = self.options  # type: ignore[assignment]
        service = BlobServiceClient(
            url, credential=make_credential(), retry_total=0,  # the framework retries
            connection_timeout=opts.timeout, read_timeout=opts.timeout,
            max_single_put_size=MAX_PUT, max_block_size=MAX_BLOCK)
        return service.get_container_client(self.container)

    def client_key(self) -> Hashable:
        """Endpoint, timeouts and the credential source, with a digest of the credential
        environment (so a changed key makes a new client); never a secret itself."""
        if self._key is None:
            opts: AzureOptions = self.options  # type: ignore[assignment]
            url, source, _ = self._settings()
            env = "\0".join(os.environ.get(n, "") for n in (CONNECTION_STRING_ENV, ACCOUNT_ENV,
                                                            KEY_ENV))
            digest = hashlib.sha256(env.encode()).hexdigest()[:16]
            self._key = (url, self.container, source, digest, opts.timeout)
        return self._key

    def _blob(self, key: str) -> Any:
        return self.client.get_blob_client(self.root + key)

    # -- the contract --------------------------------------------------------------------

    def read(self, key: str, offset: int = 0,
             buffers: Sequence[memoryview] | None = None) -> bytes | None:
        # one Get Blob, never the SDK's downloader (it retries on its own: see _get)
        need = sum(b.nbytes for b in buffers) if buffers is not None else None
        if need == 0:
            return None
        ranged = f"bytes={offset}-{offset + need - 1}" if need else (
            f"bytes={offset}-" if offset else None)
        try:
            response = _get(self._blob(key), ranged)
        except HttpResponseError as exc:
            if exc.status_code == 416:  # the range starts past the end
                raise EOFError(f"{key}: no bytes at offset {offset}") from None
            raise
        filled, complete = 0, False
        try:
            if buffers is None or need is None:
                data = _read_all(response)
                complete = True
                return data
            for buf in buffers:  # each buffer filled straight from the socket
                out = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
                done = 0
                while done < len(out):
                    n = _readinto(response, out[done:])
                    if not n:
                        raise EOFError(f"{key}: {filled + done} of {need} bytes from "
                                       f"offset {offset}")
                    done += n
                filled += done
            complete = True
            return None
        finally:
            if not complete:  # an error or a short object: drop the connection
                with contextlib.suppress(Exception):
                    response.close()

    def put(self, key: str, data: memoryview, *, if_absent: bool = False,
            if_match: str | None = None) -> None:
        # the SDK's single Put Blob takes bytes only (its Put Block takes the view as is)
        conditions: dict[str, Any] = {}
        if if_match is not None:
            conditions = {"etag": if_match, "match_condition": MatchConditions.IfNotModified}
        # overwrite=False sends If-None-Match: * (409 BlobAlreadyExists where one is)
        self._blob(key).upload_blob(data.tobytes(), length=len(data),
                                    overwrite=not if_absent, max_concurrency=1, **conditions)

    def head(self, key: str) -> ObjectInfo:
        props = self._blob(key).get_blob_properties()
        mtime = props.last_modified.timestamp() if props.last_modified else None
        return ObjectInfo(key, int(props.size), mtime, props.etag)

    def list(self, prefix: str, *, start_after: str = "",
             delimiter: str | None = None) -> Iterable[ObjectInfo | str]:
        full = self.root + prefix
        cut = len(self.root)
        if delimiter is None:
            items: Iterable[Any] = self.client.list_blobs(name_starts_with=full)
        else:
            items = self.client.walk_blobs(name_starts_with=full, delimiter=delimiter)
        for item in items:
            if isinstance(item, BlobPrefix):
                yield item.name[len(full):].rstrip(delimiter or "/")
            else:
                mtime = item.last_modified.timestamp() if item.last_modified else None
                yield ObjectInfo(item.name[cut:], int(item.size), mtime)

    def delete(self, keys: Sequence[str]) -> None:
        failed: list[str] = []
        for start in range(0, len(keys), 256):  # a batch holds at most 256 requests
            chunk = list(keys[start:start + 256])
            try:
                answers = self.client.delete_blobs(*(self.root + k for k in chunk),
                                                   raise_on_any_failure=False)
                failed += [k for k, r in zip(chunk, answers, strict=False)
                           if r.status_code not in (200, 202, 404)]
            except HttpResponseError as exc:  # no batch support (or the batch refused)
                if exc.status_code in (401, 403):
                    raise
                failed += chunk
        for key in failed:  # one by one: a real failure raises its own error
            with contextlib.suppress(ResourceNotFoundError):
                self._blob(key).delete_blob()

    def upload_part(self, key: str, upload_id: str, number: int, data: memoryview) -> str:
        block_id = _block_id(upload_id, number)
        self._blob(key).stage_block(block_id, data, length=len(data))
        return block_id

    def complete_upload(self, key: str, upload_id: str,
                        parts: Sequence[tuple[int, str]]) -> None:
        # "latest" blocks: a retried commit finds them committed and stores the same blob
        self._blob(key).commit_block_list([BlobBlock(block_id=tag) for _, tag in parts])

    # -- errors --------------------------------------------------------------------------

    def map_error(self, exc: Exception, key: str | None) -> errors.StoreError | None:
        what = f"{self.uri}/{key}" if key else self.uri
        if not isinstance(exc, AzureError):  # urllib3 / requests / http.client, bare
            kind = _broken(exc)
            return kind(f"{what}: {_ADVICE[kind]} ({type(exc).__name__})") if kind else None
        response = getattr(exc, "response", None)
        request_id = response.headers.get("x-ms-request-id") if response is not None else None
        status = getattr(exc, "status_code", None)
        code = getattr(exc, "error_code", None)  # a StorageErrorCode (a str enum) or str
        if code is None and response is not None:
            code = response.headers.get("x-ms-error-code")
        code = getattr(code, "value", code)
        if isinstance(exc, ClientAuthenticationError) and status is None:
            # no answer from the store: the credential itself could not get a token
            advice = _ADVICE[errors.AccessDeniedError]
            return errors.AccessDeniedError(f"{what}: no usable Azure credential "
                                            f"({type(exc).__name__}); {advice}")
        # a timeout, a refused / reset connection or a body cut short: retried
        kind = _BY_CODE.get(str(code)) or _BY_STATUS.get(status or 0) or _broken(exc)
        if kind is None and isinstance(exc, ResourceNotFoundError):
            kind = errors.ObjectNotFoundError if key else errors.BucketNotFoundError
        elif kind is None and isinstance(exc, ClientAuthenticationError):
            kind = errors.AccessDeniedError
        elif kind is None and isinstance(exc, ResourceModifiedError):
            kind = errors.PreconditionFailedError
        elif kind is None and status is not None and status >= 500:
            kind = errors.StoreUnavailableError
        if kind is None:
            return None
        if kind is errors.BucketNotFoundError:
            what = f"az://{self.container}"
        detail = ", ".join(str(x) for x in (status, code) if x) or type(exc).__name__
        return kind(f"{what}: {_ADVICE[kind]} ({detail})", request_id=request_id)


def _broken(exc: BaseException) -> type[errors.StoreError] | None:
    """``StoreTimeoutError`` / ``StoreUnavailableError`` when ``exc``, or an error it wraps
    (``inner_exception``, ``__cause__``: the SDK's status-less ``HttpResponseError(error,
    error=error)``), is a timeout / a broken connection or body; by type, never text."""
    for _ in range(8):  # a chain: HttpResponseError > IncompleteReadError > urllib3 > ...
        if isinstance(exc, _TIMEOUTS):
            return errors.StoreTimeoutError
        if isinstance(exc, _BROKEN):
            return errors.StoreUnavailableError
        cause = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(cause, BaseException):
            return None
        exc = cause
    return None


def _block_id(upload_id: str, number: int) -> str:
    """Block ``number`` of upload ``upload_id``: 30 characters for every block (Azure
    wants one length per blob); the SDK sends it base64-encoded."""
    return hashlib.sha256(upload_id.encode()).hexdigest()[:24] + f"{number:06d}"


# -- one Get Blob per read ---------------------------------------------------------------
# download_blob's StorageStreamDownloader retries a broken body 3 times (1 s sleeps) on its
# own, whatever retry_total says; the framework must be the only retry layer. So a read
# calls, once, the generated operation that downloader calls (the SDK's pipeline signs it
# and maps its statuses) and reads the body through dcpstore.plugin.http_body (straight
# into the buffers). tests/test_backend_azure.py checks these internals against the pin.


def _get(blob: Any, range_header: str | None) -> Any:
    """One Get Blob (``bytes=a-b``, ``bytes=a-`` or all): the response, body unread."""
    return blob._client.blob.download(range=range_header,
                                      cls=lambda response, *_: response).http_response


@contextlib.contextmanager
def _body_errors() -> Iterator[None]:
    """A timeout or a cut connection while reading a body, as the SDK's errors."""
    try:
        yield
    except (TimeoutError, urllib3.exceptions.ReadTimeoutError) as exc:
        raise ServiceResponseTimeoutError(f"reading the body timed out: {exc!r}",
                                          error=exc) from exc
    except (http.client.HTTPException, OSError, urllib3.exceptions.HTTPError) as exc:
        raise IncompleteReadError(f"the body was cut short: {exc!r}", error=exc) from exc


def _readinto(response: Any, out: memoryview) -> int:
    raw = response.internal_response.raw
    with _body_errors():
        n = http_body.readinto(raw, out)
        return int(raw.readinto(out)) if n is None else n


def _read_all(response: Any) -> bytes:
    raw = response.internal_response.raw
    with _body_errors():
        data = http_body.read_all(raw)
        return bytes(raw.read()) if data is None else data
