"""The save path: where a step goes (the local tier or the root), the snapshot of async
saves, the write through DCP, and what a failed save reports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcpstore.dcp.dist import is_distributed, single_process_quiet, unwrap
from dcpstore.dcp.staging import Stager, as_staging_options
from dcpstore.dcp.staging.errors import BackgroundWriterDiedError, CheckpointSaveError
from dcpstore.dcp.writer import Writer
from dcpstore.training.background import BackgroundJobs
from dcpstore.training.config import AsyncMode
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.drain import Drainer
from dcpstore.training.host_tier import spread_commit
from dcpstore.training.local_tier import is_space_or_permission_error, probe_local_tier
from dcpstore.training.writers import WriterFactory

__all__ = ["Saver", "cores_per_local_rank", "make_stager"]

logger = logging.getLogger(__name__)

#: Cores per local rank from which process mode overlaps the snapshot copy with the write:
#: one for the copy, one for the writer, the rest for the training process's own threads.
_OVERLAP_MIN_CORES = 4


@dataclass
class _Target:
    where: Literal["local", "remote"]
    reason: str = ""


class _SaveFailed(Exception):
    def __init__(self, error: BaseException, landed: bool | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.landed = landed


def make_stager(staging: Any, async_mode: AsyncMode) -> Stager | None:
    """The Checkpointer's :class:`~dcpstore.Stager` for ``staging=``: the one given, a
    new one (async saves always stage), or ``None`` (a blocking save without staging)."""
    if isinstance(staging, Stager):
        return staging
    if async_mode is not None or staging not in (None, False):
        return Stager(as_staging_options(staging, process=async_mode == "process"))
    return None


class Saver:
    """Saves steps (``save`` is collective; the writes and drains it queues run in the
    background).

    Args:
        context: The Checkpointer's settings, root and collectives.
        jobs: Where async writes and drains run.
        writers: Makes each save's writer.
        drainer: Drains steps committed in the local tier; its ``retention`` runs after
            each commit, its ``pending`` holds the steps waiting to drain.
        stager: The staging memory (async saves, or blocking ones asked to stage).

    Attributes:
        stager: As given.
        overlap_copy: See :attr:`Checkpointer.overlap_copy`.
        last_timings: See :attr:`Checkpointer.last_timings`.
    """

    def __init__(self, context: CheckpointerContext, jobs: BackgroundJobs,
                 writers: WriterFactory, drainer: Drainer, stager: Stager | None) -> None:
        self._config, self._root, self._collectives = (
            context.config, context.root, context.collectives)
        self._jobs = jobs
        self._writers = writers
        self._drainer = drainer
        self._retention, self._pending = drainer.retention, drainer.pending
        self.stager = stager
        # only with cores to spare: where copy, writer and the rest of the training process
        # share fewer, the writer slows down the copy that training waits for and gains
        # nothing in time to durable (measured on 2 cores: blocked grew 2-4x)
        self.overlap_copy = (self._config.async_mode == "process"
                             and cores_per_local_rank() >= _OVERLAP_MIN_CORES)
        self.last_timings: dict[str, Any] = {}

    def save(self, step: int, state: dict[str, Any], started: float) -> None:
        """Save ``state`` as ``step`` (see :meth:`Checkpointer.save`); the previous
        save's background work has been waited for."""
        if self._config.incremental:
            self._writers.note_frozen(step, state)
        if self._config.async_mode == "process":
            self._writers.check_worker()
        target = self._choose_target(step, state)
        if self._config.async_mode is None:
            staged = state
            if self.stager is not None:
                # a rank whose copy fails (a lost device) must not leave the others
                # waiting in the save's collectives: every rank fails it here
                staged = self._collectives.agree(lambda: self._stage_now(state),
                                                 "staging the state failed")
            where = self.write(step, staged, target, self._collectives.group)
            blocked = time.perf_counter() - started
            self.last_timings = {"step": step, "blocked_s": blocked, "where": where,
                                 "durable_s": blocked if where == "remote" else None}
            if where == "local":
                self._collectives.side_group("drain")
                self._pending.expect(step)
                self._submit("drain", step, started, self._drainer.drain, step)
            return
        assert self.stager is not None
        group = self._collectives.side_group("async")
        if target.where == "local":
            self._collectives.side_group("drain")
            self._pending.expect(step)
        self.last_timings = {"step": step, "blocked_s": None, "where": target.where,
                             "durable_s": None}
        snapshot = self.stager.prepare(state)
        if self.overlap_copy and not snapshot.on_cuda:
            # the background process writes each slot as soon as it is copied: the write
            # starts now and overlaps the copy, which durable would otherwise add in full
            write = self._submit("write", step, started, self.write, step, snapshot.staged,
                                 target, group)
            try:
                self.stager.copy(snapshot)
            except BaseException:
                self._jobs.pending[-1].reported = True  # the write fails for this very error
                raise
        else:
            # a thread's writer reads the slots as they are; CUDA copies finish on a side
            # stream (the write synchronizes with them first). A rank whose copy fails
            # fails the save on every rank before any write starts.
            self._collectives.agree(lambda: self.stager.copy(snapshot),  # type: ignore[union-attr]
                                    "staging the state failed", group)
            write = self._submit("write", step, started, self.write, step, snapshot.staged,
                                 target, group)
        self.last_timings["blocked_s"] = time.perf_counter() - started
        if target.where == "local":
            self._submit("drain", step, started, self._drainer.drain_after, write, step)

    def _stage_now(self, state: dict[str, Any]) -> dict[str, Any]:
        assert self.stager is not None
        staged = self.stager.stage(state)
        self.stager.synchronize()
        return staged

    def _submit(self, kind: Literal["write", "drain"], step: int, started: float,
                fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._jobs.submit(kind, step, self._timed, step, started, fn, *args)

    def _timed(self, step: int, started: float, fn: Callable[..., Any], *args: Any) -> Any:
        result = fn(*args)
        # committed at the root: by the write itself, or by its drain
        if result in ("remote", "drained") and self.last_timings.get("step") == step:
            self.last_timings["durable_s"] = time.perf_counter() - started
        return result

    def _choose_target(self, step: int, state: dict[str, Any]) -> _Target:
        if self._config.local_tier is None:
            return _Target("remote")
        need = int(_state_nbytes(state) * 1.1) + (16 << 20)
        why = probe_local_tier(self._config.local_tier, need)
        reasons = [r for r in self._collectives.all_gather(why) if r]
        if reasons:
            msg = (f"local tier unusable for step {step}: {reasons[0]}; saving it straight "
                   f"to {self._config.root_uri}")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            return _Target("remote", reasons[0])
        return _Target("local")

    def write(self, step: int, state: dict[str, Any], target: _Target, group: Any) -> str:
        """Write a step where ``target`` says (falling back to the root when the local
        disk refuses it); return where it was committed. Runs on every rank."""
        if self.stager is not None:
            self.stager.synchronize()
        if target.where == "local":
            try:
                self._dcp_save(step, state, self._writers.local(step), group)
                step_path = self._config.local_step_path(step)
                assert step_path is not None
                spread_commit(step_path, self._collectives, group)  # node-local disks
                self._pending.committed(step)
                self._retention.retain_local(group)
                return "local"
            except _SaveFailed as failed:
                if not is_space_or_permission_error(failed.error):
                    raise self._save_error(step, failed,
                                           self._config.local_step_path(step)) from failed.error
                msg = (f"local tier {self._config.local_tier} failed for step {step} "
                       f"({failed.error}); saving it straight to {self._config.root_uri}")
                logger.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        writer = self._writers.remote(step)
        try:
            self._dcp_save(step, state, writer, group)
        except _SaveFailed as failed:
            raise self._save_error(step, failed, self._config.step_uri(step)) from failed.error
        if writer.is_coordinator:
            self._root.publish_latest(step, writer.save_id, writer.commit_size)
        self._retention.retain(group, step)
        return "remote"

    def _dcp_save(self, step: int, state: dict[str, Any], writer: Writer, group: Any) -> None:
        try:
            with single_process_quiet():
                dcp.save(state, storage_writer=writer, process_group=group,
                         no_dist=not is_distributed())
        except CheckpointException as exc:
            landed = None
            if writer.is_coordinator:
                try:
                    landed = writer.discard()
                except Exception as cleanup:
                    logger.warning("could not remove the files of the failed save at %s "
                                   "(%s); `dcpstore gc` will", writer.backend.uri, cleanup)
            raise _SaveFailed(unwrap(exc), landed if writer.is_coordinator else None) from exc
        except BaseException as exc:
            raise _SaveFailed(exc, None) from exc
        finally:
            writer.backend.close()  # one backend per save: release its threads

    def _save_error(self, step: int, failed: _SaveFailed, uri: str | None) -> BaseException:
        cause, landed = failed.error, failed.landed
        if self._config.async_mode is None and not isinstance(cause, BackgroundWriterDiedError):
            return cause  # blocking saves raise the error itself, as before
        if landed:
            outcome = f"the error came after the commit: step {step} is committed and loads"
        elif landed is False:
            outcome = "nothing was committed and the previous checkpoint is intact"
        else:
            outcome = (f"whether step {step} was committed is decided on the coordinator; "
                       "latest() tells, and the previous checkpoint is intact either way")
        kind = (BackgroundWriterDiedError if isinstance(cause, BackgroundWriterDiedError)
                else CheckpointSaveError)
        return kind(f"background save of step {step} to {uri} failed: {cause}; {outcome}")


def _state_nbytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        from dcpstore.torch_internals import local_tensor

        local = local_tensor(state)
        return int(local.numel() * local.element_size())
    if isinstance(state, dict):
        return sum(_state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_nbytes(v) for v in state)
    sd = getattr(state, "state_dict", None)
    if callable(sd) and not isinstance(state, type):
        try:
            return _state_nbytes(sd())
        except Exception:
            return 0
    return 0


def cores_per_local_rank() -> int:
    """CPU cores this process may run on, divided by the ranks on this node
    (``LOCAL_WORLD_SIZE``, as torchrun sets it; else the world size of an initialized
    process group, which assumes one node; else 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local = 0
    with contextlib.suppress(ValueError):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local < 1:
        local = dist.get_world_size() if is_distributed() else 1
    return max(1, cores // local)
