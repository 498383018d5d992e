"""What the providers behind MSC say about a failure: HTTP status, request id, transport.

MSC raises its own exception types (``FileNotFoundError``, ``PermissionError``,
``PreconditionFailedError``, ``RetryableError``, ``RuntimeError``) and chains the
provider client's error to them (``__cause__`` / ``__context__``). These helpers read
the structured fields of the provider errors in that chain (botocore, MSC's Rust client,
google-api-core, Azure, urllib3, requests), never their messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import lru_cache
from typing import Any

__all__ = ["http_status", "request_id", "transport_failure"]

_Reader = tuple[type[BaseException], Callable[[Any], Any]]


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the provider errors MSC chained to it (``__cause__``/``__context__``)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 10:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _first(exc: BaseException, readers: tuple[_Reader, ...]) -> Any:
    for e in _chain(exc):
        for kind, read in readers:
            if isinstance(e, kind):
                with contextlib.suppress(Exception):
                    value = read(e)
                    if value:
                        return value
    return None


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of the provider error behind ``exc``, read from the provider
    client's own exception types."""
    value = _first(exc, _status_readers())
    return value if isinstance(value, int) else None


def request_id(exc: BaseException) -> str | None:
    """The store's id of the failed request, where the provider error behind ``exc``
    carries one (S3 ``x-amz-request-id``, Azure ``x-ms-request-id``)."""
    value = _first(exc, _request_id_readers())
    return value if isinstance(value, str) else None


@lru_cache(maxsize=1)
def _status_readers() -> tuple[_Reader, ...]:
    readers: list[_Reader] = []
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


@lru_cache(maxsize=1)
def _request_id_readers() -> tuple[_Reader, ...]:
    readers: list[_Reader] = []
    with contextlib.suppress(ImportError):
        from botocore.exceptions import ClientError

        def s3_id(e: Any) -> Any:
            meta = e.response.get("ResponseMetadata", {})
            return meta.get("RequestId") or meta.get("HTTPHeaders", {}).get(
                "x-amz-request-id")

        readers.append((ClientError, s3_id))
    with contextlib.suppress(ImportError):
        from azure.core.exceptions import HttpResponseError

        readers.append((HttpResponseError,
                        lambda e: e.response.headers.get("x-ms-request-id")))
    return tuple(readers)


def transport_failure(exc: BaseException) -> str | None:
    """``"timeout"`` or ``"connection"`` when a request behind ``exc`` timed out or could
    not connect (the outermost such error in the chain decides), else ``None``."""
    connection = _connection_types()
    for e in _chain(exc):
        if isinstance(e, connection[:1]):
            return "connection"  # urllib3's NewConnectionError is also a ConnectTimeoutError
        if isinstance(e, _timeout_types()):
            return "timeout"
        if isinstance(e, connection):
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
