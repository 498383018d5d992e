"""The strategy's checkpoints on the store: "last" pointers, deletion for ``save_top_k``
(never of a checkpoint still being loaded or that a "last" pointer names; deferred until it
is not) and the clean-up of a failed save."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import dcpstore
from dcpstore.integrations.lightning.uris import _is_remote, _join, _split
from dcpstore.storage.backend import Backend
from dcpstore.storage.options import ReaderOptions, WriterOptions

__all__ = ["LAST_COPY_PREFIX", "POINTER_FORMAT"]

logger = logging.getLogger(__name__)

#: Format tag of a "last" pointer object.
POINTER_FORMAT = "dcpstore-lightning-last/1"
#: Name prefix of the full copies "last" points to when no checkpoint shares its step.
LAST_COPY_PREFIX = ".dcpstore-last-"
#: Largest object treated as a possible "last" pointer.
_POINTER_MAX = 64 * 1024

_WRITER_ONLY = {f.name for f in dataclasses.fields(WriterOptions)}
_READER_ONLY = {f.name for f in dataclasses.fields(ReaderOptions)}


class _CheckpointStore:
    """The :class:`~dcpstore.integrations.lightning.DcpstoreModelParallelStrategy`
    methods that read and change what is on the store (rank 0's bookkeeping: what "last"
    names, what not to delete yet)."""

    _options: dict[str, Any]
    #: "last" pointer URI -> the checkpoint it names (written by this run, or read once)
    _pointers: dict[str, str]
    #: pointer URIs already looked up on the store (found or not)
    _looked_up: set[str]
    #: checkpoints being loaded
    _resumed: set[str]
    #: deletions waiting for their checkpoint's protection to go
    _deferred: list[str]

    def _pointer_uris(self) -> list[str]:
        """The "last" pointer URIs the trainer's callbacks know (their ``last_model_path``)."""
        return []

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
            return _pointer_target(backend, parent, name, backend.list(name))
        finally:
            backend.close()

    def _known_target(self, uri: str) -> str | None:
        """What the "last" pointer at ``uri`` names: from this run's bookkeeping, or read
        from the store once (a pointer an earlier run wrote, which this run may resume
        through, overwrite or delete)."""
        if uri not in self._pointers and uri not in self._looked_up:
            self._looked_up.add(uri)
            target = self._read_pointer(uri)
            if target:
                self._pointers[uri] = target
        return self._pointers.get(uri)

    def _write_pointer(self, uri: str, target: str, step: Any) -> None:
        self._known_target(uri)  # what it named before: a hidden copy goes once it moved
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
        """Whether ``uri`` must stay for now: it is being loaded, or a "last" pointer (this
        run's, or an earlier run's that a callback still names) points to it."""
        if uri in self._resumed:
            return True
        for pointer in self._pointer_uris():
            self._known_target(pointer)
        return uri in self._pointers.values()

    def _delete(self, uri: str) -> None:
        """Delete a checkpoint or a pointer through dcpstore (rank 0)."""
        if self._protected(uri):
            logger.info("not deleting %s yet: a 'last' pointer names it (or it is being "
                        "loaded); it goes once that pointer moved on", uri)
            if uri not in self._deferred:
                self._deferred.append(uri)
            return
        parent, name = _split(uri)
        backend = self._open(parent)
        try:
            objects = [o for o in backend.list(name) if o.key == name
                       or o.key.startswith(name + "/")]
            if uri not in self._pointers and uri not in self._looked_up:
                # a pointer an earlier run wrote: what it named may be a hidden copy
                self._looked_up.add(uri)
                earlier = _pointer_target(backend, parent, name, objects)
                if earlier:
                    self._pointers[uri] = earlier
            # the commit point first: a half-deleted checkpoint is never taken for one
            backend.delete(sorted((o.key for o in objects),
                                  key=lambda k: k != f"{name}/.metadata"))
        finally:
            backend.close()
        target = self._pointers.pop(uri, None)
        if target and _split(target)[1].startswith(LAST_COPY_PREFIX):
            self._deferred.append(target)  # a full copy only this pointer named
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

    def _flush_deferred(self) -> None:
        """Carry out the deletions still deferred (rank 0, at teardown): the bookkeeping
        ends with the process, and the next run's ``ModelCheckpoint`` no longer tracks
        them. One a "last" pointer still names stays (deleting it would leave "last"
        naming nothing), and one that cannot be deleted now is left; each with a warning
        (the run itself succeeded, and its error, if any, is not masked)."""
        self._resumed.clear()
        seen: set[str] = set()
        while self._deferred:
            uri = self._deferred.pop(0)
            if uri in seen:
                continue
            seen.add(uri)
            try:
                if self._protected(uri):
                    pointers = sorted(p for p, t in self._pointers.items() if t == uri)
                    logger.warning(
                        "not deleting %s, which retention let go: %s still names it. Delete "
                        "it with `dcpstore rm` once 'last' has moved on", uri,
                        ", ".join(pointers))
                else:
                    self._delete(uri)
            except Exception as exc:
                logger.warning("could not delete %s, which retention let go (%s); delete it "
                               "with `dcpstore rm`", uri, exc)

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


def _pointer_target(backend: Backend, parent: str, name: str, objects: Any) -> str | None:
    """The checkpoint the "last" pointer object ``name`` names, if it is one (``objects``:
    a listing of ``name``'s prefix)."""
    try:
        if not any(o.key == name and o.size <= _POINTER_MAX for o in objects):
            return None
        doc = json.loads(backend.get(name))
    except (ValueError, UnicodeDecodeError, FileNotFoundError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    target = str(doc["target"])
    return target if "://" in target or os.path.isabs(target) else _join(parent, target)
