"""Saving through a private scratch directory: a trainer's own code writes the parts it
writes with file APIs there, they are stored through the backend, and the main process
commits once every rank succeeded; loading fetches them back."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

import dcpstore
from dcpstore.errors import DcpstoreError
from dcpstore.integrations.accelerate.fsdp import redirected
from dcpstore.integrations.accelerate.store import COMMIT_MARKER, _delete_tree
from dcpstore.integrations.accelerate.uris import join_uri
from dcpstore.storage.backend import Backend

__all__ = ["download_extras", "save_with_scratch", "scratch_dir"]


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_ok(ok: bool, error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank failed (the first failure is named)."""
    if not _is_dist():
        if error is not None:
            raise error
        return
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (ok, None if error is None else repr(error)))
    failed = [(rank, msg) for rank, (good, msg) in enumerate(flags) if not good]
    if error is not None:
        raise error
    if failed:
        rank, msg = failed[0]
        raise DcpstoreError(f"checkpoint save failed on rank {rank}: {msg}; nothing was "
                            "committed")


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def _upload_tree(local_dir: str, store: Backend) -> list[str]:
    keys = []
    for dirpath, _, files in os.walk(local_dir):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, local_dir).replace(os.sep, "/")
            with open(path, "rb") as f:
                store.put(key, f.read())
            keys.append(key)
    return keys


def download_extras(store: Backend, local_dir: str, skip_dirs: Sequence[str]) -> None:
    """Fetch every object not under a DCP directory (``skip_dirs`` prefixes) into ``local_dir``."""
    for info in store.list():
        top = info.key.split("/", 1)[0]
        if "/" in info.key and any(top.startswith(p) for p in skip_dirs):
            os.makedirs(os.path.join(local_dir, top), exist_ok=True)  # listing probes see it
            continue
        if info.key == COMMIT_MARKER or info.key.startswith(".dcpstore"):
            continue
        path = os.path.join(local_dir, *info.key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(store.get(info.key))


def _commit(store: Backend, kind: str, extra: dict[str, Any] | None = None) -> None:
    marker = {"format": kind, "dcpstore": dcpstore.__version__, "torch": torch.__version__,
              "world_size": dist.get_world_size() if _is_dist() else 1, **(extra or {})}
    store.put(COMMIT_MARKER, json.dumps(marker, indent=1).encode(), atomic=True)


@contextlib.contextmanager
def scratch_dir(tag: str) -> Iterator[str]:
    """A private local directory for the parts a trainer writes with file APIs."""
    path = tempfile.mkdtemp(prefix=f"dcpstore-{tag}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def save_with_scratch(target: str, kind: str, write: Callable[[str], Any],
                      modules: Sequence[ModuleType], *, main: bool,
                      marker: dict[str, Any] | None = None, subdir: str = "") -> Any:
    """Run ``write(scratch)`` with DCP parts redirected to ``target``, store the rest, commit.

    ``scratch`` stands for ``target``; the checkpoint (where the commit marker goes) is
    ``target/subdir``.

    Collective: every rank calls it. The commit marker is removed first (an overwrite makes
    the old checkpoint at ``target`` uncommitted until the new one commits) and put last,
    by ``main``, only if every rank's part succeeded. A failed save into an empty target
    deletes what it wrote; a failed overwrite leaves an uncommitted directory.
    """
    root = dcpstore.open_backend(target)
    store = root.child(subdir) if subdir else root
    fresh = not store.list()
    _barrier()  # every rank looked before the main process changes anything
    if main:
        store.delete([COMMIT_MARKER])
    _barrier()
    error: BaseException | None = None
    result = None
    with scratch_dir(kind) as scratch:
        try:
            with redirected(scratch, target, modules):
                result = write(scratch)
            _upload_tree(scratch, root)
        except Exception as exc:  # every rank must learn of it before anyone commits
            error = exc
    try:
        _all_ok(error is None, error)
    except BaseException:
        if main and fresh:  # leave no leftovers where there was nothing before
            with contextlib.suppress(Exception):
                _delete_tree(join_uri(target, subdir) if subdir else target)
        with contextlib.suppress(Exception):  # (a broken process group fails it at once)
            _barrier()  # no rank returns before the leftovers are gone
        raise
    if main:
        _commit(store, kind, marker)
    _barrier()
    return result
