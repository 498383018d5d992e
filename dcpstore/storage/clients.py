"""Store clients shared by the backends of one process.

Making a store client is not cheap: a botocore S3 client costs about 30 ms of CPU
(its service model, endpoint rules and event hooks), and its connection pool starts
cold. A backend lives for one ``dcpstore.save`` / ``load`` or one ``Checkpointer``
step, so a training job that checkpoints every few minutes would pay that on every
save and load, on every rank. Backends whose :meth:`~dcpstore.Backend._client_key` is
equal (same kind, endpoint, client settings and credential environment) therefore share
one client per process, as s3fs shares its filesystem instances.

A shared client is counted: :meth:`SharedClients.acquire` hands it out, a backend's
``close`` gives it back with :meth:`SharedClients.release`, and a client nobody uses
stays open (its connections warm) among the last :data:`IDLE_CLIENTS` idle ones; older
idle clients are closed. A forked child never uses its parent's clients (they hold the
parent's sockets): it starts with none.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["IDLE_CLIENTS", "SharedClients", "shared_clients"]

logger = logging.getLogger(__name__)

#: Idle shared clients kept open (least recently used closed first).
IDLE_CLIENTS = 4


class SharedClients:
    """A process-wide, reference-counted cache of store clients (see the module
    docstring).

    Args:
        idle: Clients nobody uses kept open at most.
    """

    def __init__(self, idle: int = IDLE_CLIENTS) -> None:
        self._idle_max = idle
        self._lock = threading.Lock()
        self._clients: dict[Hashable, tuple[Any, Callable[[Any], None]]] = {}
        self._users: collections.Counter[Hashable] = collections.Counter()
        self._idle: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.made = 0  # clients made, for tests and figures
        os.register_at_fork(after_in_child=self._forget)

    def acquire(self, key: Hashable, make: Callable[[], Any],
                close: Callable[[Any], None]) -> Any:
        """The client for ``key``, made by ``make`` if there is none; ``close`` closes it
        once it is evicted. Give it back with :meth:`release`."""
        with self._lock:
            entry = self._clients.get(key)
            if entry is None:
                entry = self._clients[key] = (make(), close)
                self.made += 1
            self._users[key] += 1
            self._idle.pop(key, None)
            return entry[0]

    def release(self, key: Hashable, client: Any) -> bool:
        """A backend no longer uses ``client`` (what :meth:`acquire` gave it for ``key``).

        Returns:
            ``False`` when the cache no longer knows that client (it was cleared
            meanwhile): the caller closes it.
        """
        evicted = []
        with self._lock:
            entry = self._clients.get(key)
            if entry is None or entry[0] is not client:
                return False
            self._users[key] -= 1
            if self._users[key] > 0:
                return True
            del self._users[key]
            self._idle[key] = None
            while len(self._idle) > self._idle_max:
                old, _ = self._idle.popitem(last=False)
                evicted.append(self._clients.pop(old))
        for old_client, old_close in evicted:
            _close_quietly(old_client, old_close)
        return True

    def clear(self) -> None:
        """Close the idle clients and forget every one (a client still in use stays open
        until its backend closes it as its own)."""
        with self._lock:
            idle = [self._clients.pop(key) for key in self._idle]
            self._idle.clear()
            self._clients.clear()
            self._users.clear()
        for client, close in idle:
            _close_quietly(client, close)

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)

    def _forget(self) -> None:
        # in a forked child: the parent's clients (and maybe a held lock) are not ours
        self._lock = threading.Lock()
        self._clients = {}
        self._users = collections.Counter()
        self._idle = collections.OrderedDict()


def _close_quietly(client: Any, close: Callable[[Any], None]) -> None:
    try:
        close(client)
    except Exception as exc:  # closing must never fail a caller
        logger.debug("closing a shared client failed: %s", exc)


#: The shared clients of this process.
shared_clients = SharedClients()
