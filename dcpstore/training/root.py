"""The run's root URI as the Checkpointer sees it: its backend (set up on first use when
there is a local tier), the steps committed there, and the latest pointer that the
coordinator writes after each commit (:mod:`dcpstore.training.latest`).

The step queries here run on whichever rank asks: each confirms what it returns against
the store (no step is trusted because this process once saw it committed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from dcpstore.dcp import layout
from dcpstore.errors import DcpstoreError
from dcpstore.storage.backend import Backend
from dcpstore.storage.resolve import Resolved, resolve
from dcpstore.training.config import CheckpointerConfig
from dcpstore.training.latest import (
    Pointer,
    committed_steps,
    confirm_committed,
    find_latest,
    step_dir,
    write_pointer,
)

__all__ = ["Root"]

logger = logging.getLogger(__name__)


class Root:
    """The root of a run: one per Checkpointer.

    Args:
        config: The Checkpointer's settings. Without a local tier the root is resolved
            at once (an unknown option fails the Checkpointer's creation); with one, on
            first use, so that a resume from the local tier never imports the root's
            store client library (botocore & co. take a while to import).
    """

    def __init__(self, config: CheckpointerConfig) -> None:
        self._config = config
        self._resolved: tuple[Resolved, Backend] | None = None
        self._resolve_lock = threading.Lock()
        self._pointer_step = -1  # the step of the last latest pointer written here
        self._pointer_lock = threading.Lock()  # a drain and a save may both publish
        if config.local_tier is None:
            self.resolve()

    def resolve(self) -> tuple[Resolved, Backend]:
        """The root's resolved URI and its backend, made on the first call.

        Raises:
            TypeError: An option (keyword or URI query) is unknown.
        """
        with self._resolve_lock:
            if self._resolved is None:
                uri = self._config.root_uri
                try:
                    resolved = resolve(uri, backend=self._config.backend_name,
                                       role="checkpointer", **self._config.given)
                except TypeError as exc:
                    raise TypeError(f"Checkpointer({uri!r}): {exc}") from None
                self._resolved = (resolved, resolved.open_backend())
            return self._resolved

    @property
    def is_resolved(self) -> bool:
        """Whether the root's backend is set up yet."""
        return self._resolved is not None

    @property
    def resolved(self) -> Resolved:
        """The root's URI resolved with the Checkpointer's options."""
        return self.resolve()[0]

    @property
    def backend(self) -> Backend:
        """The root's backend."""
        return self.resolve()[1]

    @property
    def failure(self) -> str:
        """What the other ranks raise when the coordinator's request to the root fails."""
        return f"{self._config.root_uri}: the coordinator's request to the store failed"

    def committed(self, names: Iterable[str] | None = None,
                  known: Iterable[int] = ()) -> list[int]:
        """Steps committed at the root, oldest first, each confirmed by a HEAD of its
        ``.metadata`` (see :func:`~dcpstore.training.latest.committed_steps`).

        Args:
            names: The directories under the root, listed already.
            known: Steps the caller committed a moment ago (not checked again).
        """
        return committed_steps(self.backend, known, names)

    def confirm(self, steps: list[int]) -> list[bool]:
        """Whether each of ``steps`` is committed at the root (one HEAD each)."""
        return confirm_committed(self.backend, steps)

    def newest(self) -> int | None:
        """The newest step committed at the root (the latest pointer, checked)."""
        return find_latest(self.backend)

    def has(self, step: int) -> bool:
        """Whether ``step`` is committed at the root (one existence check)."""
        ckpt = self.backend.child(step_dir(step))
        try:
            return ckpt.exists(layout.METADATA_KEY)
        finally:
            ckpt.close()

    def publish_latest(self, step: int, save_id: str | None,
                       metadata_size: int | None = None) -> None:
        """Coordinator, after ``step`` committed at the root: point latest at it.

        A failure is logged, not raised: the step is committed, and ``latest()`` finds
        it by listing when the pointer lags.
        """
        try:
            with self._pointer_lock:
                if step < self._pointer_step:
                    return  # an older step committed late (a drain): the pointer stays newer
                if metadata_size is None:
                    metadata_size = self.backend.stat(
                        f"{step_dir(step)}/{layout.METADATA_KEY}").size
                if not save_id:
                    raise DcpstoreError(f"step {step} has no dcpstore save id")
                write_pointer(self.backend, Pointer(step, save_id, metadata_size))
                self._pointer_step = step
        except Exception as exc:
            logger.warning("could not update the latest pointer of %s to step %d (%s); "
                           "latest() finds it by listing", self._config.root_uri, step, exc)

    def close(self) -> None:
        """Release the root's backend, if it was set up."""
        if self._resolved is not None:
            self._resolved[1].close()
