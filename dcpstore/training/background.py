"""The Checkpointer's background work: async writes on one thread, drains to the root on
another, each in submission order, and every failure reported once, by the next
``save()`` or ``wait()``.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["BackgroundJobs", "Job", "SerialRunner", "release_freed_heap"]

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """A save's background work: ``write`` (staged state -> store) or ``drain``."""

    kind: Literal["write", "drain"]
    step: int
    future: Future[Any]
    reported: bool = False


class SerialRunner:
    """Runs jobs one after another on a background thread that exists only while there
    is work (so an idle Checkpointer holds no thread).

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[Future[Any], Any, tuple[Any, ...]]] = (
            collections.deque())
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue ``fn(*args)``; its future holds the result or the exception."""
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


class BackgroundJobs:
    """The background jobs of one Checkpointer, submitted from the training thread.

    Attributes:
        writes: Runs the async writes.
        drains: Runs the drains to the root, on a thread (and gloo group) of their own:
            the write of step N+1 to the local tier does not queue behind the drain of
            step N.
        pending: Jobs not yet waited for, or waited for and still running.
    """

    def __init__(self) -> None:
        self.writes = SerialRunner("dcpstore-ckpt")
        self.drains = SerialRunner("dcpstore-drain")
        self.pending: list[Job] = []

    def submit(self, kind: Literal["write", "drain"], step: int, fn: Callable[..., Any],
               *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` as ``step``'s ``kind`` job."""
        runner = self.drains if kind == "drain" else self.writes
        future = runner.submit(_released, fn, *args)
        self.pending.append(Job(kind, step, future))
        return future

    def settle(self, *, keep_last_drain: bool, latest_wins: bool) -> None:
        """Wait for the jobs (all, or all but the drains that saves do not wait for) and
        raise the first failure not reported yet.

        Args:
            keep_last_drain: Do not wait for the newest drain (a save); with
                ``latest_wins``, for no drain at all: a queued one is skipped once a
                newer step is committed locally, so drains never hold training.
            latest_wins: The drain policy is ``"latest"``.
        """
        jobs = self.pending
        wait_for = jobs
        if keep_last_drain and latest_wins:
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
        self.pending = [j for j in jobs if j not in wait_for]
        for job in self.pending:  # a drain that already failed is reported now too
            if job.future.done() and job.future.exception() is not None and not job.reported:
                job.reported = True
                errors.append(job.future.exception())  # type: ignore[arg-type]
        self.pending = [j for j in self.pending if not j.future.done()]
        if not self.pending:
            self.join()  # no thread outlives the work it did
        if not errors:
            return
        for extra in errors[1:]:
            logger.error("another background failure: %s", extra)
        raise errors[0]

    def join(self) -> None:
        """Wait until both threads have exited (call it only when nothing submits)."""
        self.writes.join()
        self.drains.join()


def _released(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    finally:
        release_freed_heap()


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
