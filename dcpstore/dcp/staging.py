"""Staging for async saves, and the persistent background writer process.

- :class:`StagingOptions` names torch's staging choices (pinned memory, shared memory,
  async staging, non-blocking copies); torch's own ``StagingOptions`` is accepted too.
- :class:`Stager` snapshots a state dict into one preallocated arena that lives across
  saves: the first save allocates it, every later save with the same layout copies into
  the same memory. The arena is shared memory (a ``memfd``) when a background process
  writes from it, so nothing is pickled per save but the plan.
- :class:`BackgroundWriter` is one persistent process per rank that runs the data-writing
  part of a save (serialization, checksums, uploads) from the shared arena, while the
  collective parts (planning, commit) stay in the parent. :class:`ProxyWriter` is the DCP
  ``StorageWriter`` that hands ``write_data`` to it.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcpstore.dcp.writer import Writer
from dcpstore.errors import DcpstoreError

__all__ = [
    "BackgroundWriter",
    "BackgroundWriterDiedError",
    "CheckpointSaveError",
    "ProxyWriter",
    "StagedState",
    "Stager",
    "StagingOptions",
    "as_staging_options",
]

logger = logging.getLogger(__name__)

_ALIGN = 64


class CheckpointSaveError(DcpstoreError):
    """A background (async) save failed; nothing of it was committed (unless the message
    says the failure came after the commit)."""


class BackgroundWriterDiedError(CheckpointSaveError):
    """The background writer process of this rank died (killed, out of memory, ...).

    The save it was writing is not committed; the next save starts a new process.
    """


@dataclasses.dataclass(frozen=True)
class StagingOptions:
    """How a save snapshots the state before the background write.

    The field names are those of torch's
    ``torch.distributed.checkpoint.staging.StagingOptions``, whose instances are accepted
    wherever this class is.

    Attributes:
        use_pinned_memory: Page-lock the staging arena, so device-to-host copies run at
            full speed and asynchronously (CUDA only; ignored without CUDA).
        use_shared_memory: Put the arena in shared memory, so a background process reads
            it without a copy (always on in ``async_mode="process"``).
        use_async_staging: CUDA: return from ``save`` once the device-to-host copies are
            queued on a side stream; the current stream waits for them, so work queued
            after ``save`` (an optimizer step) cannot change what is saved. The
            background writer waits for the copies before it reads.
        use_non_blocking_copy: Copy device tensors with ``non_blocking=True``
            (needs pinned memory to be truly asynchronous).
    """

    use_pinned_memory: bool = False
    use_shared_memory: bool = False
    use_async_staging: bool = False
    use_non_blocking_copy: bool = True


def as_staging_options(value: Any, *, process: bool = False) -> StagingOptions:
    """Normalize ``staging=`` (``None``/``True``, a mapping, torch's or our options).

    Args:
        value: What the user passed.
        process: Whether a background process reads the arena (forces shared memory).
    """
    if value is None or value is True:
        opts = StagingOptions(use_pinned_memory=torch.cuda.is_available())
    elif isinstance(value, StagingOptions):
        opts = value
    elif isinstance(value, Mapping):
        try:
            opts = StagingOptions(**value)
        except TypeError as exc:
            raise TypeError(f"staging options: {exc}; valid fields are "
                            f"{[f.name for f in dataclasses.fields(StagingOptions)]}") from None
    elif all(hasattr(value, f.name) for f in dataclasses.fields(StagingOptions)):
        opts = StagingOptions(**{f.name: bool(getattr(value, f.name))
                                 for f in dataclasses.fields(StagingOptions)})
    else:
        raise TypeError(f"staging must be None, True, a dcpstore.StagingOptions, torch's "
                        f"StagingOptions or a dict, got {type(value).__name__}")
    if process and not opts.use_shared_memory:
        opts = dataclasses.replace(opts, use_shared_memory=True)
    return opts


# -- the arena ---------------------------------------------------------------------------


class _Arena:
    """One mapping holding every staged tensor; each tensor gets its own storage."""

    def __init__(self, size: int, *, shared: bool, pinned: bool) -> None:
        self.size = max(size, _ALIGN)
        self.fd: int | None = None
        if shared:
            self.fd = os.memfd_create("dcpstore-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
            self.mm = mmap.mmap(self.fd, self.size)
        else:
            self.mm = mmap.mmap(-1, self.size)
        self.view = memoryview(self.mm)
        whole = torch.frombuffer(self.view, dtype=torch.uint8)
        whole.zero_()  # fault the pages in now, not during the first copy
        self.base = whole.data_ptr()
        self.pinned = False
        if pinned and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.base, self.size, 0)
            self.pinned = int(getattr(rc, "value", rc)) == 0
            if not self.pinned:
                logger.warning("could not pin the %d-byte staging arena (cudaHostRegister "
                               "returned %s); device copies will be synchronous", self.size, rc)
        del whole

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over ``[offset, offset + nbytes)`` with a storage of exactly that size
        (the writer would otherwise copy a view of a larger storage)."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.view[offset: offset + nbytes], dtype=dtype).view(shape)

    def locate(self, t: torch.Tensor) -> int | None:
        """Offset of ``t`` in the arena when ``t`` is a whole contiguous slot of it."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        ptr = t.data_ptr()
        if self.base <= ptr and ptr + t.nbytes <= self.base + self.size:
            return ptr - self.base
        return None

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
        # staged tensors still alive keep the mapping; it goes with them
        with contextlib.suppress(BufferError):
            self.view.release()
            self.mm.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# -- the stager --------------------------------------------------------------------------


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


#: The progress counter's value after a failed copy.
_COPY_FAILED = -1


@dataclasses.dataclass
class StagedState:
    """A state dict laid out in a :class:`Stager`'s arena (see :meth:`Stager.prepare`).

    Attributes:
        staged: The staged copy (its tensors are arena slots).
        tensors: The source tensors, in slot order.
    """

    staged: dict[str, Any]
    tensors: list[torch.Tensor]

    @property
    def on_cuda(self) -> bool:
        """Whether any tensor is on a CUDA device (copied on a side stream: a writer may
        read the slots only after :meth:`Stager.synchronize`)."""
        return any(t.device.type == "cuda" for t in self.tensors)


def progress_counter(arena: _Arena) -> torch.Tensor:
    """The shared arena's copy-progress counter: its last 8 bytes, one int64 (slots copied
    so far, or -1 after a failed copy)."""
    return arena.tensor(arena.size - 8, torch.int64, (1,))


class Stager:
    """Snapshots state dicts into one arena reused across saves.

    Args:
        options: Staging options (see :class:`StagingOptions`).

    Attributes:
        allocations: How many arenas were allocated so far (1 for a run whose state
            keeps its layout).
    """

    def __init__(self, options: StagingOptions | None = None) -> None:
        self.options = options or StagingOptions()
        self.allocations = 0
        self.arena: _Arena | None = None
        self._signature: tuple[Any, ...] | None = None
        self._slots: list[torch.Tensor] = []
        self._offsets: list[int] = []
        self._event: Any = None
        self._stream: Any = None
        self._lock = threading.Lock()
        # slots copied so far (shared arenas only; see prepare)
        self._progress: torch.Tensor | None = None

    def __repr__(self) -> str:
        size = self.arena.size if self.arena else 0
        return f"Stager({self.options}, arena={size} bytes, allocations={self.allocations})"

    @property
    def nbytes(self) -> int:
        """Size of the arena (0 before the first stage)."""
        return self.arena.size if self.arena else 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the arena; return the staged copy.

        ``Stateful`` values are turned into their ``state_dict()`` first, non-tensor
        leaves are deep-copied, tensors (and DTensors' local shards) are copied into
        preallocated slots. With ``use_async_staging`` on CUDA the copies may still be in
        flight: call :meth:`synchronize` before reading the result from another thread.
        """
        pending = self.prepare(state_dict)
        self.copy(pending)
        return pending.staged

    def prepare(self, state_dict: dict[str, Any]) -> StagedState:
        """The first half of :meth:`stage`: lay ``state_dict`` out in the arena (allocated
        on the first call or when the layout changed) and return the staged copy whose
        tensor slots :meth:`copy` fills next.

        In a shared arena a counter tells a background writer how many slots hold their
        values, so it may write the first tensors while the later ones are copied
        (:class:`ProxyWriter` waits on it); until :meth:`copy` the counter is 0.
        """
        with self._lock:
            flat = {k: (v.state_dict() if isinstance(v, Stateful) else v)
                    for k, v in state_dict.items()}
            tensors: list[torch.Tensor] = []
            _collect(flat, tensors)
            signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
            if signature != self._signature or self.arena is None:
                self._allocate(tensors, signature)
            self._set_copied(0)
            return StagedState(_rebuild(flat, iter(self._slots)), tensors)

    def copy(self, pending: StagedState) -> None:
        """The second half of :meth:`stage`: copy the tensors into their slots.

        Raises:
            Whatever the copy raises; a background writer waiting for the slots then
            fails the save instead of waiting.
        """
        with self._lock:
            try:
                with torch.no_grad():
                    if pending.on_cuda:
                        self._copy_cuda(pending.tensors)
                    else:
                        for i, (slot, src) in enumerate(
                                zip(self._slots, pending.tensors, strict=True)):
                            slot.copy_(src)
                            self._set_copied(i + 1)
            except BaseException:
                self._set_copied(_COPY_FAILED)
                raise

    def slot_index(self, offset: int) -> int | None:
        """Index of the slot holding byte ``offset`` of the arena (``None``: none does)."""
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i < 0 or offset >= self._offsets[i] + self._slots[i].nbytes:
            return None
        return i

    def _set_copied(self, n: int) -> None:
        if self._progress is not None:
            self._progress.fill_(n)

    def synchronize(self) -> None:
        """Wait for device-to-host copies still in flight (async staging)."""
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()
            self._set_copied(len(self._slots))

    def close(self) -> None:
        """Release the arena."""
        self.synchronize()
        self._slots = []
        self._offsets = []
        self._progress = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self._signature = None

    def _allocate(self, tensors: list[torch.Tensor], signature: tuple[Any, ...]) -> None:
        if self.arena is not None:
            logger.info("staging layout changed; reallocating the staging arena")
            self.close()
        offsets, size = [], 0
        for t in tensors:
            offsets.append(size)
            nbytes = t.numel() * t.element_size()
            size += -(-nbytes // _ALIGN) * _ALIGN
        shared = self.options.use_shared_memory
        self.arena = _Arena(size + (_ALIGN if shared else 0), shared=shared,
                            pinned=self.options.use_pinned_memory)
        self._slots = [self.arena.tensor(off, t.dtype, tuple(t.shape))
                       for off, t in zip(offsets, tensors, strict=True)]
        self._offsets = offsets
        self._progress = progress_counter(self.arena) if shared else None
        self._signature = signature
        self.allocations += 1
        logger.debug("allocated a %d-byte staging arena for %d tensors", size, len(tensors))

    def _copy_cuda(self, tensors: list[torch.Tensor]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        current = torch.cuda.current_stream()
        stream.wait_stream(current)  # copy the values as of now
        non_blocking = self.options.use_non_blocking_copy and bool(
            self.arena is not None and self.arena.pinned)
        with torch.cuda.stream(stream):
            for slot, src in zip(self._slots, tensors, strict=True):
                if src.device.type == "cuda":
                    src.record_stream(stream)
                slot.copy_(src, non_blocking=non_blocking)
        event = stream.record_event()
        if self.options.use_async_staging:
            current.wait_event(event)  # later in-place updates run after the copies
            self._event = event
        else:
            event.synchronize()
            self._set_copied(len(self._slots))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(_local(value))
    elif isinstance(value, Mapping):
        for v in value.values():
            _collect(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)


def _rebuild(value: Any, slots: Any) -> Any:
    if isinstance(value, torch.Tensor):
        slot = next(slots)
        if _is_dtensor(value):
            from torch.distributed.tensor import DTensor
            return DTensor(slot, value._spec, requires_grad=False)  # type: ignore[attr-defined]
        return slot
    if isinstance(value, Mapping):
        return {k: _rebuild(v, slots) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rebuild(v, slots) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, slots) for v in value)
    return copy.deepcopy(value)


# -- the background process --------------------------------------------------------------


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

    from dcpstore.storage.resolve import resolve

    torch.set_num_threads(1)
    arena: _Arena | None = None
    # the backend of the next write, opened (client included) while the parent plans
    prepared: tuple[tuple[Any, ...], Any] | None = None
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
            prepared = _prepare_backend(msg[1], msg[2], msg[3])
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
                _, uri, backend, kwargs, extensions, plan, table = msg
                resolved = resolve(uri, backend=backend, role="writer", **kwargs)
                if prepared is not None and prepared[0] == (uri, backend, kwargs):
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


def _prepare_backend(uri: str, backend: str | None,
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any] | None:
    """Open the backend of an upcoming write and make its client now (a store client
    takes a while to create; the parent is planning the save meanwhile)."""
    from dcpstore.storage.resolve import resolve

    try:
        opened = resolve(uri, backend=backend, role="writer", **kwargs).open_backend()
    except Exception as exc:  # the write itself reports it
        logger.debug("background writer: preparing %s failed: %s", uri, exc)
        return None
    try:
        opened.client  # noqa: B018 - made for its side effect
    except NotImplementedError:
        pass  # a backend without a client (local files)
    except Exception as exc:
        logger.debug("background writer: no client for %s yet: %s", uri, exc)
    return (uri, backend, kwargs), opened


class BackgroundWriter:
    """One persistent writer process for this rank (started once, reused every save).

    Started as ``python -c`` over a socket pair rather than with ``multiprocessing``'s
    spawn, which would re-run the training script's ``__main__``.
    """

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        code = f"from dcpstore.dcp.staging import _worker_entry; _worker_entry({child.fileno()})"
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

    def prepare(self, uri: str, backend: str | None, kwargs: dict[str, Any]) -> None:
        """Let the process open the backend of the next :meth:`write` (and create its
        client) now, while this process plans the save; does not wait."""
        with self._lock:
            try:
                self._conn.send(("prepare", uri, backend, kwargs))
            except Exception as exc:  # a dead process, say: the write itself reports it
                logger.debug("background writer: prepare not sent: %s", exc)

    def write(self, uri: str, backend: str | None, kwargs: dict[str, Any],
              extensions: Any, plan: SavePlan, table: dict[MetadataIndex, Any]) -> Any:
        """Write this rank's data files of a save; return its ``WriteResult`` list."""
        return self._call("write", uri, backend, kwargs, extensions, plan, table)

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
                 uri: str, backend_name: str | None, worker_kwargs: dict[str, Any],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker = worker
        self.stager = stager
        self._uri = uri
        self._backend_name = backend_name
        self._worker_kwargs = worker_kwargs

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
        results = self.worker.write(self._uri, self._backend_name, self._worker_kwargs,
                                    self.extensions, plan, table)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut
