"""Checkpoints in a training loop: ``root/step-<n>/``, latest, retention, async saves,
staging, and a local tier.

::

    ckpt = dcpstore.Checkpointer("s3://bucket/run7", keep_last=3, async_mode="process",
                                 local_tier="/nvme/ckpt/run7")
    start = ckpt.load({"app": AppState(model, optim)}) if ckpt.latest() is not None else 0
    for step in range(start + 1, steps + 1):
        train_step()
        if step % 100 == 0:
            ckpt.save(step, {"app": AppState(model, optim)})
    ckpt.close()

Every method is collective when ``torch.distributed`` is initialized: call it on every
rank. Only the coordinator lists the store; the answer is broadcast. After each commit at
the root the coordinator writes a small latest pointer (:mod:`dcpstore.training.latest`), so
``latest()`` costs a few requests however many ranks and steps there are.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcpstore.dcp import layout
from dcpstore.dcp.api import load
from dcpstore.dcp.dist import is_distributed, single_process_quiet, unwrap
from dcpstore.dcp.references import INCREMENTAL_DIR, delete_steps
from dcpstore.dcp.staging import (
    BackgroundWriter,
    BackgroundWriterDiedError,
    CheckpointSaveError,
    ProxyWriter,
    Stager,
    StagingOptions,
    as_staging_options,
)
from dcpstore.dcp.writer import Writer
from dcpstore.errors import CheckpointNotFoundError, DcpstoreError
from dcpstore.storage.backend import Backend
from dcpstore.storage.options import ReaderOptions
from dcpstore.storage.resolve import _READER, Resolved, _own_values, open_backend, resolve
from dcpstore.storage.uri import parse_uri
from dcpstore.training.latest import Pointer, find_latest, step_dir, write_pointer
from dcpstore.training.latest import committed_steps as _committed_steps
from dcpstore.training.local_tier import (
    DrainError,
    Step,
    copy_rank_files,
    is_space_or_permission_error,
    local_committed_steps,
    local_step_verified,
    probe_local_tier,
    publish_step,
)
from dcpstore.training.state import frozen_keys

__all__ = ["BackgroundWriterDiedError", "CheckpointSaveError", "Checkpointer", "DrainError",
           "Step", "cores_per_local_rank"]

logger = logging.getLogger(__name__)

#: Cores per local rank from which process mode overlaps the snapshot copy with the write:
#: one for the copy, one for the writer, the rest for the training process's own threads.
_OVERLAP_MIN_CORES = 4



@dataclass
class _Job:
    """A save's background work: ``write`` (staged state -> store) or ``drain``."""

    kind: Literal["write", "drain"]
    step: int
    future: Future[Any]
    started: float
    reported: bool = False


@dataclass
class _Target:
    where: Literal["local", "remote"]
    reason: str = ""


