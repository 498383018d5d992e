"""Lightning's paths on dcpstore URIs: :class:`DcpstoreFileSystem` (a small fsspec
filesystem over dcpstore backends) behind Lightning's ``get_filesystem``, patched when
this module is imported, and the search for ``last`` checkpoints that keeps the
``scheme://``."""

from __future__ import annotations

import datetime
import io
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from fsspec.spec import AbstractFileSystem
from lightning.pytorch.callbacks import ModelCheckpoint

import dcpstore
from dcpstore.integrations.lightning.uris import _is_remote, checked_uri
from dcpstore.storage.backend import Backend

__all__ = ["DcpstoreFileSystem", "patch_lightning_filesystem"]


class _PutOnClose(io.BytesIO):
    """A write buffer stored as one object when closed."""

    def __init__(self, fs: DcpstoreFileSystem, path: str, initial: bytes = b"") -> None:
        super().__init__()
        self.write(initial)
        self._fs = fs
        self._path = path

    def close(self) -> None:
        if not self.closed:
            root, key = self._fs._locate(self._path)
            self._fs._backend(root).put(key, self.getvalue(), atomic=True)
        super().close()


class DcpstoreFileSystem(AbstractFileSystem):
    """A small fsspec filesystem over dcpstore backends, for Lightning's path handling.

    It serves what Lightning asks of a checkpoint or log directory: ``ls``, ``info``,
    ``exists``, ``isdir``, ``isfile``, ``modified``, ``rm``, ``makedirs`` (object
    stores have no directories; one made here exists, empty, for this process) and
    whole-object ``open`` (``rb``, ``wb``, ``ab``, text modes).
    Paths keep their scheme (``ls`` returns ``s3://b/x/y``), so a listed path can be handed
    back to Lightning. It is not a general-purpose replacement for s3fs/gcsfs.

    Args:
        **storage_options: Backend options for :func:`dcpstore.open_backend`.
    """

    protocol: tuple[str, ...] = ("s3", "s3a", "gs", "gcs", "msc")
    root_marker = ""
    cachable = True

    def __init__(self, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self._options = dict(storage_options)
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()
        # object stores have no directories: the ones "made" here exist for this process
        self._made: set[str] = set()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = os.fspath(path) if not isinstance(path, str) else path
        return text.rstrip("/") if "://" in text else text

    def unstrip_protocol(self, name: str) -> str:
        return name

    def _locate(self, path: str) -> tuple[str, str]:
        """``(bucket root URI, key)`` of ``path``; the key is ``""`` at the root."""
        path = checked_uri(self._strip_protocol(path))
        scheme, rest = path.split("://", 1)
        bucket, _, key = rest.partition("/")
        return f"{scheme}://{bucket}", key.strip("/")

    def _backend(self, root: str) -> Backend:
        with self._lock:
            backend = self._backends.get(root)
            if backend is None:
                backend = self._backends[root] = dcpstore.open_backend(root, **self._options)
            return backend

    def __reduce__(self) -> Any:
        return (type(self), (), self._options)

    def __setstate__(self, state: dict[str, Any]) -> None:  # pragma: no cover - via __reduce__
        self.__init__(**state)  # type: ignore[misc]

    def _entry(self, root: str, key: str, size: int, kind: str, mtime: float | None
               ) -> dict[str, Any]:
        return {"name": f"{root}/{key}" if key else root, "size": size, "type": kind,
                "mtime": mtime or 0.0}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        root, key = self._locate(path)
        backend = self._backend(root)
        prefix = key + "/" if key else ""
        files: dict[str, dict[str, Any]] = {}
        dirs: dict[str, dict[str, Any]] = {}
        for obj in backend.list(prefix):
            rest = obj.key[len(prefix):]
            head, sep, _ = rest.partition("/")
            if sep:
                entry = dirs.setdefault(head, self._entry(root, prefix + head, 0, "directory", 0))
                entry["mtime"] = max(entry["mtime"], obj.mtime or 0.0)
            else:
                files[head] = self._entry(root, obj.key, obj.size, "file", obj.mtime)
        entries = sorted([*files.values(), *dirs.values()], key=lambda e: e["name"])
        if not entries and key:
            entries = [self.info(path)]  # a file, a made directory or FileNotFoundError
            if entries[0]["type"] == "directory":
                entries = []
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        root, key = self._locate(path)
        if not key:
            return self._entry(root, "", 0, "directory", 0)
        backend = self._backend(root)
        try:
            stat = backend.stat(key)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            pass
        else:
            return self._entry(root, key, stat.size, "file", stat.mtime)
        objects = backend.list(key + "/")
        if not objects:
            uri = f"{root}/{key}"
            if any(made == uri or made.startswith(uri + "/") for made in self._made):
                return self._entry(root, key, 0, "directory", 0)
            raise FileNotFoundError(path)
        commit = [o for o in objects if o.key == f"{key}/.metadata"]
        mtime = (commit or [max(objects, key=lambda o: o.mtime or 0.0)])[0].mtime
        return self._entry(root, key, 0, "directory", mtime)

    def modified(self, path: str) -> datetime.datetime:
        """Modification time (of ``.metadata`` for a checkpoint directory)."""
        mtime = self.info(path)["mtime"]
        return datetime.datetime.fromtimestamp(mtime, tz=datetime.timezone.utc)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        root, key = self._locate(path)
        if key:
            self._made.add(f"{root}/{key}")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.mkdir(path)

    def rm_file(self, path: str) -> None:
        root, key = self._locate(path)
        self._backend(root).delete([key])

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for one in [path] if isinstance(path, str) else list(path):
            root, key = self._locate(one)
            self._made = {m for m in self._made
                          if m != f"{root}/{key}" and not m.startswith(f"{root}/{key}/")}
            backend = self._backend(root)
            if backend.exists(key):
                backend.delete([key])
                continue
            objects = [o.key for o in backend.list(key + "/")]
            if objects and not recursive:
                raise IsADirectoryError(f"{one} is a directory; pass recursive=True")
            # the commit point first: a half-deleted checkpoint is never taken for one
            backend.delete(sorted(objects, key=lambda k: not k.endswith("/.metadata")))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        root, key = self._locate(path)
        backend = self._backend(root)
        if mode == "rb":
            return io.BytesIO(backend.get(key))
        if mode in ("wb", "xb"):
            return _PutOnClose(self, path)
        if mode == "ab":
            try:
                initial = backend.get(key)
            except FileNotFoundError:
                initial = b""
            return _PutOnClose(self, path, initial)
        raise ValueError(f"DcpstoreFileSystem cannot open {path!r} in mode {mode!r}")


def patch_lightning_filesystem() -> list[str]:
    """Make Lightning's ``get_filesystem`` serve dcpstore URIs with :class:`DcpstoreFileSystem`.

    Called when this module is imported. Lightning resolves ``dirpath`` /
    ``default_root_dir`` / log directories with ``get_filesystem`` before any strategy
    runs; this is what lets ``ModelCheckpoint(dirpath="s3://...")`` work without s3fs.
    Only the ``get_filesystem`` names inside the loaded ``lightning`` modules are replaced;
    fsspec's registry, and so every other user of ``s3://`` in the process, is untouched.
    Calls with storage options, and every other URI, go to Lightning's own function.

    Returns:
        The modules patched.
    """
    from lightning.fabric.utilities import cloud_io

    original = getattr(cloud_io.get_filesystem, "__wrapped__", cloud_io.get_filesystem)
    fs = DcpstoreFileSystem()

    def get_filesystem(path: Any, **kwargs: Any) -> Any:
        text = path if isinstance(path, str) else None
        if text is not None and not kwargs and _is_remote(text):
            return fs
        return original(path, **kwargs)

    get_filesystem.__wrapped__ = original  # type: ignore[attr-defined]
    patched = []
    for name, module in list(sys.modules.items()):
        if (name == "lightning" or name.startswith("lightning.")) and module is not None \
                and getattr(module, "get_filesystem", None) is original:
            setattr(module, "get_filesystem", get_filesystem)  # noqa: B010
            patched.append(name)
    return patched


patch_lightning_filesystem()


def _find_last(callback: ModelCheckpoint, original: Callable[[Any], set[str]]
               ) -> Callable[[Any], set[str]]:
    """``ModelCheckpoint._find_last_checkpoints`` that keeps the scheme of a dcpstore URI."""

    def find(trainer: Any) -> set[str]:
        dirpath = callback.dirpath
        if dirpath is None:
            dirpath = callback._ModelCheckpoint__resolve_ckpt_dir(trainer)  # type: ignore[attr-defined]
        dirpath = os.fspath(dirpath)
        if not _is_remote(dirpath):
            return original(trainer)
        fs = DcpstoreFileSystem()
        pattern = re.compile(rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-(\d+))?")
        if not fs.exists(dirpath):
            return set()
        found = set()
        for entry in fs.ls(dirpath, detail=False):
            name = entry.rsplit("/", 1)[-1]
            stem, dot, ext = name.rpartition(".")
            if dot and "." + ext == callback.FILE_EXTENSION and pattern.match(stem):
                found.add(entry)
        return found

    return find
