"""The parent's side of the background writer process: :class:`BackgroundWriter` starts
and talks to it, :class:`ProxyWriter` is the DCP ``StorageWriter`` that hands
``write_data`` to it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcpstore.dcp.staging.arena import _Arena
from dcpstore.dcp.staging.errors import BackgroundWriterDiedError
from dcpstore.dcp.staging.stager import Stager
from dcpstore.dcp.writer import Writer
from dcpstore.errors import DcpstoreError

if TYPE_CHECKING:
    from dcpstore.storage.resolve import Resolved

__all__ = ["BackgroundWriter", "ProxyWriter"]

logger = logging.getLogger(__name__)


class BackgroundWriter:
    """One persistent writer process for this rank (started once, reused every save).

    Started as ``python -c`` over a socket pair rather than with ``multiprocessing``'s
    spawn, which would re-run the training script's ``__main__``.
    """

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        code = ("from dcpstore.dcp.staging.worker import _worker_entry; "
                f"_worker_entry({child.fileno()})")
        self.process = subprocess.Popen([sys.executable, "-c", code], env=env,
                                        pass_fds=[child.fileno()], close_fds=True)
        child.close()
        self._conn = Connection(parent.detach())
        self._attached: int | None = None  # id of the arena the process has mapped
        self._lock = threading.Lock()
        logger.debug("started background writer pid %s", self.process.pid)

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process.poll() is None

    def _call(self, *msg: Any, fd: int | None = None) -> Any:
        from multiprocessing.reduction import send_handle

        with self._lock:
            try:
                self._conn.send(msg)
                if fd is not None:
                    send_handle(self._conn, fd, self.process.pid)
                while not self._conn.poll(1.0):
                    if not self.alive():
                        raise EOFError
                status, result = self._conn.recv()
            except (EOFError, OSError) as exc:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=1)
                raise BackgroundWriterDiedError(
                    f"the background writer process (pid {self.process.pid}) died "
                    f"(exit code {self.process.returncode}); this save is not committed. The "
                    "next save starts a new one; check the system log for the OOM killer "
                    "if nobody killed it"
                ) from exc
        if status == "err":
            raise result
        return result

    def attach(self, arena: _Arena) -> None:
        """Map ``arena`` into the process (once per arena)."""
        if self._attached == id(arena):
            return
        if arena.fd is None:
            raise DcpstoreError("the staging arena is not in shared memory")
        self._call("attach", arena.size, fd=arena.fd)
        self._attached = id(arena)

    def prepare(self, resolved: Resolved) -> None:
        """Let the process open the backend of the next :meth:`write` (and create its
        client) now, while this process plans the save; does not wait.

        Args:
            resolved: The save's URI, resolved once by the caller (the process does not
                resolve it again).
        """
        with self._lock:
            try:
                self._conn.send(("prepare", resolved))
            except Exception as exc:  # a dead process, say: the write itself reports it
                logger.debug("background writer: prepare not sent: %s", exc)

    def write(self, resolved: Resolved, extensions: Any, plan: SavePlan,
              table: dict[MetadataIndex, Any]) -> Any:
        """Write this rank's data files of a save to ``resolved``; return its
        ``WriteResult`` list."""
        return self._call("write", resolved, extensions, plan, table)

    def stop(self) -> None:
        """Stop the process (waits briefly, then kills it)."""
        if self.alive():
            with contextlib.suppress(Exception):
                self._call("stop")
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._conn.close()


class ProxyWriter(Writer):
    """A :class:`Writer` whose ``write_data`` runs in a :class:`BackgroundWriter`.

    Tensors staged in the shared arena travel as (offset, dtype, shape); byte items and
    any tensor outside the arena are sent by value.
    """

    def __init__(self, *args: Any, worker: BackgroundWriter, stager: Stager,
                 resolved: Resolved, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker = worker
        self.stager = stager
        self._resolved = resolved

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # the plan's assignment, with this save's id where torch took the plan from its
        # cache (the worker writes exactly what this plan says)
        assignment = self._assignment(plan)
        plan = dataclasses.replace(plan, storage_data=assignment)
        self.save_id = assignment.save_id
        arena = self.stager.arena
        table: dict[MetadataIndex, Any] = {}
        for item in plan.items:
            data: Any = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                table[item.index] = ("bytes", data.getvalue())
                continue
            offset = arena.locate(data) if arena is not None else None
            if offset is not None:
                # the worker waits for the slot's copy (save() may still be copying)
                table[item.index] = ("arena", (offset, data.dtype, tuple(data.shape),
                                               self.stager.slot_index(offset)))
            else:
                table[item.index] = ("tensor", data.detach().cpu().contiguous())
        if arena is not None:
            self.worker.attach(arena)
        results = self.worker.write(self._resolved, self.extensions, plan, table)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut
