"""The environment a test or benchmark process starts with: none of the developer's
cloud or dcpstore variables, and no real AWS configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ISOLATION_ENV",
    "KEPT",
    "SCRUBBED_PREFIXES",
    "isolate_env",
    "scrubbed_environ",
]

#: Prefixes of variables that configure clouds or dcpstore; a test or benchmark process
#: starts with none of the developer's.
SCRUBBED_PREFIXES = ("AWS_", "DCPSTORE_", "MSC_")
#: Harness switches that survive the scrub (they configure the tests, not a backend).
KEPT = ("DCPSTORE_TEST_FULL", "DCPSTORE_CRASH_REPORT")
#: Set after a scrub: no instance metadata lookups, no real AWS config files.
ISOLATION_ENV = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def scrubbed_environ(environ: Mapping[str, str] | None = None,
                     extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) without any ``AWS_*``, ``DCPSTORE_*`` or
    ``MSC_*`` variable (harness switches kept), plus :data:`ISOLATION_ENV` and ``extra``.
    """
    source = os.environ if environ is None else environ
    out = {k: v for k, v in source.items()
           if not k.startswith(SCRUBBED_PREFIXES) or k in KEPT}
    out.update(ISOLATION_ENV)
    out.update(extra or {})
    return out


def isolate_env(monkeypatch: Any, extra: Mapping[str, str] | None = None) -> None:
    """Apply :func:`scrubbed_environ` to ``os.environ`` through ``monkeypatch`` (a
    ``pytest.MonkeyPatch``), so it is undone after the test; ``extra`` is set on top."""
    target = scrubbed_environ(extra=extra)
    for name in list(os.environ):
        if name not in target:
            monkeypatch.delenv(name)
    for name, value in target.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
