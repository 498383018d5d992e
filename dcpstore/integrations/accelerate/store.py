"""Committed checkpoints on a store: the commit marker, listing and "latest", rotation
and deletion through the backend."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Sequence

import dcpstore
from dcpstore.errors import CheckpointNotFoundError, IncompleteCheckpointError
from dcpstore.integrations.accelerate.uris import check_uri, is_remote, join_uri
from dcpstore.storage.backend import Backend

__all__ = [
    "COMMIT_MARKER",
    "is_committed",
    "latest_checkpoint",
    "list_checkpoints",
    "require_committed",
    "rotate",
]

logger = logging.getLogger(__name__)

#: Object put last, by the main process, when every part of a checkpoint is stored.
COMMIT_MARKER = "dcpstore_checkpoint.json"


def _delete_tree(uri: str) -> None:
    """Delete every object under ``uri`` through its backend (and, for a local path, the
    directories left empty)."""
    store = dcpstore.open_backend(uri)
    store.delete([COMMIT_MARKER])  # first: a crash mid-delete leaves no committed remnant
    store.delete(info.key for info in store.list())
    if not is_remote(uri):
        path = uri.split("?", 1)[0].removeprefix("file://")
        for dirpath, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):  # not empty: something else lives there
                os.rmdir(dirpath)


def is_committed(checkpoint_uri: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint_uri`` holds a checkpoint whose commit marker is stored."""
    return dcpstore.open_backend(check_uri(checkpoint_uri)).exists(COMMIT_MARKER)


def list_checkpoints(root_uri: str | os.PathLike[str], prefix: str,
                     *, committed: bool | None = True) -> list[tuple[int, str]]:
    """``(number, uri)`` of each ``<prefix><number>`` directory under ``root_uri``, oldest first.

    Args:
        root_uri: The directory holding the checkpoints (a URI or a local path).
        prefix: Directory name before the number (``"checkpoint_"``, ``"checkpoint-"``).
        committed: ``True``: only committed ones; ``False``: only uncommitted ones;
            ``None``: all.
    """
    root = dcpstore.open_backend(check_uri(root_uri))
    numbers: dict[int, bool] = {}
    pattern = re.compile(re.escape(prefix) + r"(\d+)/(.*)$")
    for info in root.list(prefix):
        match = pattern.match(info.key)
        if match:
            number = int(match.group(1))
            numbers[number] = numbers.get(number, False) or match.group(2) == COMMIT_MARKER
    return [(n, join_uri(root_uri, f"{prefix}{n}")) for n in sorted(numbers)
            if committed is None or numbers[n] == committed]


def latest_checkpoint(root_uri: str | os.PathLike[str], prefix: str) -> str | None:
    """URI of the newest committed ``<prefix><number>`` under ``root_uri``, or ``None``."""
    found = list_checkpoints(root_uri, prefix)
    return found[-1][1] if found else None


def rotate(root_uri: str, prefix: str, keep: int, protect: Sequence[str] = ()) -> None:
    """Keep the newest ``keep`` committed checkpoints; delete older ones and older leftovers.

    Runs on one process, after the newest checkpoint committed. A checkpoint's marker is
    deleted first, so a crash mid-delete leaves an uncommitted leftover, never a torn
    checkpoint that "latest" could name.
    """
    committed = list_checkpoints(root_uri, prefix)
    if not committed:
        return
    newest = committed[-1][0]
    protected = {check_uri(p).rstrip("/") for p in protect}
    doomed = [uri for _, uri in committed[:max(len(committed) - keep, 0)]
              if uri.rstrip("/") not in protected]
    doomed += [uri for n, uri in list_checkpoints(root_uri, prefix, committed=False)
               if n < newest]
    for uri in doomed:
        logger.info("deleting old checkpoint %s", uri)
        _delete_tree(uri)


def require_committed(checkpoint_uri: str) -> Backend:
    """The checkpoint's backend; raise unless its commit marker is stored."""
    store = dcpstore.open_backend(checkpoint_uri)
    if store.exists(COMMIT_MARKER):
        return store
    if store.list():
        raise IncompleteCheckpointError(
            f"{checkpoint_uri} has no {COMMIT_MARKER}: its save did not finish (it is not a "
            "checkpoint). Load an earlier one; `dcpstore gc` removes leftovers.")
    raise CheckpointNotFoundError(f"no checkpoint at {checkpoint_uri}")
