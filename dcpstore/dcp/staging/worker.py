"""The background writer process: it maps the parent's staging arenas and runs the
data-writing part of a save (serialization, checksums, uploads) on request."""

from __future__ import annotations

import logging
import mmap
import os
import time
from multiprocessing.connection import Connection
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from dcpstore.dcp.staging.arena import _COPY_FAILED, _Arena, progress_counter
from dcpstore.dcp.staging.errors import BackgroundWriterDiedError, CheckpointSaveError
from dcpstore.dcp.writer import Writer
from dcpstore.errors import DcpstoreError
from dcpstore.storage.resolve import Resolved

__all__: list[str] = []

logger = logging.getLogger(__name__)


class _StubPlanner:
    """What the worker's :class:`Writer` needs of a planner: ``resolve_data``.

    An arena tensor is handed out once the parent has copied its slot (the parent copies
    while this process writes the slots before it).
    """

    def __init__(self, table: dict[MetadataIndex, Any], arena: _Arena | None) -> None:
        self.table = table
        self.arena = arena
        self._progress = progress_counter(arena) if arena is not None else None
        self._parent = os.getppid()

    def resolve_data(self, item: WriteItem) -> Any:
        import io

        kind, payload = self.table[item.index]
        if kind == "bytes":
            return io.BytesIO(payload)
        if kind == "arena":
            if self.arena is None or self._progress is None:
                raise DcpstoreError("background writer: no staging arena attached")
            offset, dtype, shape, slot = payload
            if slot is not None:
                self._wait_copied(slot + 1)
            return self.arena.tensor(offset, dtype, shape)
        return payload

    def _wait_copied(self, n: int) -> None:
        """Wait until the parent copied ``n`` slots (polls: a copy of one slot takes
        milliseconds at most, and this process has nothing else to do)."""
        assert self._progress is not None
        delay = 0.0001
        while True:
            copied = int(self._progress.item())
            if copied >= n:
                return
            if copied == _COPY_FAILED:
                raise CheckpointSaveError("the snapshot of the state failed in the training "
                                          "process (save() raised there); nothing of this "
                                          "save is committed")
            if os.getppid() != self._parent:
                raise BackgroundWriterDiedError("the training process is gone")
            time.sleep(delay)
            delay = min(delay * 2, 0.002)


def _worker_entry(fd: int) -> None:
    """Entry point of the background writer process (``python -c``)."""
    logging.basicConfig(level=os.environ.get("DCPSTORE_WRITER_LOG", "WARNING"))
    _worker_main(Connection(fd))


def _worker_main(conn: Any) -> None:
    """The background writer process: attach arenas, write data files on request."""
    from multiprocessing.reduction import recv_handle

    torch.set_num_threads(1)
    arena: _Arena | None = None
    # the backend of the next write, opened (client included) while the parent plans
    prepared: tuple[Resolved, Any] | None = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        op = msg[0]
        if op == "stop":
            conn.send(("ok", None))
            return
        if op == "prepare":
            if prepared is not None:
                prepared[1].close()
            prepared = _prepare_backend(msg[1])
            continue  # no answer: the parent does not wait for it
        try:
            if op == "attach":
                fd = recv_handle(conn)
                size = msg[1]
                if arena is not None:
                    arena.close()
                arena = _Arena.__new__(_Arena)
                arena.size, arena.fd, arena.pinned = size, fd, False
                arena.mm = mmap.mmap(fd, size)
                arena.view = memoryview(arena.mm)
                arena.base = torch.frombuffer(arena.view, dtype=torch.uint8).data_ptr()
                result: Any = None
            elif op == "write":
                _, resolved, extensions, plan, table = msg
                if prepared is not None and prepared[0] == resolved:
                    opened = prepared[1]
                else:
                    if prepared is not None:
                        prepared[1].close()
                    opened = resolved.open_backend()
                prepared = None
                writer = Writer(opened, resolved.writer(), extensions=extensions)
                writer.rank = plan.storage_data.rank
                try:
                    stub = cast(SavePlanner, _StubPlanner(table, arena))
                    result = writer.write_data(plan, stub).wait()
                finally:
                    writer.backend.close()
            else:
                raise DcpstoreError(f"background writer: unknown request {op!r}")
            conn.send(("ok", result))
        except BaseException as exc:  # report, keep serving
            try:
                conn.send(("err", exc))
            except Exception:
                conn.send(("err", DcpstoreError(f"{type(exc).__name__}: {exc}")))


def _prepare_backend(resolved: Resolved) -> tuple[Resolved, Any] | None:
    """Open the backend of an upcoming write and make its client now (a store client
    takes a while to create; the parent is planning the save meanwhile)."""
    uri = resolved.uri
    try:
        opened = resolved.open_backend()
    except Exception as exc:  # the write itself reports it
        logger.debug("background writer: preparing %s failed: %s", uri, exc)
        return None
    try:
        opened.client  # noqa: B018 - made for its side effect
    except NotImplementedError:
        pass  # a backend without a client (local files)
    except Exception as exc:
        logger.debug("background writer: no client for %s yet: %s", uri, exc)
    return resolved, opened
