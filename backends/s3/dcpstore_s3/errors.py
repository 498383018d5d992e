"""S3's error codes and the one classification of botocore's exceptions.

:func:`classify` decides, once per exception, both whether a request is retried
(throttling, 5xx, timeouts, dropped and refused connections) and what the caller gets
when retrying stops: Python's own exceptions or dcpstore's, with the S3 URL, the error
code, the HTTP status and the request id in the message, and never a secret.
"""

from __future__ import annotations

import errno
from typing import Any
from urllib.parse import urlsplit

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
)

from dcpstore.errors import BucketNotFoundError, StoreThrottledError, StoreTimeoutError
from dcpstore.storage.backend import Failure
from dcpstore.storage.redact import redact

from .options import S3Options

__all__ = [
    "DENIED_CODES",
    "NOT_FOUND_CODES",
    "RETRYABLE_CODES",
    "RETRYABLE_STATUS",
    "THROTTLING_CODES",
    "classify",
    "describe_cause",
    "error_info",
    "is_not_found",
    "redact_url",
]

#: Error codes that mean "slow down": after the last attempt, a StoreThrottledError.
THROTTLING_CODES = frozenset({
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "ProvisionedThroughputExceededException",
    "EC2ThrottledException",
})
#: Error codes that mean "try again".
RETRYABLE_CODES = THROTTLING_CODES | frozenset({
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeoutException",
    "PriorRequestNotComplete",
})
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
DENIED_CODES = frozenset({
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidSecurity",
    "RequestTimeTooSkewed",
})

#: Failures of the connection itself: retried, then a ConnectionError.
_DROPPED = (ConnectionClosedError, ResponseStreamingError, IncompleteReadError, HTTPClientError)
_NO_CREDENTIALS = (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)


def error_info(exc: ClientError) -> tuple[str, int | None, str | None, str]:
    """``(code, http_status, request_id, message)`` of a botocore ``ClientError``."""
    response: dict[str, Any] = getattr(exc, "response", None) or {}
    error = response.get("Error") or {}
    meta = response.get("ResponseMetadata") or {}
    status = meta.get("HTTPStatusCode")
    code = str(error.get("Code") or status or "Unknown")
    request_id = meta.get("RequestId") or (meta.get("HTTPHeaders") or {}).get("x-amz-request-id")
    message = str(error.get("Message") or "").strip()
    return code, status if isinstance(status, int) else None, request_id, message


def is_not_found(exc: ClientError) -> bool:
    """Whether ``exc`` says the *object* is missing (not the bucket, not an upload)."""
    code, status, _, _ = error_info(exc)
    return code in NOT_FOUND_CODES or (status == 404 and code not in ("NoSuchBucket",
                                                                       "NoSuchUpload"))


def redact_url(url: str | None) -> str:
    """An endpoint URL fit for messages: scheme, host and port only."""
    if not url:
        return "the default AWS endpoint"
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


def describe_cause(exc: BaseException) -> str:
    """The innermost reason of a botocore connection error, without URLs' userinfo."""
    error = getattr(exc, "kwargs", {}).get("error")
    reason = error if error is not None else exc
    text = redact(str(reason))
    return text.split(": ", 1)[-1] if "Connection" in text else text


def classify(exc: Exception, *, where: str, bucket: str, endpoint: str | None,
             options: S3Options) -> Failure | None:
    """Whether ``exc`` is retried and what is raised in the end (``None``: not botocore's;
    the base class's default applies).

    Args:
        exc: What a request raised.
        where: The ``s3://`` URL the request was about.
        bucket: The bucket.
        endpoint: The endpoint URL the client uses (redacted here before use).
        options: The backend's options (timeouts and attempts, for the messages).
    """
    attempts = options.max_attempts
    at = redact_url(endpoint)
    if isinstance(exc, ClientError):
        return _classify_client_error(exc, where, bucket, at, attempts)
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
        phase = "connect" if isinstance(exc, ConnectTimeoutError) else "read"
        limit = options.connect_timeout if phase == "connect" else options.timeout
        return Failure(StoreTimeoutError(
            f"S3 request for {where} timed out ({phase} timeout {limit:g}s, "
            f"{attempts} attempt(s)) at {at}; the store is overloaded or unreachable "
            "(raise timeout= / max_attempts= if it is slow)"
        ), retryable=True)
    if isinstance(exc, EndpointConnectionError):  # refused / DNS: also a restarting store
        return Failure(ConnectionError(
            errno.ECONNREFUSED,
            f"cannot reach the S3 endpoint {at} for {where} ({attempts} attempt(s)): "
            f"{describe_cause(exc)}. Check endpoint_url / AWS_ENDPOINT_URL_S3 / "
            "AWS_ENDPOINT_URL and that the store is running",
        ), retryable=True)
    if isinstance(exc, SSLError):
        return Failure(ConnectionError(
            f"TLS handshake with {at} failed for {where}: {describe_cause(exc)}"
        ))
    if isinstance(exc, _DROPPED):
        return Failure(ConnectionError(
            f"connection to {at} dropped during a request for {where} ({attempts} "
            f"attempt(s)): {type(exc).__name__}"
        ), retryable=True)
    if isinstance(exc, _NO_CREDENTIALS):
        return Failure(PermissionError(
            errno.EACCES,
            f"no usable AWS credentials for {where} ({type(exc).__name__}): set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE / profile=, use an "
            "instance or container role, or pass anonymous=True for public buckets",
        ))
    if isinstance(exc, ProfileNotFound):
        return Failure(PermissionError(
            errno.EACCES,
            f"the AWS profile {options.profile or '(from AWS_PROFILE)'!r} is not "
            "defined in the shared config/credentials files",
        ))
    if isinstance(exc, ParamValidationError):
        return Failure(ValueError(f"invalid S3 request for {where}: {exc}"))
    if isinstance(exc, BotoCoreError):
        return Failure(OSError(f"S3 request for {where} failed: {type(exc).__name__}: {exc}"),
                       retryable=isinstance(exc, (ConnectionError, TimeoutError)))
    return None


def _classify_client_error(exc: ClientError, where: str, bucket: str, at: str,
                           attempts: int) -> Failure:
    code, status, request_id, message = error_info(exc)
    retryable = code in RETRYABLE_CODES or status in RETRYABLE_STATUS
    op = getattr(exc, "operation_name", None) or "request"
    rid = f"request id {request_id}" if request_id else "no request id"
    detail = f"{code}{': ' + message if message else ''}; HTTP {status}, {rid}"
    error: OSError
    if code == "NoSuchBucket":
        error = BucketNotFoundError(
            errno.ENOENT,
            f"S3 bucket {bucket!r} does not exist at {at} ({op}: {detail}); create it or "
            "fix the URI",
        )
    elif code in NOT_FOUND_CODES or (status == 404 and code != "NoSuchUpload"):
        error = FileNotFoundError(errno.ENOENT, f"no such object {where} ({op}: {detail})")
    elif code in DENIED_CODES or status == 403:
        error = PermissionError(
            errno.EACCES,
            f"S3 denied {op} on {where} ({detail}); check the credentials and the bucket "
            "policy",
        )
    elif code == "InvalidRange":
        error = OSError(errno.EIO, f"{where}: requested range is past the end ({detail})")
    elif retryable:
        kind = StoreThrottledError if code in THROTTLING_CODES or status == 429 else OSError
        error = kind(
            errno.EAGAIN,
            f"S3 {op} on {where} kept failing after {attempts} attempt(s) ({detail})",
        )
    else:
        error = OSError(f"S3 {op} on {where} failed ({detail})")
    return Failure(error, retryable=retryable)
