"""The byte window of a rank's uploads: how much memory the data files it writes at
once may hold between them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__: list[str] = []


class _UploadWindow:
    """The memory of the data files a rank writes at once: each holds the buffer its
    upload fills before its first request (:meth:`~dcpstore.Backend.upload_memory`),
    and together they hold at most ``capacity`` bytes; a file waits for room before it
    resolves any item."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = capacity
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the window (at most all of it) while the block runs."""
        n = min(nbytes, self.capacity)
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()
