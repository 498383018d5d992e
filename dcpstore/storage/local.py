"""The local backend: POSIX files under a directory (the embedded default), written on
the plugin contract (:class:`LocalStore`, an :class:`~dcpstore.plugin.ObjectStore`).

Data files are streamed straight to their final, per-save unique names
(:meth:`LocalStore.open_stream`; nothing references them until ``.metadata`` is
committed). Every :meth:`~LocalStore.put` is atomic: a temporary name, ``fsync``, a
rename over the target and an ``fsync`` of the directory, so a crash leaves either the
old object (``.metadata``) or the new one. ``fsync`` of files and directories is on by
default.

While a data file is written, the kernel is asked to start writing back every
``writeback`` bytes (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not
wait), so the disk works while the rank serializes the next tensors and the ``fsync``
at commit only waits for the tail, instead of the whole file being flushed at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import stat
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import crc32c
from typing_extensions import Buffer

from dcpstore.errors import (
    AccessDeniedError,
    ConfigurationError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    StoreTimeoutError,
)
from dcpstore.storage.backend import BackendOptions, ObjectInfo, Upload
from dcpstore.storage.contract import ObjectStore
from dcpstore.storage.store_backend import StoreBackend

__all__ = [
    "FileUpload",
    "LocalBackend",
    "LocalOptions",
    "LocalStore",
    "LocationIsAFileError",
    "read_file_into",
]

logger = logging.getLogger(__name__)

_IOV_MAX = 512  # buffers per preadv call (Linux allows 1024)


@dataclass
class LocalOptions(BackendOptions):
    """Options of the local backend.

    Attributes:
        fsync: ``fsync`` data files when committed and the directory at commit. Turning
            it off trades crash safety for speed.
        writeback: With ``fsync``, start the write-back of every this many bytes of a
            data file as it is written (Linux), so the ``fsync`` at commit has little
            left to wait for; 0 leaves all of it to the ``fsync``.
        adaptive_concurrency: Off by default here: a local disk has no throttling or
            network latency to adapt to, so reads keep ``max_concurrency`` in flight.
    """

    fsync: bool = True
    writeback: int = 16 * 1024 * 1024
    adaptive_concurrency: bool = False
    max_concurrency: int = 4
    part_size: int = 8 * 1024 * 1024
    max_attempts: int = 1

    def validate(self) -> None:
        """Raise ``ValueError`` for values that make no sense."""
        super().validate()
        if self.writeback < 0:
            raise ValueError(f"writeback must be >= 0 bytes, got {self.writeback}")


_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux only; ``None`` elsewhere or if missing)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class FileUpload(Upload):
    """An upload written straight into a POSIX file, ``fsync``-ed at commit.

    Used by the local backend and by other backends' POSIX paths (MSC).

    Args:
        key: The key reported in errors and in the committed :class:`ObjectInfo`.
        path: The file the object lands in (parent directories are created).
        fsync: ``fsync`` the file at commit.
        writeback: With ``fsync``, start the write-back of every this many bytes as they
            are written (Linux ``sync_file_range``); 0 leaves all of it to the ``fsync``.
        via_temp: Write ``.<name>.<id>.tmp`` beside ``path`` and rename it over ``path``
            at commit, for a target that may already exist or be read meanwhile; without
            it the file is created at ``path`` (which must not exist) and removed on abort.
    """

    def __init__(self, key: str, path: str, *, fsync: bool, writeback: int = 0,
                 via_temp: bool = False) -> None:
        self.key = key
        self.path = path
        parent, name = os.path.split(path)
        os.makedirs(parent, exist_ok=True)
        self._temp = (os.path.join(parent, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
                      if via_temp else None)
        self._fd: int | None = os.open(
            self._temp or path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644,
        )
        self._size = 0
        self._fsync = fsync
        self._writeback = writeback if fsync else 0
        self._kick = _sync_file_range() if self._writeback else None
        self._flushed = 0  # bytes whose write-back was started

    def write(self, data: Buffer) -> int:
        fd = self._fd
        if fd is None:
            raise ValueError(f"upload of {self.key!r} is already closed")
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            # with write-back: write up to the next multiple of ``writeback``, then kick
            step = (self._writeback - (self._size - self._flushed) if self._kick is not None
                    else len(view))
            n = os.write(fd, view[:step])
            view = view[n:]
            self._size += n
            if self._kick is not None and self._size - self._flushed >= self._writeback:
                # an optimization only: an I/O error surfaces at the fsync of commit()
                self._kick(fd, self._flushed, self._size - self._flushed,
                           _SYNC_FILE_RANGE_WRITE)
                self._flushed = self._size
        return total

    def commit(self) -> ObjectInfo:
        if self._fd is None:
            raise ValueError(f"upload of {self.key!r} is already closed")
        fd, self._fd = self._fd, None
        try:
            try:
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self._temp is not None:
                os.replace(self._temp, self.path)
        except BaseException:
            _unlink_quietly(self._temp or self.path)
            raise
        return ObjectInfo(self.key, self._size)

    def abort(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)
        _unlink_quietly(self._temp or self.path)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.abort()


class _ConditionFailed(Exception):
    """A conditional put's condition did not hold (mapped to PreconditionFailedError)."""


