"""The strategy's checkpoints on the store: "last" pointers, deletion for ``save_top_k``
(never of a checkpoint still resumed from or pointed to) and the clean-up of a failed
save."""

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
    _pointers: dict[str, str]
    _resumed: set[str]
    _deferred: list[str]

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
