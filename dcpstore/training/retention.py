"""Retention: ``keep_last`` at the root after each step commits there, ``keep_last_local``
in the local tier, and deleting one step.

A step stops being a checkpoint at once: its ``.metadata`` goes first. With incremental
saves, files that a retained step references stay (:mod:`dcpstore.dcp.references`).

Retention counts only steps it has just confirmed at the store (a HEAD of each step's
``.metadata``): a step this process once saw committed and that someone else deleted
since is not counted as one of the ``keep_last``. The store requests run on the
coordinator; their outcome (a failure too) reaches every rank, so no rank waits in a
collective for a rank that failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from dcpstore.dcp import layout
from dcpstore.dcp.references import INCREMENTAL_DIR, delete_steps
from dcpstore.storage.backend import Backend
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.drain import PendingDrains
from dcpstore.training.latest import step_dir
from dcpstore.training.local_tier import local_committed_steps

__all__ = ["Retention", "delete_checkpoint"]

logger = logging.getLogger(__name__)


class Retention:
    """Deletes the steps a run no longer keeps (every method is collective over the
    group it is given; ``None``: the Checkpointer's group).

    Args:
        context: The Checkpointer's settings, root and collectives.
        pending: The steps waiting to drain (local retention spares them).
    """

    def __init__(self, context: CheckpointerContext, pending: PendingDrains) -> None:
        self._config, self._root, self._collectives = (
            context.config, context.root, context.collectives)
        self._pending = pending

    def retain(self, group: Any = None, committed: int | None = None) -> None:
        """After a step committed at the root: keep the ``keep_last`` newest there.

        Args:
            group: The group of the ranks that run it (``None``: the Checkpointer's).
            committed: The step whose commit this retention follows (it is not checked
                again; every other step is).

        A failure is logged, not raised: the new step is committed, and the next
        save's retention catches up. Every rank learns the coordinator's outcome.
        """
        keep_last = self._config.keep_last
        if keep_last is None:
            return
        failure: str | None = None
        if self._collectives.is_coordinator(group):
            try:
                self._delete_old_steps(keep_last, committed)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
                logger.warning("retention under %s failed (%s); older steps stay until the "
                               "next save's retention", self._config.root_uri, failure)
        failure = self._collectives.broadcast(failure, group)
        if failure is not None and not self._collectives.is_coordinator(group):
            logger.info("retention under %s failed on the coordinator (%s)",
                        self._config.root_uri, failure)

    def _delete_old_steps(self, keep_last: int, committed: int | None) -> None:
        """Coordinator: delete all but the ``keep_last`` newest committed steps (each
        confirmed at the store)."""
        root = self._root.backend
        dirs = root.list_dirs()
        steps = self._root.committed(dirs, () if committed is None else (committed,))
        doomed = steps[: max(0, len(steps) - keep_last)]
        if not doomed:
            return
        logger.info("retention: deleting steps %s under %s", doomed, self._config.root_uri)
        if self._config.incremental or INCREMENTAL_DIR in dirs:
            # files a kept step references stay (dcpstore.dcp.references)
            delete_steps(root, [step_dir(s) for s in doomed])
        else:  # no step here references another: nothing to read first
            for old in doomed:
                _delete_closing(root.child(step_dir(old)))

    def retain_local(self, group: Any = None) -> None:
        """Keep the ``keep_last_local`` newest steps in the local tier, and every step
        that is newer than the root's newest or still to drain (unless a newer step
        supersedes its drain: latest wins)."""
        tier, keep_last_local = self._config.local_tier, self._config.keep_last_local
        if tier is None or keep_last_local is None:
            return
        failure: str | None = None
        doomed: list[int] = []
        if self._collectives.is_coordinator(group):
            try:
                doomed = self._local_doomed(tier, keep_last_local)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
                logger.warning("local retention in %s failed (%s); its steps stay until "
                               "the next one", tier, failure)
        doomed, failure = self._collectives.broadcast((doomed, failure), group)
        if failure is not None:
            if not self._collectives.is_coordinator(group):
                logger.info("local retention in %s failed on the coordinator (%s)", tier,
                            failure)
            return
        if doomed:
            try:
                self._delete_local(doomed, group)
            except Exception as exc:  # raised alike on every rank: none is left waiting
                logger.warning("local retention in %s failed (%s); its steps stay until "
                               "the next one", tier, exc)

    def _local_doomed(self, tier: str, keep_last_local: int) -> list[int]:
        """Coordinator: the local steps to delete. A step is deleted once it is at the
        root (confirmed there now) or older than the root's newest step, unless it is
        among the ``keep_last_local`` newest or still to drain; a step superseded by a
        newer one queued to drain (latest wins) goes regardless."""
        local = local_committed_steps(tier)
        keep = set(local[-keep_last_local:])
        undrained = self._pending.undrained()
        superseded = (self._pending.superseded()
                      if self._config.drain_policy == "latest" else set())
        candidates = [s for s in local if s not in keep
                      and (s in superseded or s not in undrained)]
        unsure = [s for s in candidates if s not in superseded]
        if not unsure:
            return candidates
        # only the candidates are checked at the root: one HEAD each, no listing
        at_root = {s for s, ok in zip(unsure, self._root.confirm(unsure), strict=True) if ok}
        newest_remote = -1
        if any(s not in at_root for s in unsure):
            newest = self._root.newest()
            newest_remote = -1 if newest is None else newest
        return [s for s in candidates
                if s in superseded or s in at_root or s < newest_remote]

    def delete(self, step: int) -> None:
        """Delete ``step`` at the root and in the local tier (see
        :meth:`Checkpointer.delete`)."""
        self._collectives.on_coordinator(
            lambda: delete_steps(self._root.backend, [step_dir(step)]), self._root.failure)
        if self._config.local_tier is not None:
            self._delete_local([step], None)

    def _delete_local(self, steps: list[int], group: Any) -> None:
        """Delete local steps: ``.metadata`` first (coordinator), then every rank its own
        files, then the coordinator the rest. A failure of the first two is raised on
        every rank."""
        rank = self._collectives.rank(group)
        paths = [p for p in (self._config.local_step_path(s) for s in steps) if p]

        def drop_metadata() -> None:
            for path in paths:
                logger.info("local retention: deleting %s", path)
                _unlink(os.path.join(path, layout.METADATA_KEY))

        self._collectives.on_coordinator(
            drop_metadata, f"deleting local steps {steps} on the coordinator failed", group)
        prefix = f"__{rank}_"

        def drop_mine() -> None:
            for path in paths:
                for name in _listdir(path):
                    if name.startswith(prefix):
                        _unlink(os.path.join(path, name))

        self._collectives.agree(drop_mine, f"deleting local steps {steps} failed", group)
        if rank == 0:
            for path in paths:
                for name in _listdir(path):
                    _unlink(os.path.join(path, name))
                with contextlib.suppress(OSError):
                    os.rmdir(path)


def delete_checkpoint(ckpt: Backend, *, spare_saves_in_progress: bool = False) -> int:
    """Delete a checkpoint: ``.metadata`` first (it stops being one at once), then the rest.

    Args:
        ckpt: The checkpoint.
        spare_saves_in_progress: Retention's deletion: keep the data files of saves
            that have no manifest there yet: another job saving this step again right
            now (its commit would name them), or a crashed save (``dcpstore gc``
            removes those).

    Returns the number of objects deleted.
    """
    keys = [o.key for o in ckpt.list()]
    if spare_saves_in_progress:
        # a save writes its manifest just before its .metadata: the saves with one are
        # the committed save (and one it replaced); the others are still writing
        committed = {layout.save_id_of(k) for k in keys if k.startswith(".dcpstore-")}
        committed.add(None)  # files of no save (.metadata, the pointer) are not spared
        spared = [k for k in keys if layout.save_id_of(k) not in committed]
        if spared:
            logger.info("retention of %s: keeping %d files of a save in progress there",
                        ckpt.uri, len(spared))
            keys = sorted(set(keys) - set(spared))
    if layout.METADATA_KEY in keys:
        ckpt.delete([layout.METADATA_KEY])
    rest = [k for k in keys if k != layout.METADATA_KEY]
    ckpt.delete(rest)
    ckpt.remove_empty_dirs()
    return len(keys)


def _delete_closing(ckpt: Backend) -> None:
    """:func:`delete_checkpoint` for retention (sparing saves in progress), then release
    the backend made for it (its client)."""
    try:
        delete_checkpoint(ckpt, spare_saves_in_progress=True)
    finally:
        ckpt.close()


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