def _version(st: os.stat_result) -> str:
    """A file's version: a new file (temp file + rename) has a new inode and mtime."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` (compare-and-swap puts there take
    it, so a compare and its rename are one step for every other such put)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


#: Step of a checksummed read: small enough that the bytes are still in the CPU's cache
#: when their CRC32C runs right after (it then runs about twice as fast as from memory).
_CRC_STEP = 512 * 1024


def read_file_into(path: str, offset: int, outs: Sequence[memoryview],
                   checksums: dict[int, int | None] | None = None) -> None:
    """Fill ``outs`` in order with the bytes of the file at ``path`` from ``offset``
    (``preadv``, short reads continued); a file that ends early is an ``EOFError``.

    ``checksums``: indices of ``outs`` whose CRC32C to put there, computed in steps of
    :data:`_CRC_STEP` right after each lands (one pass over the bytes, in cache).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if not checksums:
            _pread_into(fd, path, offset, outs)
            return
        pos, plain = offset, []
        for j, out in enumerate(outs):
            if j not in checksums:
                plain.append(out)
                continue
            if plain:  # the buffers before it in one call
                pos = _pread_into(fd, path, pos, plain)
                plain = []
            value = 0
            for lo in range(0, len(out), _CRC_STEP):
                step = out[lo:lo + _CRC_STEP]
                pos = _pread_into(fd, path, pos, [step])
                value = crc32c.crc32c(step, value)
            checksums[j] = value
        if plain:
            _pread_into(fd, path, pos, plain)
    finally:
        os.close(fd)


def _pread_into(fd: int, path: str, offset: int, outs: Sequence[memoryview]) -> int:
    """Fill ``outs`` from ``offset`` of the open file; the offset after them."""
    pending = [o for o in outs if len(o)]
    pos = offset
    while pending:
        n = os.preadv(fd, pending[:_IOV_MAX], pos)
        if n == 0:
            raise EOFError(f"{path} ends at byte {pos}, expected "
                           f"{sum(len(o) for o in outs)} bytes from offset {offset} "
                           "(file truncated?)")
        pos += n
        while pending and n >= len(pending[0]):  # drop the buffers now full
            n -= len(pending.pop(0))
        if n:
            pending[0] = pending[0][n:]
    return pos


class LocationIsAFileError(StoreError, NotADirectoryError, ConfigurationError):
    """The checkpoint location is a file, not a directory: a configuration error that
    reads as ``NotADirectoryError`` (``errno.ENOTDIR``) too; never retried."""

    default_errno = errno.ENOTDIR


