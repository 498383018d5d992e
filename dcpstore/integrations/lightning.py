"""PyTorch Lightning: sharded FSDP2 checkpoints on any dcpstore URI.

Lightning 2.6's ``ModelParallelStrategy`` saves with ``dcp.save(checkpoint_id=Path(dir))``
and ``torch.save(meta, Path(dir) / "meta.pt")``; ``Path`` turns ``s3://b/x`` into ``s3:/b/x``
and the checkpoint lands in a local directory named ``s3:``. The user's change here is one
object, the strategy:

>>> from dcpstore.integrations.lightning import DcpstoreModelParallelStrategy
>>> strategy = DcpstoreModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
>>> trainer = Trainer(strategy=strategy, default_root_dir="s3://bucket/run7",
...                   callbacks=[ModelCheckpoint(save_top_k=2, monitor="loss", save_last=True)])
>>> trainer.fit(model, ckpt_path="last")

What it does:

- **Save.** Every rank streams its model and optimizer shards through dcpstore's writer;
  Lightning's other state (loops, callbacks, hyper-parameters: stock Lightning's
  ``meta.pt``) is ``torch.save``-d by rank 0, broadcast, and stored in the same DCP
  checkpoint as the uint8 tensor :data:`META_KEY`. ``.metadata`` is the one commit point,
  so a checkpoint is never torn, and overwriting one (same file name) is atomic.
- **"last" is a pointer.** ``ModelCheckpoint(save_last=True)`` does not write a second full
  copy: ``last.ckpt`` is a small JSON object naming the checkpoint just committed at the
  same step (a full copy goes to a hidden ``.dcpstore-last-*`` checkpoint only when no
  checkpoint was saved at that step). The pointer is written only after its target
  committed, with one single-request PUT, so it never names an uncommitted checkpoint.
- **Retention.** ``save_top_k`` deletes through dcpstore (``.metadata`` first), never the
  checkpoint this run resumed from nor the one "last" names (that one is deleted when
  "last" moves on), and with ``async_save=True`` only after the newer save committed.
- **Async.** ``async_save=True`` snapshots the state (a copy in CPU memory) and streams it
  with ``dcp.async_save`` on a dedicated gloo group while training goes on; the next save
  (or the end of ``fit``) waits for it, and a failed background save is raised there.
- **Paths.** Importing this module points Lightning's ``get_filesystem`` at
  :class:`DcpstoreFileSystem` for every remote scheme dcpstore serves (``s3``, ``gs``,
  ``msc``, ...), so ``ModelCheckpoint``'s ``ls``/``exists``/``rm``/``modified`` and
  ``CSVLogger`` go through dcpstore and need no s3fs. fsspec's own registry is untouched.
  A URI that was mangled on the way (``s3:/b/x``, a ``Path("s3://...")``, a local
  directory named ``s3:``) is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import logging
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore.errors import InvalidURIError
from dcpstore.storage.backend import Backend
from dcpstore.storage.options import ReaderOptions, WriterOptions

try:
    from fsspec.spec import AbstractFileSystem
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.strategies.launchers.launcher import _Launcher
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dcpstore.integrations.lightning needs PyTorch Lightning 2.6: "
        "pip install 'lightning>=2.6,<2.7'"
    ) from exc

__all__ = [
    "META_KEY",
    "DcpstoreFileSystem",
    "DcpstoreModelParallelStrategy",
    "patch_lightning_filesystem",
]

logger = logging.getLogger(__name__)

#: Key of Lightning's non-tensor state (``meta.pt`` in stock Lightning) inside the checkpoint.
META_KEY = "lightning_meta"
#: Format tag of a "last" pointer object.
POINTER_FORMAT = "dcpstore-lightning-last/1"
#: Name prefix of the full copies "last" points to when no checkpoint shares its step.
LAST_COPY_PREFIX = ".dcpstore-last-"
#: Largest object treated as a possible "last" pointer.
_POINTER_MAX = 64 * 1024

# Schemes other tools use too: a local path component like "s3:" is a mangled URI.
_URI_SCHEMES = {"s3", "s3a", "s3n", "gs", "gcs", "msc", "az", "abfs", "abfss", "adl", "hdfs",
                "hf", "memory", "http", "https", "file"}
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$", re.S)


def _remote_schemes() -> list[str]:
    """The non-local schemes dcpstore has a backend for."""
    return sorted(s for s in dcpstore.available_backends() if s != "file")


def _is_remote(uri: str) -> bool:
    m = _SCHEME_RE.match(uri)
    return bool(m and m.group(2) == "//" and m.group(1).lower() in _remote_schemes())


def checked_uri(path: str | os.PathLike[str]) -> str:
    """Return ``path`` as a dcpstore URI string, refusing one that was mangled.

    Raises:
        dcpstore.InvalidURIError: ``path`` is a URI squashed by ``pathlib``/``normpath``
            (``s3:/b/x``), or a local path through a directory named like a scheme
            (``./s3:/b/x``), where the checkpoint would silently land on local disk.
    """
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise InvalidURIError(f"checkpoint path must be a non-empty string, got {path!r}")
    m = _SCHEME_RE.match(text)
    if m and m.group(1).lower() in (_URI_SCHEMES | set(_remote_schemes())) and len(m.group(1)) > 1:
        if m.group(2) != "//" or isinstance(path, PurePath):
            raise InvalidURIError(
                f"checkpoint path {text!r} looks like a {m.group(1)}:// URI whose '//' was "
                "collapsed (pathlib.Path or os.path.normpath does that); pass the URI as a plain "
                f"string, e.g. '{m.group(1)}://{m.group(3).lstrip('/')}'"
            )
        return text
    for part in PurePath(text).parts:
        if part.endswith(":") and part[:-1].lower() in (_URI_SCHEMES | set(_remote_schemes())):
            raise InvalidURIError(
                f"checkpoint path {text!r} goes through a local directory named {part!r}: a "
                "mangled URI. Pass the URI itself as a string (e.g. 's3://bucket/run') instead "
                "of a pathlib.Path or a path joined onto a local directory"
            )
    return text


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def _split(uri: str) -> tuple[str, str]:
    """``(parent, name)`` of a URI or local path."""
    uri = uri.rstrip("/")
    if _is_remote(uri):
        scheme, rest = uri.split("://", 1)
        if "/" not in rest:
            raise InvalidURIError(f"{uri!r} names a bucket root, not a checkpoint")
        parent, name = rest.rsplit("/", 1)
        return f"{scheme}://{parent}", name
    parent, name = os.path.split(os.path.abspath(uri))
    return parent, name


# -- fsspec ------------------------------------------------------------------------------


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


# -- the strategy ------------------------------------------------------------------------

_WRITER_ONLY = {f.name for f in dataclasses.fields(WriterOptions)}
_READER_ONLY = {f.name for f in dataclasses.fields(ReaderOptions)}


@dataclass
class _Pending:
    """An async save in flight and what waits for its commit."""

    uri: str
    future: Future[Any]
    writer: Any = None
    after_commit: list[Callable[[], None]] = field(default_factory=list)


class _DirectLauncher(_Launcher):
    """Runs the trainer function in this process (ranks made by torchrun or the like),
    after the strategy has looked at the trainer."""

    def __init__(self, strategy: DcpstoreModelParallelStrategy) -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None,
               **kwargs: Any) -> Any:
        if trainer is not None:
            self._strategy._attach(trainer)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        return None


class DcpstoreModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel) whose checkpoints go through dcpstore.

    Takes every argument of :class:`lightning.pytorch.strategies.ModelParallelStrategy`, plus:

    Args:
        *args: Passed to ``ModelParallelStrategy``.
        async_save: Save in the background (``dcp.async_save`` on a dedicated gloo group)
            from a snapshot of the state; retention and "last" advance only after commit.
        dcpstore_options: Backend, writer and reader options for every URI (see
            :func:`dcpstore.get_writer`), e.g. ``{"max_concurrency": 16}``.
        **kwargs: Passed to ``ModelParallelStrategy``.

    Raises:
        ValueError: ``save_distributed_checkpoint=False`` (full single-file checkpoints are
            not what this strategy is for).
    """

    def __init__(self, *args: Any, async_save: bool = False,
                 dcpstore_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError(
                "DcpstoreModelParallelStrategy saves sharded (distributed) checkpoints only; "
                "drop save_distributed_checkpoint=False"
            )
        self.async_save = async_save
        self._options = dict(dcpstore_options or {})
        self._ckpt_group: Any = None
        self._pending: _Pending | None = None
        self._failed: BaseException | None = None
        self._trainer: Any = None
        # rank 0's bookkeeping: what was committed last, what "last" names, what not to delete
        self._last_save: tuple[str, Any] | None = None
        self._pointers: dict[str, str] = {}
        self._resumed: set[str] = set()
        self._deferred: list[str] = []

    # -- wiring ----------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        inner = self._launcher
        if inner is None:
            self._launcher = _DirectLauncher(self)
            return
        launch = inner.launch

        def launch_attached(function: Callable[..., Any], *args: Any, trainer: Any = None,
                            **kwargs: Any) -> Any:
            if trainer is not None:
                self._attach(trainer)
            return launch(function, *args, trainer=trainer, **kwargs)

        setattr(inner, "launch", launch_attached)  # noqa: B010 - an instance override

    def _attach(self, trainer: Any) -> None:
        """Refuse mangled checkpoint directories before training, and let
        ``ckpt_path="last"`` find pointers on dcpstore URIs (Lightning's own search
        normalizes ``s3://`` to ``s3:/``)."""
        self._trainer = trainer
        checked_uri(trainer.default_root_dir)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                checked_uri(callback.dirpath)  # refuse a mangled dirpath before training
            if isinstance(callback, ModelCheckpoint) and not getattr(callback, "_dcpstore", False):
                original = callback._find_last_checkpoints
                setattr(callback, "_find_last_checkpoints", _find_last(callback, original))  # noqa: B010
                setattr(callback, "_dcpstore", True)  # noqa: B010

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.async_save and dist.is_initialized() and self._ckpt_group is None:
            # background saves must not share the training collectives' group
            self._ckpt_group = dist.new_group(backend="gloo")

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            super().teardown()

    # -- store helpers ---------------------------------------------------------------------

    def _backend_options(self) -> dict[str, Any]:
        skip = _WRITER_ONLY | _READER_ONLY
        return {k: v for k, v in self._options.items() if k not in skip}

    def _writer_options(self) -> dict[str, Any]:
        return {k: v for k, v in self._options.items() if k not in _READER_ONLY}

    def _reader_options(self) -> dict[str, Any]:
        return {k: v for k, v in self._options.items() if k not in _WRITER_ONLY}

    def _open(self, uri: str) -> Backend:
        return dcpstore.open_backend(uri, **self._backend_options())

    def _read_pointer(self, uri: str) -> str | None:
        """The checkpoint a "last" pointer at ``uri`` names, or ``None`` if it is none."""
        parent, name = _split(uri)
        backend = self._open(parent)
        try:
            if not any(o.key == name and o.size <= _POINTER_MAX for o in backend.list(name)):
                return None
            doc = json.loads(backend.get(name))
        except (ValueError, UnicodeDecodeError):
            return None
        finally:
            backend.close()
        if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
            return None
        target = str(doc["target"])
        return target if "://" in target or os.path.isabs(target) else _join(parent, target)

    def _resolve(self, uri: str) -> str:
        """Follow a "last" pointer (on rank 0, broadcast)."""
        target = self._read_pointer(uri) if self.global_rank == 0 else None
        target = self.broadcast(target)
        return target or uri

    def _write_pointer(self, uri: str, target: str, step: Any) -> None:
        parent, name = _split(uri)
        t_parent, t_name = _split(target)
        doc = {"format": POINTER_FORMAT, "target": t_name if t_parent == parent else target,
               "global_step": step}
        backend = self._open(parent)
        try:
            backend.put(name, json.dumps(doc).encode(), atomic=True)
        finally:
            backend.close()
        previous = self._pointers.get(uri)
        self._pointers[uri] = target
        logger.info("%s -> %s", uri, target)
        if previous and previous != target and _split(previous)[1].startswith(LAST_COPY_PREFIX):
            self._deferred.append(previous)
        self._retry_deferred()

    def _protected(self, uri: str) -> bool:
        return uri in self._resumed or uri in self._pointers.values()

    def _delete(self, uri: str) -> None:
        """Delete a checkpoint or a pointer through dcpstore (rank 0)."""
        if self._protected(uri):
            logger.info("not deleting %s yet: it is the checkpoint this run resumed from or "
                        "the one 'last' names", uri)
            if uri not in self._deferred:
                self._deferred.append(uri)
            return
        target = self._pointers.pop(uri, None)
        if target and _split(target)[1].startswith(LAST_COPY_PREFIX):
            self._deferred.append(target)  # a full copy only this pointer named
        parent, name = _split(uri)
        backend = self._open(parent)
        try:
            keys = [o.key for o in backend.list(name) if o.key == name
                    or o.key.startswith(name + "/")]
            # the commit point first: a half-deleted checkpoint is never taken for one
            backend.delete(sorted(keys, key=lambda k: k != f"{name}/.metadata"))
        finally:
            backend.close()
        if not _is_remote(uri):
            child = self._open(uri)
            try:
                child.remove_empty_dirs()
            finally:
                child.close()
        logger.info("deleted checkpoint %s", uri)
        if target:
            self._retry_deferred()

    def _retry_deferred(self) -> None:
        waiting, self._deferred = self._deferred, []
        for uri in waiting:
            if self._protected(uri):
                self._deferred.append(uri)
            else:
                self._delete(uri)

    # -- async bookkeeping -----------------------------------------------------------------

    def _after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` on rank 0 once the save in flight committed (now if none is)."""
        if self.global_rank != 0:
            return
        if self._pending is not None:
            self._pending.after_commit.append(action)
        else:
            action()

    def _settle(self, block: bool) -> None:
        pending = self._pending
        if pending is None or (not block and not pending.future.done()):
            return
        self._pending = None
        try:
            pending.future.result()
        except BaseException as exc:
            _close_writer(pending.writer)
            logger.error("async checkpoint save to %s failed: %s", pending.uri, exc)
            self._failed = exc
            if self.global_rank == 0:
                self._discard(pending.uri)
            return
        _close_writer(pending.writer)
        logger.info("committed checkpoint %s", pending.uri)
        for action in pending.after_commit:
            action()

    def wait(self) -> None:
        """Wait for the async save in flight; raise if a background save failed.

        Raises:
            RuntimeError: A background save failed (its files were removed; the previous
                checkpoint and "last" are unchanged).
        """
        self._settle(block=True)
        self._raise_failed()

    def _raise_failed(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise RuntimeError(
                f"an async checkpoint save failed: {failed}. Nothing of it was committed; the "
                "previous checkpoint and 'last' are unchanged"
            ) from failed

    def _discard(self, uri: str) -> None:
        """Remove what an uncommitted save left (never a committed checkpoint)."""
        try:
            backend = self._open(uri)
            try:
                if backend.exists(".metadata"):
                    return
                backend.delete([o.key for o in backend.list()])
                backend.remove_empty_dirs()
            finally:
                backend.close()
        except Exception as exc:  # must not mask the save's own error
            logger.warning("could not remove the files of the failed save at %s (%s)", uri, exc)

    # -- save / load / remove --------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Save a sharded checkpoint to ``filepath`` (any dcpstore URI or local path)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not "
                "supported; give dcpstore options as DcpstoreModelParallelStrategy("
                "dcpstore_options=...)"
            )
        uri = checked_uri(self.broadcast(filepath))
        fingerprint = _fingerprint(checkpoint)
        step = checkpoint.get("global_step")
        if self._is_last(uri):
            if self._last_save is not None and self._last_save[1] == fingerprint:
                # the save in flight (if any) is that checkpoint: the pointer waits for it
                target = self._last_save[0]
                self._after_commit(lambda: self._write_pointer(uri, target, step))
                return
            parent, _ = _split(uri)
            tag = self.broadcast(uuid.uuid4().hex[:8])
            target = _join(parent, f"{LAST_COPY_PREFIX}{step}-{tag}")
            self.wait()
            self._save(checkpoint, target, fingerprint)
            self._after_commit(lambda: self._write_pointer(uri, target, step))
            return
        self.wait()  # one save in flight at a time
        self._save(checkpoint, uri, fingerprint)

    def _is_last(self, uri: str) -> bool:
        trainer = self._trainer or (self.lightning_module.trainer
                                    if self.lightning_module is not None else None)
        if trainer is None:
            return False
        return any(isinstance(cb, ModelCheckpoint) and cb.last_model_path
                   and os.fspath(cb.last_model_path) == uri
                   for cb in trainer.checkpoint_callbacks)

    def _save(self, checkpoint: dict[str, Any], uri: str, fingerprint: Any) -> None:
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s
                      for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = None
        if self.global_rank == 0:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            meta = buffer.getvalue()
        meta = self.broadcast(meta)
        assert meta is not None
        state[META_KEY] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        options = {"overwrite": True, **self._writer_options()}
        if not self.async_save:
            dcpstore.save(state, uri, **options)
            logger.info("committed checkpoint %s", uri)
            self._last_save = (uri, fingerprint)
            return
        # dcp.async_save stages (copies) the state into CPU memory before it returns, so
        # training may change the parameters while the upload runs
        writer = dcpstore.get_writer(uri, **options)
        future = dcp.async_save(state, storage_writer=writer, process_group=self._ckpt_group)
        assert isinstance(future, Future), "dcp.async_save returned no Future"
        self._pending = _Pending(uri, future, writer)
        self._last_save = (uri, fingerprint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Load model and optimizer shards in place (any world size) and return the rest."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        uri = self._resolve(checked_uri(self.broadcast(checkpoint_path)))
        self._resumed.add(uri)
        module = self.model
        assert module is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        reader = dcpstore.get_reader(uri, **self._reader_options())
        try:
            size = reader.read_metadata().state_dict_metadata[META_KEY].size  # type: ignore[union-attr]
        except KeyError:
            raise ValueError(
                f"{uri} is a DCP checkpoint without Lightning's state ({META_KEY!r}); it was not "
                "written by DcpstoreModelParallelStrategy. Load weights alone with "
                "dcpstore.load_model_weights"
            ) from None
        finally:
            reader.backend.close()
        optimizers = {f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)}
        state: dict[str, Any] = {
            "state_dict": get_model_state_dict(module),
            **{k: get_optimizer_state_dict(module, opt) for k, opt in optimizers.items()},
            META_KEY: torch.empty(tuple(size), dtype=torch.uint8),
        }
        if not strict:
            # keys the model lacks are not loaded; keys the checkpoint lacks are kept
            saved = dcpstore.get_reader(uri, **self._reader_options())
            try:
                have = set(saved.read_metadata().state_dict_metadata)
            finally:
                saved.backend.close()
            state["state_dict"] = {k: v for k, v in state["state_dict"].items()
                                   if f"state_dict.{k}" in have}
        dcpstore.load(state, uri, **self._reader_options())
        set_model_state_dict(module, state["state_dict"],
                             options=StateDictOptions(strict=strict))
        for key, opt in optimizers.items():
            set_optimizer_state_dict(module, opt, optim_state_dict=state[key])
        meta = torch.load(io.BytesIO(state[META_KEY].numpy().tobytes()), weights_only=weights_only)
        logger.info("restored model, optimizer and trainer state from %s", uri)
        return dict(meta)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint through dcpstore (rank 0), after the save in flight committed."""
        if self.global_rank != 0:
            return
        uri = checked_uri(filepath)
        self._settle(block=False)
        self._after_commit(lambda: self._delete(uri))


def _close_writer(writer: Any) -> None:
    """Release the connections and threads of a writer made for one async save."""
    backend = getattr(writer, "backend", None)
    if backend is not None:
        backend.close()


def _fingerprint(checkpoint: Mapping[str, Any]) -> tuple[Any, ...]:
    """Identifies the training state a save captured (step, epoch and loop progress)."""
    buffer = io.BytesIO()
    torch.save(checkpoint.get("loops"), buffer)
    return (checkpoint.get("global_step"), checkpoint.get("epoch"),
            hashlib.sha256(buffer.getvalue()).hexdigest())


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

