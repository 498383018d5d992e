"""Drop files from the page cache, so that the next load reads the disk (a cold load).

:func:`evict` is what the benchmark calls before each load when ``--evict-cache`` is on,
for every system alike: on the local store the checkpoint's files, on SeaweedFS every
file of the server's data directory (its volume ``.dat`` / ``.idx`` files and the
filer's metadata). Each file is ``fsync``-ed first (the kernel does not drop dirty
pages), then ``posix_fadvise(POSIX_FADV_DONTNEED)`` drops its clean pages. No root
privileges are needed, and nothing else on the machine loses its cache.

:func:`resident_bytes` tells how much of a file is in the page cache (``mincore`` on a
mapping of it); the tests use it to check that :func:`evict` works.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
from collections.abc import Iterable, Iterator

__all__ = ["evict", "resident_bytes"]

logger = logging.getLogger(__name__)


def _files(paths: Iterable[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isdir(path):
            for dirpath, _dirs, names in os.walk(path):
                for name in names:
                    yield os.path.join(dirpath, name)
        elif os.path.exists(path):
            yield path


def evict(paths: Iterable[str]) -> int:
    """Write back and drop the cached pages of every file under ``paths``.

    Args:
        paths: Files or directories (walked recursively); missing ones are skipped.

    Returns:
        Bytes (file sizes) whose cache was dropped. Files that vanish or cannot be
        opened meanwhile (a server rotating its files) are skipped.
    """
    dropped = 0
    for path in _files(paths):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            # dirty pages are not dropped: write them back first (read-only fds may fsync)
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_size
        except OSError as exc:
            logger.debug("could not evict %s: %s", path, exc)
        finally:
            os.close(fd)
    return dropped


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    return libc


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` now in the page cache (``mincore``; whole pages, so up to one
    page more than the file's size).

    Raises:
        OSError: The file cannot be opened, mapped or queried.
    """
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path}: {os.strerror(err)}")
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore of {path}: {os.strerror(err)}")
            return sum(b & 1 for b in vec) * page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
