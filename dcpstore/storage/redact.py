"""Keeping credentials out of log records and messages.

The HTTP clients under dcpstore's backends log every request at DEBUG: botocore prints
its headers (``Authorization: ... Credential=<access key id>/...``,
``X-Amz-Security-Token: <session token>``) and the canonical request it signs, and an
endpoint URL may carry ``user:password@``. :func:`install_log_redaction` attaches a
filter to those loggers that blanks such values out of every record before any handler
sees it; :func:`redact` does the same to a string (for error messages that quote a
client's own message).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable

__all__ = ["CLIENT_LOGGERS", "RedactingFilter", "install_log_redaction", "redact"]

#: Loggers of the HTTP/storage clients dcpstore drives that print requests or endpoints.
CLIENT_LOGGERS = (
    "botocore.endpoint", "botocore.auth", "botocore.parsers", "botocore.hooks",
    "botocore.handlers", "botocore.httpsession", "botocore.awsrequest", "botocore.regions",
    "botocore.client", "botocore.utils", "botocore.retryhandler", "botocore.httpchecksum",
    "botocore.credentials", "urllib3.connectionpool",
)

_PATTERNS = (
    # X-Amz-Security-Token: <token> (request headers, canonical requests)
    (re.compile(r"(?i)(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s&,}]+"),
     r"\1***"),
    # Authorization: AWS4-HMAC-SHA256 Credential=<access key id>/<scope>
    (re.compile(r"(Credential=)[^/\s'\",]+"), r"\1***"),
    # Authorization: Bearer <token>
    (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1***"),
    # scheme://user:password@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@"), r"\1***@"),
)
_SENTINELS = ("security-token", "credential=", "bearer", "@")  # lower case

_lock = threading.Lock()
_installed: set[str] = set()


def redact(text: str) -> str:
    """``text`` with session tokens, access key ids, bearer tokens and URL user info
    replaced by ``***``."""
    lowered = text.lower()
    if not any(s in lowered for s in _SENTINELS):
        return text
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactingFilter(logging.Filter):
    """A logging filter that :func:`redact`-s every record it passes (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg = cleaned
            record.args = ()
        return True


def install_log_redaction(names: Iterable[str] = CLIENT_LOGGERS) -> None:
    """Attach one :class:`RedactingFilter` to each logger in ``names`` (once each).

    Filters act on records logged to that very logger, so the names are the client
    modules that log requests, not their parents.
    """
    with _lock:
        for name in names:
            if name not in _installed:
                logging.getLogger(name).addFilter(RedactingFilter())
                _installed.add(name)
