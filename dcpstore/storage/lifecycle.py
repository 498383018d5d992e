"""A backend's per-process state: made lazily, dropped when pickled and by ``close``.

:class:`BackendLifecycle` is the base of :class:`~dcpstore.storage.backend.Backend` that
owns everything a backend makes on first use: the store's client (made by
``_make_client``, or shared per process through :mod:`dcpstore.storage.clients`), the
worker pool, the adaptive concurrency limits (:mod:`dcpstore.storage.concurrency`) and
other lazily created state (the multipart module's part buffers and upload slots). All of
it is dropped when a backend is pickled and by :meth:`BackendLifecycle.close`, and made
again on use; every ``threading.Lock`` / ``RLock`` attribute is recreated after
unpickling. So backends are picklable (``dcp.async_save`` in process mode) without
``__getstate__`` of their own.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from dcpstore.storage.clients import shared_clients
from dcpstore.storage.concurrency import ConcurrencyLimit, learnt_limits
from dcpstore.storage.types import BackendOptions

__all__ = ["BackendLifecycle"]

#: Closing a client is logged under the Backend's logger, where it always was.
logger = logging.getLogger("dcpstore.storage.backend")

T = TypeVar("T")

_LOCK_TYPES: dict[type, Callable[[], Any]] = {
    type(threading.Lock()): threading.Lock,
    type(threading.RLock()): threading.RLock,
}
#: Key of the client in ``BackendLifecycle._resources``.
_CLIENT = "client"
#: Key of the shared client's cache key in ``BackendLifecycle._resources``.
_CLIENT_KEY = "client-key"


class BackendLifecycle(abc.ABC):
    """The lazy state of a backend, its pickling and :meth:`close`.

    A subclass sets ``options`` before calling ``__init__`` and provides :attr:`uri`
    (:class:`~dcpstore.storage.backend.Backend` does both).
    """

    #: The backend's name (set by the Backend): its worker threads are named after it.
    name: ClassVar[str]
    #: The backend's options.
    options: BackendOptions

    def __init__(self) -> None:
        self._state_lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        #: State made on first use (the client, the multipart module's part buffers
        #: and upload slots): dropped when pickled and by :meth:`close`.
        self._resources: dict[str, Any] = {}

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """URI of the root, without credentials or options."""

    # -- the client --------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The store's client, made by :meth:`_make_client` on first use (thread-safe),
        shared by the backend's threads; dropped when pickled and by :meth:`close`.
        Backends with equal :meth:`_client_key` share one client per process
        (:mod:`dcpstore.storage.clients`)."""
        return self._lazy(_CLIENT, self._acquire_client)

    def _client_key(self) -> Any:
        """What makes this backend's client interchangeable with another's: backends
        whose keys are equal share one client per process. ``None`` (the default): a
        client of its own. A key holds everything the client is made from (endpoint,
        client settings, the credential environment, hashed), never a secret."""
        return None

    def _acquire_client(self) -> Any:
        key = self._client_key()
        if key is None:
            return self._make_client()
        key = (type(self), key)
        client = shared_clients.acquire(key, self._make_client, self._close_client)
        self._resources[_CLIENT_KEY] = key  # called under _state_lock, by _lazy
        return client

    def _make_client(self) -> Any:
        """Create the store's client (called once, under a lock, by :attr:`client`)."""
        raise NotImplementedError(f"{type(self).__name__} uses no client")

    def _close_client(self, client: Any) -> None:
        """Release a client :meth:`close` dropped (default: nothing; it is garbage)."""
        return None

    # -- lazy state, pickling, close ---------------------------------------------------

    def _lazy(self, name: str, factory: Callable[[], T]) -> T:
        """The per-backend state ``name``, made by ``factory`` on first use (double-checked
        locking); dropped when the backend is pickled and by :meth:`close`."""
        value = self._resources.get(name)
        if value is None:
            with self._state_lock:
                value = self._resources.get(name)
                if value is None:
                    value = self._resources[name] = factory()
        return value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_resources"] = {}
        locks = {name: kind for name, value in state.items()
                 if (kind := type(value)) in _LOCK_TYPES}
        for name in locks:
            del state[name]
        state["__dcpstore_locks__"] = {name: _LOCK_TYPES[kind] is threading.RLock
                                       for name, kind in locks.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        locks: dict[str, bool] = state.pop("__dcpstore_locks__", {})
        self.__dict__.update(state)
        for name, reentrant in locks.items():
            setattr(self, name, threading.RLock() if reentrant else threading.Lock())

    def close(self) -> None:
        """Release threads, the client and idle upload buffers; the backend stays usable
        (they are made again on use). A shared client goes back to the process's cache
        (:mod:`dcpstore.storage.clients`), and where the adaptive concurrency limits settled is
        kept for the next backend on the same store."""
        with self._state_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._state_lock:
            resources, self._resources = self._resources, {}
        key = resources.get(_CLIENT_KEY)
        # the next backend on this store starts where these settled (a plugin store's
        # client is the store's own, so its key is asked for here)
        limits = {d: resources.get(f"concurrency-{d}") for d in ("upload", "read")}
        learnt_key = key
        if key is None and any(limits.values()):
            try:
                store_key = self._client_key()
            except Exception:  # a store that cannot say (no credentials): nothing learnt
                store_key = None
            learnt_key = None if store_key is None else (type(self), store_key)
        if learnt_key is not None:
            for direction, limit in limits.items():
                if limit is not None:
                    learnt_limits.remember(learnt_key, direction, limit)
        client = resources.get(_CLIENT)  # buffers still in use go back to dropped pools
        if client is not None and (key is None or not shared_clients.release(key, client)):
            try:
                self._close_client(client)
            except Exception as exc:  # closing must never fail a caller
                logger.debug("%s: closing the client failed: %s", self.uri, exc)

    # -- worker pool and concurrency limits --------------------------------------------

    def _concurrency(self, direction: str) -> ConcurrencyLimit:
        """The limit on requests in flight of ``direction`` (``"upload"``: multipart
        parts, ``"read"``: ranged reads), shared by the backend's uploads or reads, made
        on first use (dropped when pickled and by :meth:`close`)."""
        o = self.options

        def make() -> ConcurrencyLimit:
            key = self._client_key() if o.adaptive_concurrency else None
            start = None if key is None else learnt_limits.recall((type(self), key),
                                                                   direction)
            if start is None and direction == "read":
                # no slow start for reads: the ceiling bounds their buffers either way
                start = o.max_concurrency
            return ConcurrencyLimit(o.max_concurrency, adaptive=o.adaptive_concurrency,
                                    initial=start, name=f"{self.uri} {direction}")

        return self._lazy(f"concurrency-{direction}", make)

    def concurrency_figures(self) -> dict[str, dict[str, Any]]:
        """What the concurrency limits did since they were made (see
        :meth:`~dcpstore.storage.concurrency.ConcurrencyLimit.figures`), by direction
        (``"upload"``, ``"read"``); a direction not used yet is absent."""
        out: dict[str, dict[str, Any]] = {}
        for direction in ("upload", "read"):
            limit = self._resources.get(f"concurrency-{direction}")
            if limit is not None:
                out[direction] = limit.figures()
        return out

    def _executor(self) -> ThreadPoolExecutor:
        """Shared worker pool of this backend (created on first use)."""
        with self._state_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.options.max_concurrency,
                    thread_name_prefix=f"dcpstore-{self.name}",
                )
            return self._pool
