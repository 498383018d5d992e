"""Retries and the one error classification of every backend request.

Every request a :class:`~dcpstore.storage.backend.Backend` makes goes through
:func:`call_with_retries` (by way of ``Backend._call``), and every exception it raises is
classified *once* by :func:`classify_failure` (by way of ``Backend._failure``): a
:class:`~dcpstore.DcpstoreError` passes unchanged and is never retried; an ``EOFError``
(a short object) becomes an ``OSError`` (``EIO``); anything else goes to the backend's
classifier (``Backend._classify``), and where that returns ``None``,
``ConnectionError`` / ``TimeoutError`` are retryable and everything else is raised
unchanged. The same :class:`~dcpstore.storage.types.Failure` decides whether tenacity
retries (exponential backoff, full jitter, ``max_attempts``) and, once it stops, what
the caller sees.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from dcpstore.errors import DcpstoreError, StoreThrottledError
from dcpstore.storage.concurrency import ConcurrencyLimit
from dcpstore.storage.types import BackendOptions, Failure

__all__ = ["Classifier", "call_with_retries", "classify_failure"]

#: Retries are logged under the Backend's logger, where they always were.
logger = logging.getLogger("dcpstore.storage.backend")

T = TypeVar("T")

#: A backend's own classification of its client's exceptions (``Backend._classify``):
#: ``(exc, key) -> Failure``, or ``None`` for the default.
Classifier = Callable[[Exception, str | None], Failure | None]


def classify_failure(exc: Exception, key: str | None, classify: Classifier) -> Failure:
    """Classify ``exc``, raised by a request about ``key``, once (see the module docstring).

    Args:
        exc: What the request raised.
        key: The key the request was about, if any (named in an ``EOFError``'s message).
        classify: The backend's classifier, asked about anything that is neither a
            dcpstore error nor an ``EOFError``.

    Returns:
        What to raise and whether to retry.
    """
    if isinstance(exc, DcpstoreError):
        return Failure(exc)
    if isinstance(exc, EOFError):
        message = str(exc) or "the object ends before the requested range"
        if key is not None and key not in message:
            message = f"{key}: {message}"
        return Failure(OSError(errno.EIO, message))
    failure = classify(exc, key)
    if failure is not None:
        return failure
    return Failure(exc, retryable=isinstance(exc, (ConnectionError, TimeoutError)))


def call_with_retries(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    options: BackendOptions,
    uri: str,
    failure: Callable[[Exception], Failure],
    concurrency: ConcurrencyLimit | None = None,
) -> T:
    """Run ``fn(*args, **kwargs)`` with retries, then raise what its classification says.

    Args:
        fn: The request.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        options: The backend's options (``max_attempts``, ``retry_backoff``,
            ``retry_backoff_max``).
        uri: The backend's URI, for the retry warnings.
        failure: Classifies one exception of ``fn`` (each is classified once, for the
            retry decision and for what is raised).
        concurrency: The limit whose slot the request holds; every attempt the store
            throttled (a :class:`~dcpstore.errors.StoreThrottledError` by the
            classification) is reported to it.

    Returns:
        What ``fn`` returned on the attempt that succeeded.
    """
    last: dict[str, tuple[BaseException, Failure]] = {}  # the retry predicate's

    def failure_of(exc: BaseException) -> Failure:
        seen = last.get("exc")
        if seen is not None and seen[0] is exc:
            return seen[1]
        found = failure(exc) if isinstance(exc, Exception) else Failure(exc)
        last["exc"] = (exc, found)
        if concurrency is not None and isinstance(found.error, StoreThrottledError):
            concurrency.throttled()
        return found

    def log_retry(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        logger.warning(
            "%s: attempt %d/%d failed (%s); retrying", uri, state.attempt_number,
            options.max_attempts, _describe(exc),
        )

    retrying = Retrying(
        stop=stop_after_attempt(options.max_attempts),
        wait=wait_random_exponential(multiplier=options.retry_backoff,
                                     max=options.retry_backoff_max),
        retry=retry_if_exception(lambda exc: failure_of(exc).retryable),
        before_sleep=log_retry,
        reraise=True,
    )
    try:
        return retrying(fn, *args, **kwargs)
    except Exception as exc:
        error = failure_of(exc).error
        if error is exc:
            raise
        raise error from exc


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