class LocalStore(ObjectStore):
    """Files under a local directory, on the plugin contract.

    ``location`` is an absolute directory (``/abs/path``, ``rel/path`` and
    ``file:///abs/path`` all become one). Keys are ``/``-separated paths below it.
    """

    name: ClassVar[str] = "file"
    schemes: ClassVar[tuple[str, ...]] = ("file",)
    Options: ClassVar[type[BackendOptions]] = LocalOptions
    conditional_writes: ClassVar[bool] = True
    options: LocalOptions

    def _path(self, key: str) -> str:
        return os.path.join(self.location, *key.split("/"))

    def _fsync_dir(self, path: str) -> None:
        if not self.options.fsync:
            return
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- the contract ----------------------------------------------------------------

    def read(self, key: str, offset: int = 0,
             buffers: Sequence[memoryview] | None = None) -> bytes | None:
        if buffers is not None:
            read_file_into(self._path(key), offset, buffers)  # preadv, scattered
            return None
        with open(self._path(key), "rb") as f:
            if offset:
                f.seek(offset)
            return f.read()

    def read_checksummed(self, key: str, offset: int, buffers: Sequence[memoryview],
                         checksums: dict[int, int | None]) -> None:
        """:meth:`read` into ``buffers``, with the CRC32C of those named in
        ``checksums`` computed as they land (see
        :meth:`~dcpstore.storage.backend.Backend.read_ranges`)."""
        read_file_into(self._path(key), offset, buffers, checksums)

    def put(self, key: str, data: memoryview, *, if_absent: bool = False,
            if_match: str | None = None) -> None:
        path = self._path(key)
        parent, name = os.path.split(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o644)
        try:
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if if_absent:
                # a hard link fails with EEXIST where a file is: one creator wins
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise _ConditionFailed(f"{path} exists already") from None
                os.unlink(tmp)
            elif if_match is not None:
                with _locked(parent):  # every compare-and-swap in this directory
                    try:
                        current = _version(os.stat(path))
                    except FileNotFoundError:
                        current = None
                    if current != if_match:
                        raise _ConditionFailed(
                            f"{path} changed since it was read (version {if_match}, now "
                            f"{current or 'absent'})")
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self._fsync_dir(parent)

    def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        st = os.stat(path)
        # judged from the one stat: a second look (os.path.isfile) could see the file
        # deleted meanwhile and call a vanished file a directory
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        return ObjectInfo(key, st.st_size, st.st_mtime, _version(st))

    def list(self, prefix: str, *, start_after: str = "",
             delimiter: str | None = None) -> Iterator[ObjectInfo | str]:
        # only the directory the prefix lies in is read, not the whole root
        head, _, tail = prefix.rpartition("/")
        start = self._path(head) if head else self.location
        base = f"{head}/" if head else ""
        if delimiter is None:
            return self._walk(start, base, prefix)
        return self._level(start, base, tail, start_after)

    def delete(self, keys: Sequence[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            _unlink_quietly(path)
            parents.add(os.path.dirname(path))
        for parent in parents:
            if os.path.isdir(parent):
                self._fsync_dir(parent)

    def map_error(self, exc: Exception, key: str | None) -> StoreError | None:
        where = self._path(key) if key else self.location
        if isinstance(exc, (FileExistsError, NotADirectoryError, FileNotFoundError)) and \
                os.path.exists(self.location) and not os.path.isdir(self.location):
            return LocationIsAFileError(
                errno.ENOTDIR, f"checkpoint location {self.location} is a file, not a "
                "directory; choose a directory path")
        if isinstance(exc, _ConditionFailed):
            return PreconditionFailedError(errno.EEXIST, str(exc), where)
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(
                errno.ENOENT, f"no such object {key!r} under {self.location}", where)
        if isinstance(exc, PermissionError):
            return AccessDeniedError(
                exc.errno or errno.EACCES, f"permission denied on {where} "
                f"(object {key!r}): check the owner and mode of {self.location}", where)
        if isinstance(exc, TimeoutError):  # a network file system (NFS: ETIMEDOUT)
            return StoreTimeoutError(
                exc.errno or errno.ETIMEDOUT, f"{where}: the file system timed out "
                f"(object {key!r})", where)
        return None  # ENOSPC, EDQUOT, EISDIR, ...: raised unchanged, not retried

    def open_stream(self, key: str) -> FileUpload:
        options = self.options
        return FileUpload(key, self._path(key), fsync=options.fsync,
                          writeback=options.writeback)

    # -- listing ---------------------------------------------------------------------

    @staticmethod
    def _walk(start: str, base: str, prefix: str) -> Iterator[ObjectInfo | str]:
        """Every file below directory ``start`` (key prefix ``base``) whose key starts
        with ``prefix``; sub-directories that cannot hold such a key are not entered."""
        stack = [(start, base)]
        while stack:
            path, rel = stack.pop()
            try:
                entries = list(os.scandir(path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                key = rel + entry.name
                if entry.is_dir():
                    sub = key + "/"
                    if not entry.is_symlink() and (sub.startswith(prefix)
                                                   or prefix.startswith(sub)):
                        stack.append((entry.path, sub))
                    continue
                if not key.startswith(prefix):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:  # deleted meanwhile, or a dangling link
                    continue
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    @staticmethod
    def _level(start: str, base: str, tail: str,
               start_after: str) -> Iterator[ObjectInfo | str]:
        """One level: the files directly under the prefix ``base + tail`` and, once,
        each directory below it that holds a file somewhere (as on an object store)."""
        try:
            entries = list(os.scandir(start))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if not entry.name.startswith(tail):
                continue
            rest = entry.name[len(tail):]
            if entry.is_dir():
                if (entry.is_symlink() or not rest
                        or (rest <= start_after and base + entry.name <= start_after)):
                    continue
                if _holds_file(entry.path):
                    yield rest
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            yield ObjectInfo(base + entry.name, st.st_size, st.st_mtime)


class LocalBackend(StoreBackend):
    """Files under a local directory (the framework over :class:`LocalStore`). URI forms:
    ``/abs/path``, ``rel/path``, ``file:///p``; :attr:`uri` is the plain path."""

    Store: ClassVar[type[ObjectStore]] = LocalStore  # type: ignore[misc]
    Options = LocalOptions
    name = "file"
    schemes = ("file",)
    options: LocalOptions
    store: LocalStore

    @property
    def uri(self) -> str:
        return self.location

    def __reduce__(self) -> Any:
        # an importable class: rebuilt as itself (StoreBackend's rebuilds the generated one)
        return (_restore, (type(self), self.__getstate__()))

    def remove_empty_dirs(self) -> None:
        """Remove the root and its sub-directories if they hold no files."""
        if not os.path.isdir(self.location):
            return
        for dirpath, _dirs, _files in os.walk(self.location, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def _restore(cls: type[LocalBackend], state: dict[str, Any]) -> LocalBackend:
    backend = cls.__new__(cls)
    backend.__setstate__(state)
    return backend


def _holds_file(path: str) -> bool:
    """Whether a file exists anywhere under directory ``path``."""
    return any(files for _, _, files in os.walk(path))