class _SerialRunner:
    """Runs jobs one after another on a background thread that exists only while there
    is work (so an idle Checkpointer holds no thread)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[Future[Any], Any, tuple[Any, ...]]] = (
            collections.deque())
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last: threading.Thread | None = None

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._queue.append((future, fn, args))
            if self._thread is None:
                # not a daemon: the interpreter finishes a pending save before it exits
                self._thread = threading.Thread(target=self._run, name=self._name)
                self._last = self._thread
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def join(self) -> None:
        """Wait until the queue is empty and the thread has exited (call it only when no
        other thread submits)."""
        while True:
            with self._lock:
                thread = self._last
            if thread is None:
                return
            thread.join()
            with self._lock:
                if self._last is thread and self._thread is None:
                    return


class _SaveFailed(Exception):
    def __init__(self, error: BaseException, landed: bool | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.landed = landed


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
    """

    def __init__(
        self,
        root_uri: str,
        *,
        keep_last: int | None = None,
        async_mode: Literal["thread", "process"] | None = None,
        staging: StagingOptions | Stager | dict[str, bool] | bool | Any = None,
        local_tier: str | os.PathLike[str] | None = None,
        keep_last_local: int | None = 1,
        drain_retries: int = 2,
        drain_policy: Literal["latest", "every"] = "latest",
        incremental: bool = False,
        process_group: Any = None,
        backend: str | None = None,
        **options: Any,
    ) -> None:
        if incremental and local_tier:
            raise ValueError(
                "incremental=True cannot be combined with local_tier: a local step would "
                "reference local siblings that the drain does not copy to the root, and a "
                "remote step's references must point at remote siblings. Use one of the two"
            )
        if {"base", "base_required", "frozen"} & set(options):
            raise ValueError("the Checkpointer picks the base of each save itself (the "
                             "newest committed step, with incremental=True) and takes "
                             "frozen keys from AppState(frozen_hint=True); do not pass "
                             "base=, base_required= or frozen=")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if keep_last_local is not None and keep_last_local < 1:
            raise ValueError(f"keep_last_local must be >= 1 or None, got {keep_last_local}")
        if async_mode not in (None, "thread", "process"):
            raise ValueError(f"async_mode must be None, 'thread' or 'process', got {async_mode!r}")
        if drain_retries < 0:
            raise ValueError(f"drain_retries must be >= 0, got {drain_retries}")
        if drain_policy not in ("latest", "every"):
            raise ValueError(f"drain_policy must be 'latest' or 'every', got {drain_policy!r}")
        if async_mode is not None and staging is False:
            raise ValueError("async saves need staging (the snapshot save() returns after); "
                             "leave staging=None or pass StagingOptions")
        self.root_uri = str(root_uri).rstrip("/")
        self.keep_last = keep_last
        self.keep_last_local = keep_last_local
        self.async_mode = async_mode
        self.local_tier = os.path.abspath(os.fspath(local_tier)) if local_tier else None
        self.drain_retries = drain_retries
        self.drain_policy = drain_policy
        self.incremental = incremental
        self._frozen: dict[int, tuple[str, ...]] = {}  # per step being saved
        self.backend_name = backend
        self.options = options
        self._extensions = options.get("_extensions")
        self._extension_registry = options.get("_extension_registry")
        self._given = {k: v for k, v in options.items()
                       if k not in ("_extensions", "_extension_registry")}
        self._resolved_root: tuple[Resolved, Backend] | None = None
        self._resolve_lock = threading.Lock()
        if self.local_tier is None:
            self._resolve_root()
        # else on first use: a resume from the local tier then never imports the root's
        # store client library (botocore & co. take a while to import)
        self.process_group = process_group
        self._async_group: Any = None
        self.stager: Stager | None = None
        if isinstance(staging, Stager):
            self.stager = staging
        elif async_mode is not None or staging not in (None, False):
            self.stager = Stager(as_staging_options(staging, process=async_mode == "process"))
        self._worker: BackgroundWriter | None = None
        if async_mode == "process":
            self._worker = BackgroundWriter()  # starts importing torch while training runs
        # only with cores to spare: where copy, writer and the rest of the training process
        # share fewer, the writer slows down the copy that training waits for and gains
        # nothing in time to durable (measured on 2 cores: blocked grew 2-4x)
        self.overlap_copy = (async_mode == "process"
                             and cores_per_local_rank() >= _OVERLAP_MIN_CORES)
        self._runner = _SerialRunner("dcpstore-ckpt")
        # drains run on their own thread (and gloo group): the write of step N+1 to the
        # local tier does not queue behind the drain of step N
        self._drainer = _SerialRunner("dcpstore-drain")
        self._drain_group: Any = None
        #: steps committed locally whose drain has not finished (local retention spares
        #: them; read on the coordinator)
        self._undrained: set[int] = set()
        #: steps committed locally whose drain job has not decided yet, in commit order
        #: (= drain order); the coordinator's decides which drains are skipped (latest
        #: wins), for every rank
        self._local_ready: dict[int, None] = {}
        self._ready_lock = threading.Lock()
        #: Steps committed in the local tier whose drain was skipped because a newer
        #: step was committed locally before it started (``drain_policy="latest"``).
        self.skipped_drains: list[int] = []
        self._jobs: list[_Job] = []
        self._lock = threading.Lock()
        #: Timings of the last save: ``blocked_s`` (in ``save``), ``durable_s`` (until
        #: committed at ``root_uri``; set once known), ``where`` it was first committed.
        self.last_timings: dict[str, Any] = {}
        #: Where the last :meth:`load` read from: ``step``, ``where`` (``"local"`` or
        #: ``"remote"``), ``uri`` and ``seconds``.
        self.last_load: dict[str, Any] = {}
        self._closed = False
        # steps this process saw committed at the root (no HEAD needed to list them)
        self._known: set[int] = set()
        self._pointer_step = -1  # the step of the last latest pointer written here
        self._pointer_lock = threading.Lock()  # a drain and a save may both publish

    def _resolve_root(self) -> tuple[Resolved, Backend]:
        with self._resolve_lock:
            if self._resolved_root is None:
                try:
                    resolved = resolve(self.root_uri, backend=self.backend_name,
                                       role="checkpointer", **self._given)
                except TypeError as exc:
                    raise TypeError(f"Checkpointer({self.root_uri!r}): {exc}") from None
                self._resolved_root = (resolved, resolved.open_backend())
            return self._resolved_root

    @property
    def _resolved(self) -> Resolved:
        return self._resolve_root()[0]

    @property
    def _root(self) -> Backend:
        return self._resolve_root()[1]

    def __repr__(self) -> str:
        tier = f", local_tier={self.local_tier!r}" if self.local_tier else ""
        return f"Checkpointer({self._root.uri!r}, keep_last={self.keep_last}{tier})"

    # -- queries -----------------------------------------------------------------------

    def step_uri(self, step: int) -> str:
        """URI of the checkpoint of ``step`` at the root."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return f"{self.root_uri}/{step_dir(step)}"

    def local_step_path(self, step: int) -> str | None:
        """Path of ``step`` in the local tier (``None`` without one)."""
        if self.local_tier is None:
            return None
        return os.path.join(self.local_tier, step_dir(step))

    def steps(self) -> list[Step]:
        """Committed steps, oldest first, each a :class:`~dcpstore.Step` (an ``int``
        whose ``where`` says ``"local"``, ``"remote"`` or ``"both"``).

        A step counts as local only when every rank's local tier holds it. The root is
        listed once, by the coordinator (one delimiter listing of the step directories
        and one HEAD per directory it has not seen committed); the answer is shared
        with every rank.
        """
        remote: list[int] = self._shared(self._remote_steps)
        if self.local_tier is None:
            return [Step(s, local=False, remote=True) for s in remote]
        mine = set(local_committed_steps(self.local_tier))
        local = set.intersection(*self._all_gather(mine))
        remote_set = set(remote)
        return [Step(s, local=s in local, remote=s in remote_set)
                for s in sorted(local | remote_set)]

    def latest(self) -> Step | None:
        """The newest step committed anywhere every rank can reach, or ``None``.

        At the root the coordinator reads the latest pointer, checks it against that
        step's ``.metadata`` and looks for newer step directories in one delimiter
        listing (a pointer update lost in a crash is noticed); without a usable pointer
        it falls back to the listing. Never an uncommitted step.
        """
        newest_remote: int | None = self._shared(self._remote_latest)
        if self.local_tier is None:
            return None if newest_remote is None else Step(newest_remote, local=False,
                                                           remote=True)
        mine = set(local_committed_steps(self.local_tier))
        local = set.intersection(*self._all_gather(mine))
        candidates = local | ({newest_remote} if newest_remote is not None else set())
        if not candidates:
            return None
        newest = max(candidates)
        return Step(newest, local=newest in local, remote=newest == newest_remote)

    def _remote_steps(self) -> list[int]:
        """Committed steps at the root (coordinator)."""
        found = _committed_steps(self._root, self._known)
        self._known = set(found)
        return found

    def _remote_latest(self) -> int | None:
        """The newest committed step at the root (coordinator)."""
        found = find_latest(self._root)
        if found is not None:
            self._known.add(found)
        return found

    def _publish_latest(self, step: int, save_id: str | None,
                        metadata_size: int | None = None) -> None:
        """Coordinator, after ``step`` committed at the root: point latest at it.

        A failure is logged, not raised: the step is committed, and ``latest()`` finds
        it by listing when the pointer lags.
        """
        self._known.add(step)
        try:
            with self._pointer_lock:
                if step < self._pointer_step:
                    return  # an older step committed late (a drain): the pointer stays newer
                if metadata_size is None:
                    metadata_size = self._root.stat(
                        f"{step_dir(step)}/{layout.METADATA_KEY}").size
                if not save_id:
                    raise DcpstoreError(f"step {step} has no dcpstore save id")
                write_pointer(self._root, Pointer(step, save_id, metadata_size))
                self._pointer_step = step
        except Exception as exc:
            logger.warning("could not update the latest pointer of %s to step %d (%s); "
                           "latest() finds it by listing", self.root_uri, step, exc)

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
        self._resolve_root()  # an unknown option is reported before anything is written
        self._settle(keep_last_drain=True)
        if self.incremental:
            self._frozen = {step: frozen_keys(state)}
        if self.async_mode == "process":
            self._check_worker()
        target = self._choose_target(step, state)
        if self.async_mode is None:
            staged = state
            if self.stager is not None:
                staged = self.stager.stage(state)
                self.stager.synchronize()
            where = self._write(step, staged, target, self.process_group)
            blocked = time.perf_counter() - started
            self.last_timings = {"step": step, "blocked_s": blocked, "where": where,
                                 "durable_s": blocked if where == "remote" else None}
            if where == "local":
                self._group_for_drain()
                self._undrained.add(step)
                self._submit("drain", step, started, self._drain, step)
            return
        assert self.stager is not None
        group = self._group_for_async()
        if target.where == "local":
            self._group_for_drain()
            self._undrained.add(step)
        self.last_timings = {"step": step, "blocked_s": None, "where": target.where,
                             "durable_s": None}
        pending = self.stager.prepare(state)
        if self.overlap_copy and not pending.on_cuda:
            # the background process writes each slot as soon as it is copied: the write
            # starts now and overlaps the copy, which durable would otherwise add in full
            write = self._submit("write", step, started, self._write, step, pending.staged,
                                 target, group)
            try:
                self.stager.copy(pending)
            except BaseException:
                self._jobs[-1].reported = True  # the write fails for this very error
                raise
        else:
            # a thread's writer reads the slots as they are; CUDA copies finish on a side
            # stream (the write synchronizes with them first)
            self.stager.copy(pending)
            write = self._submit("write", step, started, self._write, step, pending.staged,
                                 target, group)
        self.last_timings["blocked_s"] = time.perf_counter() - started
        if target.where == "local":
            self._submit("drain", step, started, self._drain_after, write, step)

    def wait(self) -> None:
        """Wait until the last save is committed at the root (its drain included).

        Raises:
            CheckpointSaveError: A background save failed (its files are removed);
                :class:`BackgroundWriterDiedError` / :class:`DrainError` as in :meth:`save`.
        """
        self._settle(keep_last_drain=False)

    def load(self, state: dict[str, Any], step: int | None = None, **options: Any) -> int:
        """Load ``step`` (default: the newest committed one) into ``state``; return the step.

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
        started = time.perf_counter()
        if step is not None and step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.local_tier is None:
            if step is None:
                at_root = self.latest()
                if at_root is None:
                    raise self._not_found()
                return self._load_remote(state, int(at_root), started, options)
            return self._load_remote(state, step, started, options)

        # the root listing (step=None only) overlaps the local load
        listing: Future[list[int]] | None = None
        if step is None and self._is_coordinator():
            listing = Future()
            # resolving the root (importing its client library) happens on that thread too
            threading.Thread(target=_fill,
                             args=(listing, self._remote_latest_list),
                             name="dcpstore-list", daemon=True).start()
        if step is None:
            mine = set(local_committed_steps(self.local_tier))
        else:
            path = self.local_step_path(step)
            assert path is not None
            mine = {step} if os.path.isfile(os.path.join(path, layout.METADATA_KEY)) else set()
        common = set.intersection(*self._all_gather(mine))
        candidate = max(common) if step is None and common else step
        loaded: int | None = None
        local_error: BaseException | None = None
        if candidate is not None and candidate in common:
            try:
                if self._load_local(state, candidate, options):
                    loaded = candidate
            except DcpstoreError as exc:
                local_error = exc

        if step is not None:
            if loaded is not None:
                return self._loaded(step, "local", started)
            if local_error is not None and not self._remote_has(step):
                raise local_error
            return self._load_remote(state, step, started, options)

        remote = set(self._broadcast_result(listing))
        newest = max(remote | {loaded if loaded is not None else -1}
                     | ({candidate} if candidate is not None else set()))
        if newest < 0:
            raise self._not_found()
        if loaded is not None and loaded == newest:
            return self._loaded(loaded, "local", started)
        if newest not in remote and local_error is not None:
            raise local_error  # the newest step is local only, and its read failed
        if loaded is not None:
            logger.info("step %d is newer at %s than the local tier's %d; loading it",
                        newest, self.root_uri, loaded)
        return self._load_remote(state, newest, started, options)

    def _remote_latest_list(self) -> list[int]:
        found = self._remote_latest()
        return [] if found is None else [found]

    def _not_found(self) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(
            f"no committed checkpoint under {self.root_uri}"
            + (f" or {self.local_tier}" if self.local_tier else "")
            + "; start from scratch or check the root URI"
        )

    def _given_options(self) -> dict[str, Any]:
        given = {**self._resolved.backend_kwargs, **self._resolved.reader_options}
        if self._extension_registry is not None:
            given["_extension_registry"] = self._extension_registry
        return given

    def _load_local(self, state: dict[str, Any], step: int, options: dict[str, Any]) -> bool:
        """Load ``step`` from the local tier (collective). ``False`` (nothing read) when a
        rank's copy is not whole; raises when the read fails (a CRC32C mismatch too)."""
        path = self.local_step_path(step)
        assert path is not None
        backend = open_backend(path)
        try:
            ok = local_step_verified(backend)
        finally:
            backend.close()
        if not all(self._all_gather(ok)):
            return False
        # the reader options given for the root (keyword or URI query), without resolving
        # the root's backend
        reader_opts = _own_values(ReaderOptions, _READER, self._given,
                                  parse_uri(self.root_uri).query)
        if self._extension_registry is not None:
            reader_opts["_extension_registry"] = self._extension_registry
        try:
            load(state, path, process_group=self.process_group, **{**reader_opts, **options})
        except DcpstoreError as exc:
            logger.warning("loading step %d from the local tier %s failed (%s); reading it "
                           "from %s", step, path, exc, self.root_uri)
            raise
        return True

    def _load_remote(self, state: dict[str, Any], step: int, started: float,
                     options: dict[str, Any]) -> int:
        load(state, self.step_uri(step), process_group=self.process_group,
             backend=self.backend_name, **{**self._given_options(), **options})
        return self._loaded(step, "remote", started)

    def _loaded(self, step: int, where: str, started: float) -> int:
        uri = self.local_step_path(step) if where == "local" else self.step_uri(step)
        self.last_load = {"step": int(step), "where": where, "uri": uri,
                          "seconds": time.perf_counter() - started}
        if where == "local":
            logger.info("loaded step %d from the local tier %s", step, uri)
        return int(step)

    def _remote_has(self, step: int) -> bool:
        """Whether ``step`` is committed at the root (one existence check, shared)."""
        has: bool | None = None
        if self._is_coordinator():
            ckpt = self._root.child(step_dir(step))
            try:
                has = ckpt.exists(layout.METADATA_KEY)
            finally:
                ckpt.close()
        return bool(self._broadcast(has))

    def _shared(self, fn: Callable[[], Any], group: Any = None) -> Any:
        """``fn()`` run on the coordinator alone; its result on every rank, or its
        failure raised on every rank (no rank is left waiting in a collective)."""
        answer: tuple[str, Any] | None = None
        error: Exception | None = None
        if self._rank(self.process_group if group is None else group) == 0:
            try:
                answer = ("ok", fn())
            except Exception as exc:
                error = exc
                answer = ("err", f"{type(exc).__name__}: {exc}")
        answer = self._broadcast(answer, group)
        assert answer is not None
        if answer[0] == "ok":
            return answer[1]
        if error is not None:
            raise error
        raise DcpstoreError(f"{self.root_uri}: the coordinator's request to the store failed "
                            f"({answer[1]}); see the coordinator's log")

    def _broadcast_result(self, listing: Future[list[int]] | None) -> list[int]:
        """The coordinator's listing of the root, shared with every rank; its failure is
        raised on every rank."""
        answer: tuple[str, Any] | None = None
        error: BaseException | None = None
        if listing is not None:
            try:
                answer = ("ok", listing.result())
            except BaseException as exc:
                error = exc
                answer = ("err", f"{type(exc).__name__}: {exc}")
        answer = self._broadcast(answer)
        assert answer is not None
        if answer[0] == "ok":
            return list(answer[1])
        if error is not None:
            raise error
        raise DcpstoreError(f"listing {self.root_uri} on the coordinator failed: {answer[1]}")

    def delete(self, step: int) -> None:
        """Delete one step at the root and in the local tier (collective).

        The step stops being a checkpoint at once (its ``.metadata`` goes first); data
        files that other steps reference stay until no retained step needs them.
        """
        self._known.discard(step)
        self._shared(lambda: delete_steps(self._root, [step_dir(step)]))
        if self.local_tier is not None:
            self._delete_local([step], self.process_group)

    def close(self) -> None:
        """Wait for pending saves and drains, then release resources (the background
        process and the staging memory)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._runner.join()
            self._drainer.join()
            if self._worker is not None:
                self._worker.stop()
            if self.stager is not None:
                self.stager.close()
            if self._resolved_root is not None:
                self._resolved_root[1].close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- background work ---------------------------------------------------------------

    def _submit(self, kind: Literal["write", "drain"], step: int, started: float,
                fn: Any, *args: Any) -> Future[Any]:
        runner = self._drainer if kind == "drain" else self._runner
        future = runner.submit(self._timed, kind, step, started, fn, *args)
        self._jobs.append(_Job(kind, step, future, started))
        return future

    def _timed(self, kind: str, step: int, started: float, fn: Any, *args: Any) -> Any:
        try:
            result = fn(*args)
        finally:
            release_freed_heap()
        if ((kind == "drain" and result == "drained") or result == "remote") and \
                self.last_timings.get("step") == step:
            self.last_timings["durable_s"] = time.perf_counter() - started
        return result

    def _settle(self, *, keep_last_drain: bool) -> None:
        """Wait for background jobs (all, or all but the newest drain) and raise the
        first failure not reported yet."""
        jobs = self._jobs
        wait_for = jobs
        if keep_last_drain and self.drain_policy == "latest":
            # latest wins: drains never hold training (a queued one is skipped once a
            # newer step is committed locally); the writes are waited for
            wait_for = [j for j in jobs if j.kind == "write"]
        elif keep_last_drain and jobs and jobs[-1].kind == "drain":
            wait_for = jobs[:-1]
        errors: list[BaseException] = []
        for job in wait_for:
            try:
                job.future.result()
            except BaseException as exc:
                if not job.reported:
                    errors.append(exc)
                job.reported = True
        self._jobs = [j for j in jobs if j not in wait_for]
        for job in self._jobs:  # a drain that already failed is reported now too
            if job.future.done() and job.future.exception() is not None and not job.reported:
                job.reported = True
                errors.append(job.future.exception())  # type: ignore[arg-type]
        self._jobs = [j for j in self._jobs if not j.future.done()]
        if not self._jobs:
            self._runner.join()  # no thread outlives the work it did
            self._drainer.join()
        if not errors:
            return
        for extra in errors[1:]:
            logger.error("another background failure: %s", extra)
        first = errors[0]
        if isinstance(first, BackgroundWriterDiedError):
            self._restart_worker()
        raise first

    def _drain_after(self, write: Future[Any], step: int) -> str | None:
        try:
            where = write.result()
        except BaseException:
            self._undrained.discard(step)
            return None  # the write failed: reported by its own job
        if where == "local":
            return self._drain(step)
        self._undrained.discard(step)
        return None

    # -- choosing where a save goes ----------------------------------------------------

    def _choose_target(self, step: int, state: dict[str, Any]) -> _Target:
        if self.local_tier is None:
            return _Target("remote")
        need = int(_state_nbytes(state) * 1.1) + (16 << 20)
        why = probe_local_tier(self.local_tier, need)
        reasons = [r for r in self._all_gather(why) if r]
        if reasons:
            msg = (f"local tier unusable for step {step}: {reasons[0]}; saving it straight "
                   f"to {self.root_uri}")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return _Target("remote", reasons[0])
        return _Target("local")

    def _write(self, step: int, state: dict[str, Any], target: _Target, group: Any) -> str:
        """Write a step where ``target`` says (falling back to the root when the local
        disk refuses it); return where it was committed. Runs on every rank."""
        if self.stager is not None:
            self.stager.synchronize()
        if target.where == "local":
            try:
                self._dcp_save(step, state, self._local_writer(step), group)
                with self._ready_lock:
                    self._local_ready.pop(step, None)
                    self._local_ready[step] = None
                self._retain_local(group)
                return "local"
            except _SaveFailed as failed:
                if not is_space_or_permission_error(failed.error):
                    raise self._save_error(step, failed, self.local_step_path(step)) from \
                        failed.error
                msg = (f"local tier {self.local_tier} failed for step {step} "
                       f"({failed.error}); saving it straight to {self.root_uri}")
                logger.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        writer = self._remote_writer(step)
        try:
            self._dcp_save(step, state, writer, group)
        except _SaveFailed as failed:
            raise self._save_error(step, failed, self.step_uri(step)) from failed.error
        if writer.is_coordinator:
            size = len(writer._commit_bytes) if writer._commit_bytes is not None else None
            self._publish_latest(step, writer.save_id, size)
        self._retain(group)
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
        if self.async_mode is None and not isinstance(cause, BackgroundWriterDiedError):
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

    def _local_writer(self, step: int) -> Writer:
        path = self.local_step_path(step)
        assert path is not None
        os.makedirs(path, exist_ok=True)
        kwargs = dict(self._resolved.writer_options)
        return self._make_writer(path, None, kwargs)

    def _remote_writer(self, step: int) -> Writer:
        kwargs = {**self._resolved.backend_kwargs, **self._resolved.writer_options}
        if self.incremental:
            kwargs.update(self._incremental_options(step))
        return self._make_writer(self.step_uri(step), self.backend_name, kwargs)

    def _incremental_options(self, step: int) -> dict[str, Any]:
        """Writer options of an incremental save of ``step``: its base is the newest
        committed step (only the coordinator's writer reads it)."""
        options: dict[str, Any] = {"frozen": self._frozen.get(step, ()),
                                   "base_required": False}
        if self._is_coordinator():
            # every rank is about to enter dcp.save: a failure here must not leave the
            # others waiting, and a save without a base is always valid (a full one)
            try:
                newest = self._remote_latest()
                if newest == step:  # saving a step again: its base is the one before it
                    older = [s for s in self._remote_steps() if s < step]
                    newest = older[-1] if older else None
            except Exception as exc:
                logger.warning("cannot find the base of incremental step %d under %s (%s); "
                               "saving it in full", step, self.root_uri, exc)
                newest = None
            if newest is not None:
                options["base"] = self.step_uri(newest)
        return options

    def _make_writer(self, uri: str, backend: str | None, kwargs: dict[str, Any]) -> Writer:
        resolved = resolve(uri, backend=backend, role="writer", **kwargs)
        if self.async_mode == "process":
            if self._worker is None or not self._worker.alive():
                raise BackgroundWriterDiedError(
                    "the background writer process is not running; this save is not "
                    "committed (the next save starts a new process)")
            assert self.stager is not None
            self._worker.prepare(uri, backend, kwargs)
            return ProxyWriter(resolved.open_backend(), resolved.writer(),
                               extensions=self._extensions, rebind=resolved.rebind,
                               worker=self._worker, stager=self.stager, uri=uri,
                               backend_name=backend, worker_kwargs=kwargs)
        return Writer(resolved.open_backend(), resolved.writer(), extensions=self._extensions,
                      rebind=resolved.rebind)

    # -- process mode ------------------------------------------------------------------

    def _check_worker(self) -> None:
        dead = self._worker is None or not self._worker.alive()
        pid = self._worker.pid if self._worker else None
        dead_ranks = [r for r, d in enumerate(self._all_gather(dead)) if d]
        if not dead_ranks:
            return
        if dead:
            self._restart_worker()
        raise BackgroundWriterDiedError(
            f"the background writer process of rank(s) {dead_ranks} died since the last "
            f"save (this rank's was pid {pid}); this save was not started and nothing was "
            "committed. Call save() again to use a new background process"
        )

    def _restart_worker(self) -> None:
        if self.async_mode != "process":
            return
        if self._worker is not None and self._worker.alive():
            return
        if self._worker is not None:
            self._worker.stop()
        logger.warning("starting a new background writer process")
        self._worker = BackgroundWriter()

    # -- the drain to the root ---------------------------------------------------------

    def _drain(self, step: int) -> str:
        """Copy a locally committed step to the root; commit it there last (every rank).

        With ``drain_policy="latest"`` the coordinator first decides whether a newer
        step committed locally supersedes this one, and every rank follows its decision
        (a broadcast in the drain group): ``"skipped"`` or ``"drained"``."""
        group = self._group_for_drain()
        try:
            with self._ready_lock:
                self._local_ready.pop(step, None)
                # every step still queued drains after this one
                newer = max((m for m in self._local_ready if m > step), default=None)
            if self.drain_policy == "latest":
                newer = self._broadcast(newer if self._rank(group) == 0 else None, group)
                if newer is not None:
                    logger.info("step %d not drained: step %d is committed locally and "
                                "drains next (latest wins); step %d stays in the local tier",
                                step, newer, step)
                    self.skipped_drains.append(step)
                    return "skipped"
            self._drain_step(step)
            return "drained"
        finally:
            self._undrained.discard(step)

    def _drain_step(self, step: int) -> None:
        group = self._group_for_drain()
        local = self.local_step_path(step)
        assert local is not None
        rank = self._rank(group)
        coordinator = rank == 0
        remote = self._root.child(step_dir(step))
        problems: list[str] = []
        try:
            for attempt in range(self.drain_retries + 1):
                if attempt:
                    time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
                mine: str | None = None
                try:
                    copy_rank_files(local, remote, rank, coordinator)
                except Exception as exc:
                    mine = f"rank {rank}: {type(exc).__name__}: {exc}"
                failures = [f for f in self._all_gather(mine, group) if f]
                if not failures:
                    outcome: str | None = None
                    if coordinator:
                        try:
                            publish_step(local, remote,
                                         overwrite=self._resolved.writer().overwrite)
                        except Exception as exc:
                            outcome = f"commit: {type(exc).__name__}: {exc}"
                        else:
                            self._publish_latest(step, *_local_commit(local))
                    outcome = self._broadcast(outcome, group)
                    if outcome is None:
                        logger.info("step %d drained to %s", step, self.step_uri(step))
                        self._undrained.discard(step)
                        self._retain(group)
                        self._retain_local(group)
                        return
                    failures = [outcome]
                problems = failures
                logger.warning("drain of step %d to %s failed (attempt %d of %d): %s", step,
                               self.step_uri(step), attempt + 1, self.drain_retries + 1,
                               "; ".join(failures))
            if coordinator:
                self._discard_remote_partial(remote, local)
            raise DrainError(
                f"step {step} is committed in the local tier ({local}) but could not be "
                f"copied to {self.step_uri(step)} after {self.drain_retries + 1} attempts: "
                f"{'; '.join(problems)}. The remote's previous steps are intact; the next "
                "save drains as usual"
            )
        finally:
            remote.close()

    def _discard_remote_partial(self, remote: Backend, local: str) -> None:
        try:
            if remote.exists(layout.METADATA_KEY):
                return
            ids = {layout.save_id_of(n) for n in os.listdir(local)} - {None}
            keys = [o.key for o in remote.list("__") if layout.save_id_of(o.key) in ids]
            remote.delete(keys)
        except Exception as exc:
            logger.warning("could not remove the partial copy at %s (%s); `dcpstore gc` "
                           "will", remote.uri, exc)

    # -- retention ---------------------------------------------------------------------

    def _retain(self, group: Any = None) -> None:
        group = self.process_group if group is None else group
        if self.keep_last is None:
            return
        if self._rank(group) == 0:
            try:
                self._delete_old_steps(self.keep_last)
            except Exception as exc:  # the new step is committed: retention can wait
                logger.warning("retention under %s failed (%s); older steps stay until the "
                               "next save's retention", self.root_uri, exc)
        self._barrier(group)

    def _delete_old_steps(self, keep_last: int) -> None:
        """Coordinator: delete all but the ``keep_last`` newest committed steps."""
        dirs = self._root.list_dirs()
        steps = _committed_steps(self._root, self._known, dirs)
        self._known = set(steps)
        doomed = steps[: max(0, len(steps) - keep_last)]
        if not doomed:
            return
        logger.info("retention: deleting steps %s under %s", doomed, self.root_uri)
        self._known.difference_update(doomed)
        if self.incremental or INCREMENTAL_DIR in dirs:
            # files a kept step references stay (dcpstore.dcp.references)
            delete_steps(self._root, [step_dir(s) for s in doomed])
        else:  # no step here references another: nothing to read first
            for old in doomed:
                _delete_closing(self._root.child(step_dir(old)))

    def _retain_local(self, group: Any) -> None:
        if self.local_tier is None or self.keep_last_local is None:
            return
        doomed: list[int] | None = None
        if self._rank(group) == 0:
            local = local_committed_steps(self.local_tier)
            remote = set(self._remote_steps())
            newest_remote = max(remote, default=-1)
            keep = set(local[-self.keep_last_local:])
            undrained = set(self._undrained)
            with self._ready_lock:
                ready = list(self._local_ready)
            # latest wins: a queued step with a newer one queued after it will be skipped
            superseded = _superseded(ready) if self.drain_policy == "latest" else set()
            doomed = [s for s in local if s not in keep
                      and (s in superseded or (s not in undrained
                                               and (s in remote or s < newest_remote)))]
        doomed = self._broadcast(doomed, group)
        if doomed:
            self._delete_local(doomed, group)

    def _delete_local(self, steps: list[int], group: Any) -> None:
        """Delete local steps: ``.metadata`` first (coordinator), then every rank its own
        files, then the coordinator the rest."""
        rank = self._rank(group)
        paths = [p for p in (self.local_step_path(s) for s in steps) if p]
        if rank == 0:
            for path in paths:
                logger.info("local retention: deleting %s", path)
                _unlink(os.path.join(path, layout.METADATA_KEY))
        self._barrier(group)
        prefix = f"__{rank}_"
        for path in paths:
            for name in _listdir(path):
                if name.startswith(prefix):
                    _unlink(os.path.join(path, name))
        self._barrier(group)
        if rank == 0:
            for path in paths:
                for name in _listdir(path):
                    _unlink(os.path.join(path, name))
                with contextlib.suppress(OSError):
                    os.rmdir(path)

    # -- collectives -------------------------------------------------------------------

    def _group_for_async(self) -> Any:
        # a dedicated gloo group keeps background collectives off the training group
        return self._side_group("_async_group")

    def _group_for_drain(self) -> Any:
        # created from save() (every rank, in the same order), used by the drain thread
        return self._side_group("_drain_group")

    def _side_group(self, attr: str) -> Any:
        """The gloo group kept in ``attr``, made on first use (``None`` without
        ``torch.distributed``)."""
        if not is_distributed():
            return None
        with self._lock:
            if getattr(self, attr) is None:
                setattr(self, attr, dist.new_group(backend="gloo"))
        return getattr(self, attr)

    def _rank(self, group: Any = None) -> int:
        if not is_distributed():
            return 0
        return int(dist.get_rank(group))

    def _is_coordinator(self) -> bool:
        return self._rank(self.process_group) == 0

    def _broadcast(self, value: Any, group: Any = None) -> Any:
        if not is_distributed():
            return value
        group = self.process_group if group is None else group
        box = [value]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def _all_gather(self, value: Any, group: Any = None) -> list[Any]:
        if not is_distributed():
            return [value]
        group = self.process_group if group is None else group
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, value, group=group)
        return out

    def _barrier(self, group: Any = None) -> None:
        if is_distributed():
            dist.barrier(group=self.process_group if group is None else group)


