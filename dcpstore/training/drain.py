"""The drain: a step committed in the local tier is copied to the root in the
background, every rank its own files, and committed there last by the coordinator.

With ``drain_policy="latest"`` a drain about to start is skipped when a newer step is
already committed locally and queued to drain after it (latest wins); the coordinator
decides and every rank follows.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from dcpstore.dcp import layout
from dcpstore.storage.backend import Backend
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.latest import step_dir
from dcpstore.training.local_tier import DrainError, copy_rank_files, publish_step
from dcpstore.training.replication import Replicated, replicate_step

if TYPE_CHECKING:
    from dcpstore.training.retention import Retention

__all__ = ["Drainer", "PendingDrains"]

logger = logging.getLogger(__name__)


class PendingDrains:
    """Steps committed (or being committed) in the local tier whose drain has not
    finished: local retention spares them, and each drain asks whether a newer one
    supersedes it. Shared by the save path, the drain thread and local retention."""

    def __init__(self) -> None:
        self._undrained: set[int] = set()
        # committed locally, drain not decided yet, in commit order (= drain order)
        self._ready: dict[int, None] = {}
        self._lock = threading.Lock()

    def expect(self, step: int) -> None:
        """A save of ``step`` to the local tier has started; its drain will follow."""
        with self._lock:
            self._undrained.add(step)

    def committed(self, step: int) -> None:
        """``step`` is committed in the local tier; its drain is queued."""
        with self._lock:
            self._ready.pop(step, None)
            self._ready[step] = None

    def finished(self, step: int) -> None:
        """``step``'s drain is over (done, skipped or failed), or it never starts."""
        with self._lock:
            self._undrained.discard(step)

    def take(self, step: int) -> int | None:
        """``step``'s drain starts: the newest step queued to drain after it, if any."""
        with self._lock:
            self._ready.pop(step, None)
            return max((m for m in self._ready if m > step), default=None)

    def undrained(self) -> set[int]:
        """Steps whose drain has not finished."""
        with self._lock:
            return set(self._undrained)

    def superseded(self) -> set[int]:
        """Queued steps with a newer step queued after them: with latest wins, their
        drains will be skipped."""
        with self._lock:
            queued = list(self._ready)
        out: set[int] = set()
        newest_after = -1
        for step in reversed(queued):
            if step < newest_after:
                out.add(step)
            newest_after = max(newest_after, step)
        return out


class Drainer:
    """Copies locally committed steps to the root (every method runs on every rank, on
    the drain thread).

    Args:
        context: The Checkpointer's settings, root and collectives.
        retention: Runs after each step committed at the root.
        pending: The steps waiting to drain.

    Attributes:
        retention: As given.
        pending: As given.
        skipped: Steps whose drain was skipped (latest wins).
    """

    def __init__(self, context: CheckpointerContext, retention: Retention,
                 pending: PendingDrains) -> None:
        self._config, self._root, self._collectives = (
            context.config, context.root, context.collectives)
        self.retention = retention
        self.pending = pending
        self.skipped: list[int] = []
        self.replicated: Replicated | None = None

    def drain_after(self, write: Future[Any], step: int) -> str | None:
        """Drain ``step`` once its background ``write`` committed it locally."""
        try:
            where = write.result()
        except BaseException:
            self.pending.finished(step)
            return None  # the write failed: reported by its own job
        if where == "local":
            return self.drain(step)
        self.pending.finished(step)
        return None

    def drain(self, step: int) -> str:
        """Copy a locally committed step to the root; commit it there last.

        Returns:
            ``"skipped"`` (latest wins: the coordinator found a newer step queued, and
            every rank follows its decision) or ``"drained"``.

        Raises:
            DrainError: Every attempt failed.
        """
        group = self._collectives.side_group("drain")
        try:
            newer = self.pending.take(step)  # every step still queued drains after this
            if self._config.drain_policy == "latest":
                coordinator = self._collectives.is_coordinator(group)
                newer = self._collectives.broadcast(newer if coordinator else None, group)
                if newer is not None:
                    logger.info("step %d not drained: step %d is committed locally and "
                                "drains next (latest wins); step %d stays in the local tier",
                                step, newer, step)
                    self.skipped.append(step)
                    return "skipped"
            self._drain_step(step, group)
            return "drained"
        finally:
            self.pending.finished(step)

    def _drain_step(self, step: int, group: Any) -> None:
        local = self._config.local_step_path(step)
        assert local is not None
        rank = self._collectives.rank(group)
        coordinator = rank == 0
        uri = self._config.step_uri(step)
        retries = self._config.drain_retries
        if self._config.local_replicas:  # node-local disks: copies on other hosts first
            self.replicated = replicate_step(step, local, self._collectives, group,
                                             self._config.local_replicas)
        remote = self._root.backend.child(step_dir(step))
        problems: list[str] = []
        try:
            for attempt in range(retries + 1):
                if attempt:
                    time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
                mine: str | None = None
                try:
                    copy_rank_files(local, remote, rank, coordinator)
                except Exception as exc:
                    mine = f"rank {rank}: {type(exc).__name__}: {exc}"
                failures = [f for f in self._collectives.all_gather(mine, group) if f]
                if not failures:
                    outcome = self._publish(step, local, remote) if coordinator else None
                    outcome = self._collectives.broadcast(outcome, group)
                    if outcome is None:
                        logger.info("step %d drained to %s", step, uri)
                        self.pending.finished(step)
                        self.retention.retain(group, step)
                        self.retention.retain_local(group)
                        return
                    failures = [outcome]
                problems = failures
                logger.warning("drain of step %d to %s failed (attempt %d of %d): %s", step,
                               uri, attempt + 1, retries + 1, "; ".join(failures))
            if coordinator:
                _discard_partial(remote, local)
            raise DrainError(
                f"step {step} is committed in the local tier ({local}) but could not be "
                f"copied to {uri} after {retries + 1} attempts: "
                f"{'; '.join(problems)}. The remote's previous steps are intact; the next "
                "save drains as usual"
            )
        finally:
            remote.close()

    def _publish(self, step: int, local: str, remote: Backend) -> str | None:
        """Coordinator: commit the copied step at the root and point latest at it;
        what went wrong, or ``None``."""
        try:
            publish_step(local, remote, overwrite=self._root.resolved.writer().overwrite)
        except Exception as exc:
            return f"commit: {type(exc).__name__}: {exc}"
        self._root.publish_latest(step, *_local_commit(local))
        return None


def _discard_partial(remote: Backend, local: str) -> None:
    """Coordinator, after a failed drain: remove the files it copied to ``remote``
    (unless the step got committed there after all)."""
    try:
        if remote.exists(layout.METADATA_KEY):
            return
        ids = {layout.save_id_of(n) for n in os.listdir(local)} - {None}
        keys = [o.key for o in remote.list("__") if layout.save_id_of(o.key) in ids]
        remote.delete(keys)
    except Exception as exc:
        logger.warning("could not remove the partial copy at %s (%s); `dcpstore gc` "
                       "will", remote.uri, exc)


def _local_commit(local_step: str) -> tuple[str | None, int | None]:
    """Save id and ``.metadata`` size of the committed save in a local-tier step (what
    the drain published byte for byte); ``(None, None)`` when that cannot be told."""
    path = os.path.join(local_step, layout.METADATA_KEY)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - 4096))
            tail = f.read()
        names = os.listdir(local_step)
    except OSError:
        return None, None
    ids = {layout.save_id_of(n) for n in names if n.startswith(".dcpstore-")}
    named = [i for i in ids if i is not None and i.encode() in tail]
    return (named[0], size) if len(named) == 1 else (None, None)
