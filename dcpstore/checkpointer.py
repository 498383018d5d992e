"""Checkpoints in a training loop: ``root/step-<n>/``, latest, retention, async saves.

::

    ckpt = dcpstore.Checkpointer("s3://bucket/run7", keep_last=3, async_mode="thread")
    start = ckpt.load({"app": AppState(model, optim)}) if ckpt.latest() is not None else 0
    for step in range(start + 1, steps + 1):
        train_step()
        if step % 100 == 0:
            ckpt.save(step, {"app": AppState(model, optim)})
    ckpt.wait()

Every method is collective when ``torch.distributed`` is initialized: call it on every
rank. Only the coordinator lists the store; the answer is broadcast.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future
from typing import Any, Literal, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from . import layout
from .api import _single_process_quiet, _unwrap, load, open_backend
from .backend import Backend
from .errors import CheckpointNotFoundError, DcpstoreError
from .reader import ReaderOptions
from .writer import Writer, WriterOptions

__all__ = ["CheckpointSaveError", "Checkpointer"]

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointSaveError(DcpstoreError):
    """A background (async) save failed; nothing of it was committed."""


class Checkpointer:
    """Save and resume a training run under one root URI.

    Args:
        root_uri: Where the run's checkpoints live; step ``n`` goes to
            ``root_uri/step-<n zero-padded to 9 digits>``.
        keep_last: Keep this many newest committed steps; older ones are deleted only
            after a new step is committed. ``None`` keeps everything.
        async_mode: ``None`` (blocking), ``"thread"`` or ``"process"``: ``save`` returns
            after staging and the upload continues in the background.
        process_group: Group for the collectives (default: the global group).
        backend: Route through this backend regardless of the scheme.
        **options: Writer/reader/backend options (see :func:`dcpstore.get_writer`).
    """

    def __init__(
        self,
        root_uri: str,
        *,
        keep_last: int | None = None,
        async_mode: Literal["thread", "process"] | None = None,
        process_group: Any = None,
        backend: str | None = None,
        **options: Any,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if async_mode not in (None, "thread", "process"):
            raise ValueError(f"async_mode must be None, 'thread' or 'process', got {async_mode!r}")
        self.root_uri = str(root_uri).rstrip("/")
        self.keep_last = keep_last
        self.async_mode = async_mode
        self.backend_name = backend
        self.options = options
        self._check_options()
        self.process_group = process_group
        self._async_group: Any = None
        self._pending: tuple[int, Writer, Future[Any]] | None = None
        self._root: Backend = open_backend(self.root_uri, backend=backend,
                                           **self._backend_options())

    def __repr__(self) -> str:
        return f"Checkpointer({self._root.uri!r}, keep_last={self.keep_last})"

    # -- queries -----------------------------------------------------------------------

    def step_uri(self, step: int) -> str:
        """URI of the checkpoint of ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return f"{self.root_uri}/{step_dir(step)}"

    def steps(self) -> list[int]:
        """Committed steps, oldest first (a step without ``.metadata`` does not count).

        Computed by the coordinator with one listing and broadcast to every rank.
        """
        result: list[int] | None = None
        if self._is_coordinator():
            result = committed_steps(self._root)
        return self._broadcast(result)

    def latest(self) -> int | None:
        """The newest committed step, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- save / load -------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step`` (collective).

        Blocking mode returns once the checkpoint is committed and retention has run.
        Async modes return after staging; :meth:`latest` shows the step only once it is
        committed. A save first waits for the previous async save (and raises if it
        failed).
        """
        self.wait()
        writer = self._writer(step)
        if self.async_mode is None:
            try:
                with _single_process_quiet():
                    dcp.save(state, storage_writer=writer, process_group=self.process_group,
                             no_dist=not _distributed())
            except CheckpointException as exc:
                if writer.is_coordinator:
                    writer.discard()
                raise _unwrap(exc) from exc
            finally:
                writer.backend.close()  # one backend per save: release its threads
            self._retain()
            return
        kind = (AsyncCheckpointerType.PROCESS if self.async_mode == "process"
                else AsyncCheckpointerType.THREAD)
        try:
            with _single_process_quiet():
                response = dcp.async_save(state, storage_writer=writer,
                                          process_group=self._group_for_async(),
                                          async_checkpointer_type=kind,
                                          no_dist=not _distributed())
        except BaseException:
            writer.backend.close()
            raise
        future = cast(Future[Any], getattr(response, "upload_completion", response))
        self._pending = (step, writer, future)

    def wait(self) -> None:
        """Wait for the pending async save; then apply retention.

        Raises:
            CheckpointSaveError: The background save failed (its files are removed).
        """
        if self._pending is None:
            return
        step, writer, future = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as exc:
            landed = writer.discard() if writer.is_coordinator else None
            cause = _unwrap(exc) if isinstance(exc, CheckpointException) else exc
            if landed:
                outcome = (f"the error came after the commit: step {step} is committed and "
                           "loads")
            elif landed is False:
                outcome = "nothing was committed and the previous checkpoint is intact"
            else:
                outcome = (f"whether step {step} was committed is decided on the coordinator; "
                           "latest() tells, and the previous checkpoint is intact either way")
            raise CheckpointSaveError(
                f"background save of step {step} to {self.step_uri(step)} failed: {cause}; "
                f"{outcome}"
            ) from cause
        finally:
            writer.backend.close()
        self._retain()

    def load(self, state: dict[str, Any], step: int | None = None, **options: Any) -> int:
        """Load ``step`` (default: the newest committed one) into ``state``; return the step.

        Raises:
            CheckpointNotFoundError: There is no committed checkpoint (or not ``step``).
        """
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.root_uri}; start from scratch or "
                    "check the root URI"
                )
        load(state, self.step_uri(step), process_group=self.process_group,
             backend=self.backend_name,
             **{**self._options_for(ReaderOptions, "_extension_registry"), **options})
        return step

    def delete(self, step: int) -> None:
        """Delete one step (coordinator only does it; collective)."""
        if self._is_coordinator():
            _delete_closing(self._root.child(step_dir(step)))
        self._barrier()

    def close(self) -> None:
        """Wait for a pending save and release resources."""
        try:
            self.wait()
        finally:
            self._root.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _backend_options(self) -> dict[str, Any]:
        from .options import option_names
        from .registry import backend_class, selected_backend_name
        from .uri import parse_uri

        cls = backend_class(selected_backend_name(parse_uri(self.root_uri).scheme,
                                                  self.backend_name))
        names = option_names(cls.Options)
        return {k: v for k, v in self.options.items() if k in names}

    def _writer(self, step: int) -> Writer:
        from .api import get_writer

        return get_writer(self.step_uri(step), backend=self.backend_name,
                          **self._options_for(WriterOptions, "_extensions"))

    def _options_for(self, own: type[Any], special: str) -> dict[str, Any]:
        """The options a writer (or reader) takes: its own, the backend's, ``special``."""
        from .options import option_names

        names = option_names(own) | set(self._backend_options()) | {special}
        return {k: v for k, v in self.options.items() if k in names}

    def _check_options(self) -> None:
        """Writer and reader options are given together; refuse names neither knows."""
        from .options import option_names

        known = (option_names(WriterOptions) | option_names(ReaderOptions)
                 | set(self._backend_options()))
        unknown = sorted(set(self.options) - known - {"_extensions", "_extension_registry"})
        if unknown:
            raise TypeError(
                f"unknown option(s) {', '.join(unknown)} for Checkpointer({self.root_uri!r}); "
                f"valid writer/reader options: {', '.join(sorted(known))} and the backend's"
            )

    def _retain(self) -> None:
        if self.keep_last is None:
            return
        if self._is_coordinator():
            steps = committed_steps(self._root)
            for old in steps[: max(0, len(steps) - self.keep_last)]:
                logger.info("retention: deleting step %d under %s", old, self.root_uri)
                _delete_closing(self._root.child(step_dir(old)))
        self._barrier()

    def _group_for_async(self) -> Any:
        # a dedicated gloo group keeps background collectives off the training group
        if not _distributed():
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _is_coordinator(self) -> bool:
        if not _distributed():
            return True
        return bool(dist.get_rank(self.process_group) == 0)

    def _broadcast(self, value: Any) -> Any:
        if not _distributed():
            return value
        box = [value]
        src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        dist.broadcast_object_list(box, src=src, group=self.process_group)
        return box[0]

    def _barrier(self) -> None:
        if _distributed():
            dist.barrier(group=self.process_group)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def step_dir(step: int) -> str:
    """Directory name of a step: ``step-000000123``."""
    return f"step-{step:09d}"


def committed_steps(root: Backend) -> list[int]:
    """Steps under ``root`` that have a ``.metadata`` (one listing)."""
    steps = set()
    for obj in root.list("step-"):
        head, _, tail = obj.key.partition("/")
        m = _STEP_RE.match(head)
        if m and tail == layout.METADATA_KEY:
            steps.add(int(m.group(1)))
    return sorted(steps)


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
    remove = getattr(ckpt, "remove_empty_dirs", None)
    if remove is not None:
        remove()
    return len(keys)
