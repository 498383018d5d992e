"""S3's error codes and the one translation of botocore's exceptions to dcpstore's kinds.

:func:`to_store_error` (the store's ``map_error``) picks, once per exception, the
:mod:`dcpstore.errors` kind, which says whether the framework retries the request
(throttling, 5xx, timeouts, dropped and refused connections) and is what the caller gets
when retrying stops.
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

from dcpstore.plugin import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigurationError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PreconditionFailedError,
    StoreError,
    StoreThrottledError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from dcpstore.storage.redact import redact

from .options import CUSTOMER_KEY_OPTIONS, S3Options

__all__ = [
    "CONFIGURATION_CODES",
    "DENIED_CODES",
    "NOT_FOUND_CODES",
    "RETRYABLE_CODES",
    "RETRYABLE_STATUS",
    "THROTTLING_CODES",
    "TIMEOUT_CODES",
    "TOO_LARGE_CODES",
    "describe_cause",
    "error_info",
    "is_not_found",
    "redact_url",
    "to_store_error",
]

#: Error codes that mean "slow down": a StoreThrottledError.
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
#: Error codes of a request the server gave up waiting for: a StoreTimeoutError.
TIMEOUT_CODES = frozenset({"RequestTimeout", "RequestTimeoutException"})
#: Error codes that mean "try again" (the rest: a StoreUnavailableError).
RETRYABLE_CODES = THROTTLING_CODES | TIMEOUT_CODES | frozenset({
    "InternalError",
    "ServiceUnavailable",
    "PriorRequestNotComplete",
    # two conditional writes of one key at once: S3 asks the loser to retry (409)
    "ConditionalRequestConflict",
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

#: Objects or parts over S3's limits: an ObjectTooLargeError. (More than 10,000 parts
#: never reach S3: the framework refuses part 10,001 with the same kind.)
TOO_LARGE_CODES = frozenset({"EntityTooLarge", "MaxMessageLengthExceeded"})
#: A bucket name, region or endpoint S3 cannot serve: a ConfigurationError.
CONFIGURATION_CODES = frozenset({"InvalidBucketName", "PermanentRedirect",
                                 "AuthorizationHeaderMalformed",
                                 "IllegalLocationConstraintException"})

#: Failures of the connection itself: a StoreUnavailableError (a ConnectionError).
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


def to_store_error(exc: Exception, *, where: str, bucket: str, endpoint: str | None,
                   options: S3Options) -> StoreError | ConfigurationError | None:
    """The dcpstore failure kind for ``exc`` (``None``: not botocore's), with the S3 URL,
    the error code, the HTTP status and the request id in the message, and never a
    secret; decided from exception types, error codes and HTTP status alone.

    Args:
        exc: What a request raised.
        where: The ``s3://`` URL the request was about.
        bucket: The bucket.
        endpoint: The endpoint URL the client uses (redacted here before use).
        options: The store's options (timeouts and attempts, for the messages).
    """
    attempts = options.max_attempts
    at = redact_url(endpoint)
    if isinstance(exc, ClientError):
        return _client_error(exc, where, bucket, at, options)
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
        phase = "connect" if isinstance(exc, ConnectTimeoutError) else "read"
        limit = options.connect_timeout if phase == "connect" else options.timeout
        return StoreTimeoutError(
            f"S3 request for {where} timed out ({phase} timeout {limit:g}s, "
            f"{attempts} attempt(s)) at {at}; the store is overloaded or unreachable "
            "(raise timeout= / max_attempts= if it is slow)")
    if isinstance(exc, EndpointConnectionError):  # refused / DNS: also a restarting store
        return StoreUnavailableError(
            errno.ECONNREFUSED,
            f"cannot reach the S3 endpoint {at} for {where} ({attempts} attempt(s)): "
            f"{describe_cause(exc)}. Check endpoint_url / AWS_ENDPOINT_URL_S3 / "
            "AWS_ENDPOINT_URL and that the store is running")
    if isinstance(exc, SSLError):
        return StoreUnavailableError(  # an untrusted certificate stays so: no retries
            f"TLS handshake with {at} failed for {where}: {describe_cause(exc)}",
            retryable=False)
    if isinstance(exc, _DROPPED):
        return StoreUnavailableError(
            f"connection to {at} dropped during a request for {where} ({attempts} "
            f"attempt(s)): {type(exc).__name__}")
    if isinstance(exc, _NO_CREDENTIALS):
        return AccessDeniedError(
            f"no usable AWS credentials for {where} ({type(exc).__name__}): set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE / profile=, use an "
            "instance or container role, or pass anonymous=True for public buckets")
    if isinstance(exc, ProfileNotFound):
        return AccessDeniedError(
            f"the AWS profile {options.profile or '(from AWS_PROFILE)'!r} is not "
            "defined in the shared config/credentials files")
    if isinstance(exc, ParamValidationError):
        return ConfigurationError(f"invalid S3 request for {where}: {exc}")
    if isinstance(exc, BotoCoreError):
        kind = (StoreUnavailableError if isinstance(exc, ConnectionError) else
                StoreTimeoutError if isinstance(exc, TimeoutError) else StoreError)
        return kind(f"S3 request for {where} failed: {type(exc).__name__}: {exc}")
    return None


def _encryption_refusal(code: str, status: int | None, message: str, op: str,
                        options: S3Options) -> str | None:
    """What to do, when S3 refused a request for the object's encryption (``None``: it
    did not): the options to set."""
    lowered = message.lower()
    if code.startswith("KMS.") or (status == 403 and "kms" in lowered):
        return ("S3 could not use the object's KMS key: check sse_kms_key_id and that the "
                "identity may use that key (kms:GenerateDataKey to write, kms:Decrypt to "
                "read)")
    ssec = (status == 400 and code in ("InvalidRequest", "InvalidArgument")
            and ("encryption" in lowered or "customer" in lowered))
    # a HEAD has no error body: S3 answers a bare 400 for an SSE-C object without the key
    bare_head = op == "HeadObject" and status == 400 and code in ("400", "BadRequest")
    if ssec or bare_head:
        if options.customer_key_configured:
            return ("the object is not encrypted with a customer-provided key (SSE-C), or "
                    f"not with this one: check {CUSTOMER_KEY_OPTIONS} (unset them for "
                    "objects stored without SSE-C)")
        return ("the object is encrypted with a customer-provided key (SSE-C) and the "
                f"request carried none: set {CUSTOMER_KEY_OPTIONS} to the key it was "
                "written with")
    if status == 403 and options.customer_key_configured and op in (
            "GetObject", "HeadObject", "UploadPart", "CompleteMultipartUpload"):
        return ("the credentials or bucket policy refuse it, or the customer key "
                f"({CUSTOMER_KEY_OPTIONS}) is not the one the object was written with")
    return None


def _client_error(exc: ClientError, where: str, bucket: str, at: str,
                  options: S3Options) -> StoreError | ConfigurationError:
    code, status, request_id, message = error_info(exc)
    op = getattr(exc, "operation_name", None) or "request"
    rid = f"request id {request_id}" if request_id else "no request id"
    detail = f"{code}{': ' + message if message else ''}; HTTP {status}, {rid}"
    attempts = options.max_attempts
    failed = f"S3 {op} on {where} kept failing after {attempts} attempt(s) ({detail})"
    kind: type[StoreError]
    encryption = _encryption_refusal(code, status, message, op, options)
    if encryption is not None:
        return AccessDeniedError(f"S3 refused {op} on {where} ({detail}): {encryption}",
                                 request_id=request_id)
    if code == "NoSuchBucket":
        text = (f"S3 bucket {bucket!r} does not exist at {at} ({op}: {detail}); create it "
                "or fix the URI")
        kind = BucketNotFoundError
    elif code in NOT_FOUND_CODES or (status == 404 and code != "NoSuchUpload"):
        text, kind = f"no such object {where} ({op}: {detail})", ObjectNotFoundError
    elif code in DENIED_CODES or status == 403:
        text = (f"S3 denied {op} on {where} ({detail}); check the credentials and the "
                "bucket policy")
        kind = AccessDeniedError
    elif code in CONFIGURATION_CODES:
        return ConfigurationError(f"S3 refused {op} on {where} ({detail}): check the URI's "
                                  "bucket, region, endpoint_url and addressing_style")
    elif code in TOO_LARGE_CODES:
        text = (f"S3 {op} on {where}: the object or part is larger than S3 accepts "
                f"({detail}); raise part_size or save more, smaller files")
        kind = ObjectTooLargeError
    elif code == "PreconditionFailed" or status == 412:
        text, kind = f"S3 {op} on {where}: precondition failed ({detail})", \
            PreconditionFailedError
    elif code in THROTTLING_CODES or status == 429:
        text, kind = failed, StoreThrottledError
    elif code in TIMEOUT_CODES:
        text, kind = failed, StoreTimeoutError
    elif code in RETRYABLE_CODES or status in RETRYABLE_STATUS:
        text, kind = failed, StoreUnavailableError
    elif code == "InvalidRange":
        text, kind = f"{where}: requested range is past the end ({detail})", StoreError
    else:
        text, kind = f"S3 {op} on {where} failed ({detail})", StoreError
    return kind(text, request_id=request_id)
