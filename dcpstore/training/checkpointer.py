"""Checkpoints in a training loop: ``root/step-<n>/``, latest, retention, async saves,
staging, and a local tier.

::

    ckpt = dcpstore.Checkpointer("s3://bucket/run7", keep_last=3, async_mode="process",
                                 local_tier="/nvme/ckpt/run7")
    try:  # every rank gets the same answer: the step, or CheckpointNotFoundError
        start = ckpt.load({"app": AppState(model, optim)})
    except dcpstore.errors.CheckpointNotFoundError:
        start = 0
    for step in range(start + 1, steps + 1):
        train_step()
        if step % 100 == 0:
            ckpt.save(step, {"app": AppState(model, optim)})
    ckpt.close()

With ``torch.distributed`` initialized, :meth:`~Checkpointer.save`,
:meth:`~Checkpointer.wait`, :meth:`~Checkpointer.load`, :meth:`~Checkpointer.delete` and
:meth:`~Checkpointer.close` are collective: call them on every rank. The queries
(:meth:`~Checkpointer.steps`, :meth:`~Checkpointer.latest`, :meth:`~Checkpointer.step_uri`,
:meth:`~Checkpointer.local_step_path`) are not: any rank, or any subset of ranks, may call
them, and each calling rank reads the store itself. Inside the collective calls, a store
request that only the coordinator makes shares its outcome (a failure too) with every
rank. After each commit at the root the coordinator writes a small latest pointer
(:mod:`dcpstore.training.latest`), so ``latest()`` costs a few requests however many
steps there are.

:class:`Checkpointer` puts together the parts that do the work, one module each:
:mod:`~dcpstore.training.config` (its settings, checked), :mod:`~dcpstore.training.root`
(the root, what is committed there, the latest pointer),
:mod:`~dcpstore.training.collectives` (these three make the
:mod:`~dcpstore.training.context` every part gets), :mod:`~dcpstore.training.steps`
(the step listing), :mod:`~dcpstore.training.saving` and
:mod:`~dcpstore.training.writers` (the save path), :mod:`~dcpstore.training.loading`
(the load path), :mod:`~dcpstore.training.background` (async writes and drains),
:mod:`~dcpstore.training.drain` (local tier -> root) and
:mod:`~dcpstore.training.retention`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Generic, Literal, TypeVar, cast, overload

from dcpstore.dcp.staging import (
    BackgroundWriterDiedError,
    CheckpointSaveError,
    Stager,
    StagingOptions,
)
from dcpstore.training.background import BackgroundJobs
from dcpstore.training.background import release_freed_heap as release_freed_heap
from dcpstore.training.collectives import Collectives
from dcpstore.training.config import (
    AsyncMode,
    CheckpointerConfig,
    DrainPolicy,
    checkpointer_config,
)
from dcpstore.training.context import CheckpointerContext
from dcpstore.training.drain import Drainer, PendingDrains
from dcpstore.training.latest import committed_steps as committed_steps
from dcpstore.training.latest import step_dir as step_dir
from dcpstore.training.loading import Loader
from dcpstore.training.local_tier import DrainError, Step
from dcpstore.training.replication import Replicated
from dcpstore.training.retention import Retention
from dcpstore.training.retention import delete_checkpoint as delete_checkpoint
from dcpstore.training.root import Root
from dcpstore.training.saving import Saver, cores_per_local_rank, make_stager
from dcpstore.training.steps import StepListing
from dcpstore.training.writers import WriterFactory

__all__ = ["BackgroundWriterDiedError", "CheckpointSaveError", "Checkpointer", "DrainError",
           "Step", "cores_per_local_rank"]

T = TypeVar("T")


class _Setting(Generic[T]):
    """A Checkpointer attribute kept in its :class:`CheckpointerConfig`, so that every
    part sees a change."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Setting[T]: ...

    @overload
    def __get__(self, obj: Checkpointer, objtype: type | None = None) -> T: ...

    def __get__(self, obj: Checkpointer | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return cast(T, getattr(obj._config, self._name))

    def __set__(self, obj: Checkpointer, value: T) -> None:
        setattr(obj._config, self._name, value)


class Checkpointer:
    """Save and resume a training run under one root URI.

    Args:
        root_uri: Where the run's checkpoints live; step ``n`` goes to
            ``root_uri/step-<n zero-padded to 9 digits>``.
        keep_last: Keep this many newest committed steps at ``root_uri``; older ones are
            deleted only after a new step is committed. ``None`` keeps everything.
        async_mode: ``None`` (blocking), ``"thread"`` or ``"process"``: ``save`` returns
            once the state is snapshotted into staging memory and the write continues in
            the background (a thread, or one persistent process per rank).
        staging: How async saves snapshot the state: ``None``/``True`` (defaults: pinned
            memory with CUDA, shared memory in process mode), a
            :class:`~dcpstore.StagingOptions`, torch's ``StagingOptions`` or a dict of
            its fields. For blocking saves, staging is off unless given.
        local_tier: A local directory (fast disk): each save commits there first and
            then drains to ``root_uri`` in the background. ``None``: no local tier.
        keep_last_local: Steps kept in the local tier (a step not yet on the remote is
            never deleted while it is the newest).
        local_replicas: On node-local disks across several hosts: how many other hosts
            get a copy of each host's files of a step, in the background before the
            drain (default 1; 0: none). A restart after losing a host then reads its
            files from the hosts holding copies, over the process group, instead of the
            root. Capped at the number of other hosts; no two copies share a host.
        drain_retries: Retries of a failed drain before it is reported.
        drain_policy: ``"latest"`` (default): when a drain starts while a newer step is
            already committed locally and queued to drain, it is skipped and only the
            newest step is copied (latest wins; the skipped steps stay in the local tier
            under ``keep_last_local`` and :meth:`steps` shows them as local only), and
            ``save`` never waits for a drain. ``"every"``: drain every step, in order;
            ``save`` waits for the drain before the previous one (backpressure).
        incremental: Each save writes only the tensor payloads that differ from the
            newest committed step at ``root_uri``; unchanged ones are referenced from the
            step that holds them (see :class:`~dcpstore.WriterOptions` ``base``).
            Retention and :meth:`delete` keep files that a retained step references.
            Parameters with ``requires_grad=False`` in an :class:`~dcpstore.AppState`
            created with ``frozen_hint=True`` are referenced without hashing. Not
            combinable with ``local_tier``.
        process_group: Group for the collectives (default: the global group).
        backend: Route through this backend regardless of the scheme.
        **options: Writer/reader/backend options (see :func:`dcpstore.get_writer`).
            Checked when the Checkpointer is created; with a ``local_tier``, on the
            first call that needs the root (a save at the latest), so that resuming from
            the local tier does not load the root's client library.

    Attributes:
        last_timings: Timings of the last save (see :meth:`save`).
        last_load: Where the last :meth:`load` read from: ``step``, ``where``
            (``"local"`` or ``"remote"``), ``uri`` and ``seconds``.
        overlap_copy: Process mode: the background process writes each tensor as soon
            as ``save`` has copied it, so the copy overlaps the write. On by default when
            this rank has at least 4 cores to itself (:func:`cores_per_local_rank`).
        skipped_drains: Steps committed in the local tier whose drain was skipped
            because a newer step was committed locally before it started
            (``drain_policy="latest"``).
        stager: The staging memory of the saves (``None``: blocking saves without
            staging).
    """

    root_uri: _Setting[str] = _Setting()
    keep_last: _Setting[int | None] = _Setting()
    keep_last_local: _Setting[int | None] = _Setting()
    local_replicas: _Setting[int] = _Setting()
    async_mode: _Setting[AsyncMode] = _Setting()
    local_tier: _Setting[str | None] = _Setting()
    drain_retries: _Setting[int] = _Setting()
    drain_policy: _Setting[DrainPolicy] = _Setting()
    incremental: _Setting[bool] = _Setting()
    backend_name: _Setting[str | None] = _Setting()
    options: _Setting[dict[str, Any]] = _Setting()

    def __init__(
        self,
        root_uri: str,
        *,
        keep_last: int | None = None,
        async_mode: Literal["thread", "process"] | None = None,
        staging: StagingOptions | Stager | dict[str, bool] | bool | Any = None,
        local_tier: str | os.PathLike[str] | None = None,
        keep_last_local: int | None = 1,
        local_replicas: int = 1,
        drain_retries: int = 2,
        drain_policy: Literal["latest", "every"] = "latest",
        incremental: bool = False,
        process_group: Any = None,
        backend: str | None = None,
        **options: Any,
    ) -> None:
        config = checkpointer_config(
            root_uri, keep_last=keep_last, async_mode=async_mode, staging=staging,
            local_tier=local_tier, keep_last_local=keep_last_local,
            local_replicas=local_replicas, drain_retries=drain_retries,
            drain_policy=drain_policy, incremental=incremental, backend=backend,
            options=options)
        self._config: CheckpointerConfig = config
        self._collectives = Collectives(process_group)
        self._root = Root(config)  # before any process starts: an unknown option fails here
        context = CheckpointerContext(config, self._root, self._collectives)
        self._listing = StepListing(context)
        pending = PendingDrains()
        self._retention = Retention(context, pending)
        self._drainer = Drainer(context, self._retention, pending)
        stager = make_stager(staging, config.async_mode)
        self._writers = WriterFactory(context, stager)
        self._jobs = BackgroundJobs()
        self._saver = Saver(context, self._jobs, self._writers, self._drainer, stager)
        self._loader = Loader(context, self._listing)
        self._closed = False

    @property
    def process_group(self) -> Any:
        """The group of the Checkpointer's collectives (``None``: the global group)."""
        return self._collectives.group

    @property
    def stager(self) -> Stager | None:
        """The staging memory of the saves (``None``: blocking saves without staging)."""
        return self._saver.stager

    @property
    def overlap_copy(self) -> bool:
        """Process mode: the write of each tensor starts as soon as it is copied."""
        return self._saver.overlap_copy

    @overlap_copy.setter
    def overlap_copy(self, value: bool) -> None:
        self._saver.overlap_copy = value

    @property
    def last_timings(self) -> dict[str, Any]:
        """Timings of the last save: ``blocked_s`` (in ``save``), ``durable_s`` (until
        committed at ``root_uri``; set once known), ``where`` it was first committed."""
        return self._saver.last_timings

    @property
    def last_load(self) -> dict[str, Any]:
        """Where the last :meth:`load` read from: ``step``, ``where`` (``"local"`` or
        ``"remote"``), ``uri`` and ``seconds``."""
        return self._loader.last_load

    @property
    def skipped_drains(self) -> list[int]:
        """Steps whose drain was skipped: a newer step was committed locally first."""
        return self._drainer.skipped

    @property
    def last_replication(self) -> Replicated | None:
        """What the newest step's copy to other hosts did on this rank (``local_replicas``;
        ``None`` before the first): files and bytes sent and received, seconds, and the
        errors of every rank."""
        return self._drainer.replicated

    def __repr__(self) -> str:
        tier = f", local_tier={self.local_tier!r}" if self.local_tier else ""
        return f"Checkpointer({self._root.backend.uri!r}, keep_last={self.keep_last}{tier})"

    # -- queries -----------------------------------------------------------------------

    def step_uri(self, step: int) -> str:
        """URI of the checkpoint of ``step`` at the root."""
        return self._config.step_uri(step)

    def local_step_path(self, step: int) -> str | None:
        """Path of ``step`` in the local tier (``None`` without one)."""
        return self._config.local_step_path(step)

    def steps(self) -> list[Step]:
        """Committed steps, oldest first, each a :class:`~dcpstore.Step` (an ``int``
        whose ``where`` says ``"local"``, ``"remote"`` or ``"both"``).

        Not collective: call it on any rank or ranks (to log, or to decide on one rank);
        the calling rank reads the root itself, with one delimiter listing of the step
        directories and one HEAD of each one's ``.metadata`` (concurrent). Every step is
        confirmed there, so a step deleted by someone else (``dcpstore rm``, another job)
        is not listed, even one this process committed. A step counts as local when
        the calling rank's local tier holds it committed (with node-local tiers on
        several nodes, ranks may see different local steps; :meth:`load` decides
        collectively).
        """
        return self._listing.steps()

    def latest(self) -> Step | None:
        """The newest committed step, or ``None``.

        Not collective: call it on any rank or ranks; the calling rank reads the root
        itself. It reads the latest pointer, checks it against that step's
        ``.metadata`` and looks for newer step directories in one delimiter listing (a
        pointer update lost in a crash is noticed); without a usable pointer it falls
        back to the listing. Never an uncommitted step. With a local tier, a step
        committed in the calling rank's local tier counts too.

        To decide on every rank whether to resume, let :meth:`load` answer (the step,
        or :class:`~dcpstore.errors.CheckpointNotFoundError` on every rank alike): two
        ranks' ``latest()`` can differ while another job commits, or with node-local
        tiers.
        """
        return self._listing.latest()

    # -- save / load -------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step`` (collective).

        Blocking mode returns once the checkpoint is committed (in the local tier when
        there is one; the drain to the root continues in the background). Async modes
        return once the state is snapshotted: training may change it in place at once.
        :meth:`latest` shows a step only once it is committed. A save first waits for
        the previous one's write (not for its drain) and raises if background work
        failed.

        Raises:
            CheckpointSaveError: An earlier background save failed (nothing of it was
                committed); :class:`BackgroundWriterDiedError` when the background
                process died; :class:`DrainError` when a drain to the root failed.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        started = time.perf_counter()
        self._root.resolve()  # an unknown option is reported before anything is written
        self._settle(keep_last_drain=True)
        self._saver.save(step, state, started)

    def wait(self) -> None:
        """Wait until the last save is committed at the root (its drain included).

        Raises:
            CheckpointSaveError: A background save failed (its files are removed);
                :class:`BackgroundWriterDiedError` / :class:`DrainError` as in :meth:`save`.
        """
        self._settle(keep_last_drain=False)

    def load(self, state: dict[str, Any], step: int | None = None, **options: Any) -> int:
        """Load ``step`` (default: the newest committed one, the same on every rank) into
        ``state``; return the step.

        Reads from the local tier when every rank holds a committed, whole copy of the
        step there, else from the root (all ranks agree on the source). A local copy is
        checked cheaply first (``.metadata`` and manifest agree, every file has its size);
        the read itself verifies each byte against the manifest's CRC32C, and a local
        copy that fails it is read from the root instead. With an explicit ``step`` held
        locally, the root is not contacted at all; with ``step=None`` the root is listed
        while the local copy loads, and a newer step there is loaded after it.
        :attr:`last_load` tells where the state came from.

        Raises:
            CheckpointNotFoundError: There is no committed checkpoint (or not ``step``).
        """
        return self._loader.load(state, step, options)

    def delete(self, step: int) -> None:
        """Delete one step at the root and in the local tier (collective: every rank
        calls it).

        The step stops being a checkpoint at once (its ``.metadata`` goes first); data
        files that other steps reference stay until no retained step needs them.
        """
        self._retention.delete(step)

    def close(self) -> None:
        """Wait for pending saves and drains, then release resources (the background
        process and the staging memory)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._jobs.join()
            self._writers.close()
            if self.stager is not None:
                self.stager.close()
            self._root.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _settle(self, *, keep_last_drain: bool) -> None:
        """Wait for background jobs (all, or all but the drains a save does not wait
        for) and raise the first failure not reported yet."""
        try:
            self._jobs.settle(keep_last_drain=keep_last_drain,
                              latest_wins=self.drain_policy == "latest")
        except BackgroundWriterDiedError:
            self._writers.restart_worker()  # the next save uses a new process
            raise

    # benchmarks/scale.py times these two on their own

    def _publish_latest(self, step: int, save_id: str | None,
                        metadata_size: int | None = None) -> None:
        self._root.publish_latest(step, save_id, metadata_size)

    def _retain(self, committed: int | None = None) -> None:
        self._retention.retain(committed=committed)