def _state_nbytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", state)
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


def release_freed_heap() -> None:
    """Give memory that was freed in any thread's malloc arena back to the OS (glibc's
    ``malloc_trim``; nothing elsewhere).

    A background save or drain runs on several short-lived threads at once (the write,
    the drain, the copy and upload pools); glibc gives concurrent threads their own
    arenas, and a freed block inside an arena stays resident until trimmed, so without
    this the RSS of a training process grew with every save that overlapped a drain."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # releases the GIL while it runs
    except (OSError, AttributeError):  # not glibc
        return None


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


def _superseded(queued: list[int]) -> set[int]:
    """Steps of ``queued`` (drain order) that a newer step queued after them
    supersedes: their drains will be skipped."""
    out: set[int] = set()
    newest_after = -1
    for step in reversed(queued):
        if step < newest_after:
            out.add(step)
        newest_after = max(newest_after, step)
    return out


def _fill(future: Future[Any], fn: Any, *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def committed_steps(root: Backend) -> list[int]:
    """Steps under ``root`` that have a ``.metadata``, oldest first (one delimiter
    listing of the step directories, one HEAD each; see :mod:`dcpstore.training.latest`)."""
    return _committed_steps(root)


def _local_commit(local_step: str) -> tuple[str | None, int | None]:
    """Save id and ``.metadata`` size of the committed save in a local-tier step (what
    the drain published byte for byte); ``(None, None)`` when that cannot be told."""
    path = os.path.join(local_step, layout.METADATA_KEY)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - 4096))
            tail = f.read()
    except OSError:
        return None, None
    ids = {layout.save_id_of(n) for n in _listdir(local_step) if n.startswith(".dcpstore-")}
    named = [i for i in ids if i is not None and i.encode() in tail]
    return (named[0], size) if len(named) == 1 else (None, None)


def _delete_closing(ckpt: Backend) -> None:
    """:func:`delete_checkpoint`, then release the backend made for it (its client)."""
    try:
        delete_checkpoint(ckpt)
    finally:
        ckpt.close()


def delete_checkpoint(ckpt: Backend) -> int:
    """Delete a checkpoint: ``.metadata`` first (it stops being one at once), then the rest.

    Returns the number of objects deleted.
    """
    keys = [o.key for o in ckpt.list()]
    if layout.METADATA_KEY in keys:
        ckpt.delete([layout.METADATA_KEY])
    rest = [k for k in keys if k != layout.METADATA_KEY]
    ckpt.delete(rest)
    ckpt.remove_empty_dirs()
    return len(keys)
