"""The one place dcpstore-gcs touches gcsfs.

The backend issues its own GCS JSON API requests (so every one carries a timeout, a
CRC32C and dcpstore's retry policy) but borrows four things from gcsfs: credentials
(every ``token=`` form gcsfs knows, refreshed as needed), endpoint resolution
(``endpoint_url``, ``STORAGE_EMULATOR_HOST``, the mTLS endpoint), the aiohttp session
(with the client certificate under mTLS) and the event-loop thread.

All but one of them are public gcsfs API (``GCSFileSystem.base``, ``.credentials``,
``.project``, ``.loop``). The session is not: gcsfs creates it in the private coroutine
``GCSFileSystem._set_session``. That call lives here and nowhere else, and
``tests/test_backend_gcs.py::test_gcsfs_adapter_contract`` fails loudly if the pinned
gcsfs changes what this module relies on; :func:`check_gcsfs` says the same at runtime.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

import aiohttp

__all__ = ["GcsfsClient", "check_gcsfs"]

logger = logging.getLogger(__name__)

#: What the JSON API base URL of ``GCSFileSystem.base`` ends with.
_API_SUFFIX = "/storage/v1/"


def check_gcsfs() -> None:
    """Raise ``ImportError`` if the installed gcsfs lacks what :class:`GcsfsClient` uses.

    Raises:
        ImportError: gcsfs is missing, or its ``GCSFileSystem`` no longer has a
            ``_set_session`` coroutine, a ``base`` property or ``credentials.apply``.
    """
    import gcsfs
    from gcsfs.core import GCSFileSystem
    from gcsfs.credentials import GoogleCredentials

    problems = []
    set_session = getattr(GCSFileSystem, "_set_session", None)
    if not inspect.iscoroutinefunction(set_session):
        problems.append("GCSFileSystem._set_session is no longer a coroutine")
    elif [p for p in inspect.signature(set_session).parameters.values()
          if p.name != "self" and p.default is inspect.Parameter.empty]:
        problems.append("GCSFileSystem._set_session now takes required arguments")
    for name in ("base", "project"):
        if not isinstance(getattr(GCSFileSystem, name, None), property):
            problems.append(f"GCSFileSystem.{name} is no longer a property")
    if not callable(getattr(GoogleCredentials, "apply", None)):
        problems.append("GoogleCredentials.apply is gone")
    if problems:
        raise ImportError(
            f"dcpstore-gcs does not support gcsfs {getattr(gcsfs, '__version__', '?')}: "
            f"{'; '.join(problems)}. Install the gcsfs version pinned in "
            "requirements/constraints.txt"
        )


class GcsfsClient:
    """Credentials, endpoint, session and event loop of one ``GCSFileSystem``.

    Args:
        token: How to authenticate, as gcsfs's ``token=`` (``None``: the standard
            Google chain).
        project: Google Cloud project (billing project for requester pays).
        requester_pays: Add ``userProject`` to every request.
        endpoint_url: JSON API endpoint; ``None``: gcsfs's resolution.
    """

    def __init__(self, *, token: Any, project: str | None, requester_pays: bool,
                 endpoint_url: str | None) -> None:
        check_gcsfs()
        # The core class, not gcsfs's experimental zonal/HNS subclass (selected by
        # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT): that one looks every bucket up over gRPC
        # first, which hangs for a minute against emulators.
        import gcsfs
        from gcsfs.core import GCSFileSystem

        kwargs: dict[str, Any] = {"token": token, "requester_pays": requester_pays,
                                  "use_listings_cache": False}
        if project:
            kwargs["project"] = project
        if endpoint_url:
            kwargs["endpoint_url"] = endpoint_url
        self.fs: Any = GCSFileSystem(**kwargs)
        self.requester_pays = requester_pays
        self._user_agent = f"python-gcsfs/{gcsfs.__version__}"

    @property
    def endpoint(self) -> str:
        """The JSON API endpoint (scheme and host, no path)."""
        base = str(self.fs.base)
        return base[: -len(_API_SUFFIX)] if base.endswith(_API_SUFFIX) else base.rstrip("/")

    @property
    def loop(self) -> Any:
        """gcsfs's event loop (a thread shared by every gcsfs filesystem)."""
        return self.fs.loop

    async def session(self) -> aiohttp.ClientSession:
        """The shared aiohttp session (created on first use, on :attr:`loop`)."""
        session: aiohttp.ClientSession = await self.fs._set_session()
        return session

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """``extra`` plus a user agent and the credential headers (refreshed if due)."""
        out = dict(extra or {})
        out.setdefault("User-Agent", self._user_agent)
        self.fs.credentials.apply(out)
        return out

    def params(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """``extra`` plus ``userProject`` for requester-pays buckets."""
        out = {k: v for k, v in (extra or {}).items() if v is not None}
        if self.requester_pays and self.fs.project:
            out["userProject"] = str(self.fs.project)
        return out

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` on :attr:`loop` and wait at most ``timeout`` seconds."""
        import fsspec.asyn

        return fsspec.asyn.sync(self.loop, lambda: coro, timeout=timeout)
