"""Rank processes and fault hooks for the crash and overwrite tests.

``tests/test_crash.py`` kills one rank of a 2-rank gloo save with SIGKILL at a seeded
point; ``tests/test_overwrite.py`` makes one rank's write path raise during an
``overwrite=True`` save. Everything that runs inside a rank lives here, in an importable
module, so spawned (or forkserver-forked) ranks can reach it.

Crash points. A worker installs :class:`Tripwire` hooks around the library's I/O
(``Writer.write_data``, every streamed write, upload open/part/commit, ``put`` of the
manifest and of ``.metadata``, the local rename of ``.metadata``, ``get``, ``list``,
``delete``). Each hook call is one *event*. While the previous (clean) save runs, the
events are counted; then the armed save dies on the event the plan picks: the k-th one
(``mode="event"``, k drawn by the seed over the calibrated count), the first event with
a given name (``mode="named"``, e.g. right after the ``.metadata`` put) or a timer at a
seeded fraction of the calibrated save duration (``mode="timer"``). The event may also be
another rank's (``CrashPlan.trigger``): the coordinator then SIGKILLs rank 1 at, say, its
manifest put and runs on. Just before the kill, ``crash.json`` records where it struck and
whether the commit point had been passed, so the test knows which outcome (old or new
checkpoint) is allowed.

:func:`run_killable` is the launcher: it starts the ranks, notices the victim's death,
gives the surviving ranks a seeded grace period (they see gloo errors and may clean up)
or none, then SIGKILLs them; no surviving rank can hang the test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dcpstore
import dcpstore.dcp.data_file
import dcpstore.dcp.writer
import dcpstore.storage.local
import dcpstore.storage.multipart
from dcpstore.dcp import layout
from dcpstore.storage.backend import Backend, ObjectInfo, Upload

__all__ = [
    "AMBIGUOUS_FAULT",
    "BIG_SHAPE",
    "FAULTS",
    "CrashPlan",
    "Tripwire",
    "as_dict",
    "concurrent_save",
    "contrast_overwrite",
    "crash_save",
    "empty_state",
    "full_state",
    "jitter_patches",
    "load_with_torch",
    "overwrite_with_faults",
    "set_jitter",
    "shard_rows",
    "torch_overwrite_with_fault",
]

logger = logging.getLogger(__name__)

#: The big sharded tensor: 12 MiB of float32, 6 MiB per rank (S3: a multipart upload).
BIG_SHAPE = (3072, 1024)


# -- state ------------------------------------------------------------------------------


def full_state(version: int) -> dict[str, Any]:
    """The whole (unsharded) state of save ``version``; every value depends on it."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "big": torch.randn(*BIG_SHAPE, generator=g),
        "small": torch.randn(37, 5, generator=g).to(torch.bfloat16),  # uneven shards
        "ids": torch.randint(0, 2**40, (64,), generator=g),  # replicated: one rank writes it
        "meta": {"version": version, "tag": f"v{version}"},
    }


def empty_state() -> dict[str, Any]:
    """A single-process destination for :func:`full_state` (loads any version)."""
    return {
        "big": torch.zeros(*BIG_SHAPE),
        "small": torch.zeros(37, 5, dtype=torch.bfloat16),
        "ids": torch.zeros(64, dtype=torch.int64),
        "meta": {"version": -1, "tag": ""},
    }


def rank_state(version: int, world_size: int) -> dict[str, Any]:
    """This rank's part of :func:`full_state`: ``big`` and ``small`` as DTensors sharded
    over dimension 0, the rest replicated."""
    mesh = init_device_mesh("cpu", (world_size,))
    rank = dist.get_rank()
    full = full_state(version)

    def shard(t: torch.Tensor) -> DTensor:
        local = torch.chunk(t, world_size, dim=0)[rank].clone()  # Shard(0)'s split
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=t.shape, stride=t.stride())

    return {"big": shard(full["big"]), "small": shard(full["small"]), "ids": full["ids"],
            "meta": full["meta"]}


# -- crash hooks ------------------------------------------------------------------------


@dataclass(frozen=True)
class CrashPlan:
    """Where and how one rank of a save is killed.

    Attributes:
        scenario: ``"checkpointer"``: steps 1 and 2 committed (``keep_last=2``), the
            victim dies during step 3 (whose retention deletes step 1);
            ``"checkpointer_async"``: the same with ``async_mode="thread"``.
            ``"overwrite"``: version 1 committed at ``uri``, the victim dies during an
            ``overwrite=True`` save of version 2.
        uri: Checkpointer root or checkpoint URI.
        options: Writer and backend options.
        victim: Rank that dies.
        mode: ``"event"``, ``"named"``, ``"timer"`` (see the module docstring).
        fraction: Where in the save, as a fraction of the calibrated event count or
            duration (may exceed 1 a little: events after the calibrated ones).
        event: For ``mode="named"``: die at the first event with this name.
        grace: Seconds the surviving rank may run on after the victim died (0: the
            whole job is killed at once).
        env: Extra environment of the ranks (S3 credentials).
        trigger: Rank whose event fires the kill, when not the victim itself: e.g. the
            coordinator SIGKILLs rank 1 at the moment it is about to commit.
    """

    scenario: str
    uri: str
    options: dict[str, Any]
    victim: int
    mode: str
    fraction: float = 0.5
    event: str = ""
    grace: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    trigger: int | None = None


class Tripwire:
    """Counts the I/O events of a rank and, when armed, kills the victim at the chosen
    one (one per process: :data:`TRIPWIRE`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counting = False
        self.count = 0
        self.names: list[str] = []
        self.armed = False
        self.plan: CrashPlan | None = None
        self.target = 0
        self.seen = 0
        self.record = ""
        self.rank = 0
        self.in_commit = False
        self.committed = False
        self.results_sent = False
        self.timer: threading.Timer | None = None
        self.started = 0.0

    def tick(self, name: str) -> None:
        """One event; kills the victim when it is the chosen one."""
        with self.lock:
            if self.counting:
                self.count += 1
                self.names.append(name)
            if not self.armed or self.plan is None:
                return
            self.seen += 1
            if name == "put:metadata:before":
                self.in_commit = True
            elif name == "put:metadata:after":
                self.in_commit, self.committed = False, True
            elif name == "write_data:after":
                self.results_sent = True
            plan = self.plan
            if (plan.mode == "event" and self.seen == self.target) or (
                plan.mode == "named" and name == plan.event
            ):
                self.die(name)

    def arm(self, plan: CrashPlan, rank: int, calibrated: int, duration: float,
            record: str) -> None:
        """Arm for the next save (only on the rank whose events fire the kill)."""
        with self.lock:
            self.counting = False
            self.seen = 0
            self.in_commit = self.committed = self.results_sent = False
            self.rank = rank
            self.record = record
            self.started = time.monotonic()
            if rank != (plan.victim if plan.trigger is None else plan.trigger):
                return
            self.plan = plan
            self.armed = True
            self.target = max(1, round(plan.fraction * calibrated))
            if plan.mode == "timer":
                self.timer = threading.Timer(plan.fraction * duration, self._timer_fired)
                self.timer.daemon = True
                self.timer.start()

    def disarm(self) -> None:
        """Stop counting towards a kill (the armed save is over)."""
        with self.lock:
            self.armed = False
            if self.timer is not None:
                self.timer.cancel()

    def _timer_fired(self) -> None:
        with self.lock:
            if self.armed:
                self.die("timer")

    def die(self, event: str) -> None:
        """Record the crash point, then SIGKILL the victim: this process, or (when this
        rank is the trigger) the victim rank, after which this rank runs on (caller
        holds the lock)."""
        assert self.plan is not None
        victim = self.plan.victim
        record = {"rank": victim, "event": event, "trigger": self.rank, "seen": self.seen,
                  "in_commit": self.in_commit, "committed": self.committed,
                  "results_sent": self.results_sent,
                  "after_s": round(time.monotonic() - self.started, 4)}
        _write_json(self.record, record)
        if victim != self.rank:
            with open(os.path.join(os.path.dirname(self.record), f"pid{victim}")) as f:
                os.kill(int(f.read()), signal.SIGKILL)
            self.armed = False
            return
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached


TRIPWIRE = Tripwire()


def _put_kind(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    if name == layout.METADATA_KEY:
        return "metadata"
    if name.startswith(".dcpstore-"):
        return "manifest"
    return "other"


def _around(owner: Any, attr: str, before: Callable[..., str | None],
            after: bool = True) -> None:
    """Wrap ``owner.attr`` so that it ticks ``before(*args)`` (+ ``:before``/``:after``)."""
    original = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        name = before(*args, **kwargs)
        if name is None:
            return original(*args, **kwargs)
        TRIPWIRE.tick(name + (":before" if after else ""))
        result = original(*args, **kwargs)
        if after:
            TRIPWIRE.tick(name + ":after")
        return result

    setattr(owner, attr, wrapper)


def install_crash_hooks() -> None:
    """Patch the library's I/O entry points of this process with tripwire ticks."""
    _around(dcpstore.dcp.writer.Writer, "write_data", lambda *a, **k: "write_data")
    _around(dcpstore.dcp.data_file._ChecksumStream, "write", lambda *a, **k: "stream.write",
            after=False)
    _around(Backend, "open_upload", lambda *a, **k: "open_upload")
    _around(Backend, "put", lambda self, key, *a, **k: f"put:{_put_kind(key)}")
    _around(Backend, "delete", lambda *a, **k: "delete")
    _around(Backend, "get", lambda *a, **k: "get", after=False)
    _around(Backend, "list", lambda *a, **k: "list", after=False)
    _around(dcpstore.storage.local.FileUpload, "commit", lambda *a, **k: "upload.commit")
    _around(dcpstore.storage.multipart.MultipartUpload, "commit", lambda *a, **k: "upload.commit")
    _around(dcpstore.storage.multipart.MultipartUpload, "_run_part", lambda *a, **k: "part")
    # the local commit point itself: the rename of the temporary .metadata
    _around(os, "replace", lambda src, dst, *a, **k: "rename:metadata"
            if os.path.basename(str(dst)) == layout.METADATA_KEY else None)


def crash_save(rank: int, world_size: int, plan: CrashPlan, outdir: str) -> dict[str, Any]:
    """Rank function of the crash tests: clean save(s), then the armed save.

    Returns what this rank saw (if it survives): calibration and the armed save's error.
    """
    install_crash_hooks()
    opts = dict(plan.options)
    record = os.path.join(outdir, "crash.json")
    out: dict[str, Any] = {"rank": rank}
    ckpt = None
    if plan.scenario.startswith("checkpointer"):
        ckpt = dcpstore.Checkpointer(
            plan.uri, keep_last=2,
            async_mode="thread" if plan.scenario == "checkpointer_async" else None, **opts)
        ckpt.save(1, rank_state(1, world_size))
        ckpt.wait()
        state = rank_state(2, world_size)
        TRIPWIRE.counting, TRIPWIRE.count = True, 0
        started = time.monotonic()
        ckpt.save(2, state)
        ckpt.wait()
    else:
        state = rank_state(1, world_size)
        TRIPWIRE.counting, TRIPWIRE.count = True, 0
        started = time.monotonic()
        dcpstore.save(state, plan.uri, **opts)
    duration = time.monotonic() - started
    calibrated = TRIPWIRE.count
    out.update(calibrated=calibrated, duration=duration, names=TRIPWIRE.names[:400])
    TRIPWIRE.counting = False
    dist.barrier()
    new_state = rank_state(3 if ckpt is not None else 2, world_size)
    TRIPWIRE.arm(plan, rank, calibrated, duration, record)
    try:
        if ckpt is not None:
            ckpt.save(3, new_state)
            ckpt.wait()  # async: the upload ends (or fails) here
        else:
            dcpstore.save(new_state, plan.uri, overwrite=True, **opts)
        out["armed_save"] = "ok"
    except BaseException as exc:  # a dead peer: gloo errors, or a failed save
        out["armed_save"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        TRIPWIRE.disarm()
    return out


def _write_json(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically (the crash record: a survivor may be killed
    while it writes; the launcher must then find no file rather than half of one)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=str)
    os.replace(tmp, path)


# -- overwrite faults -------------------------------------------------------------------


class InjectedFault(OSError):
    """The error an injected fault raises (an ``OSError``, like a failing store)."""


#: Faults of :func:`overwrite_with_faults`: name -> (rank that fails, description).
FAULTS: dict[str, tuple[int, str]] = {
    "rank1-before-write": (1, "rank 1 fails before writing anything (write_data raises)"),
    "rank1-resolve": (1, "rank 1 fails staging its second tensor (planner raises)"),
    "rank1-mid-upload": (1, "rank 1's store write fails after 1 MiB"),
    "rank1-upload-commit": (1, "rank 1's upload commit fails (all bytes sent)"),
    "rank0-mid-upload": (0, "the coordinator's store write fails after 1 MiB"),
    "manifest-put": (0, "the coordinator's manifest put fails"),
    "metadata-put": (0, "the coordinator's .metadata put fails (nothing stored)"),
}
#: The .metadata put is applied by the store, but its response is lost (timeout): the
#: commit happened although the writer saw an error.
AMBIGUOUS_FAULT = "metadata-put-response-lost"

_ACTIVE_FAULT: str | None = None


class _FailingUpload(Upload):
    """An upload that fails once ``limit`` bytes went through (or at commit)."""

    def __init__(self, inner: Upload, limit: int | None) -> None:
        self.inner = inner
        self.key = inner.key
        self.limit = limit
        self.sent = 0

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        if self.limit is not None and self.sent + n > self.limit:
            raise InjectedFault(errno.EIO, f"injected: store write of {self.key} failed")
        self.sent += n
        return self.inner.write(data)

    def commit(self) -> ObjectInfo:
        if self.limit is None:
            raise InjectedFault(errno.EIO, f"injected: commit of {self.key} failed")
        return self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class _FailingPlanner(DefaultSavePlanner):
    """DCP's planner, except that resolving the ``fail_at``-th tensor item raises."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.resolved = 0

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            self.resolved += 1
            if self.resolved == self.fail_at:
                raise RuntimeError("injected: staging a tensor failed (out of memory)")
        return super().resolve_data(write_item)


def install_fault_hooks() -> None:
    """Patch the library in this process so that :data:`_ACTIVE_FAULT` takes effect."""
    rank = dist.get_rank()
    open_upload = Backend.open_upload
    put = Backend.put
    write_data = dcpstore.dcp.writer.Writer.write_data

    def active(name: str) -> bool:
        return name == _ACTIVE_FAULT and FAULTS.get(name, (-1, ""))[0] == rank

    def faulty_open_upload(self: Backend, key: str, **kw: Any) -> Upload:
        upload = open_upload(self, key, **kw)
        if active("rank1-mid-upload") or active("rank0-mid-upload"):
            return _FailingUpload(upload, 1024 * 1024)
        if active("rank1-upload-commit"):
            return _FailingUpload(upload, None)
        return upload

    def faulty_put(self: Backend, key: str, data: bytes, *, atomic: bool = False,
                   **conditions: Any) -> None:
        kind = _put_kind(key)
        if kind == "manifest" and active("manifest-put"):
            raise InjectedFault(errno.EIO, "injected: manifest put failed")
        if kind == "metadata" and active("metadata-put"):
            raise PermissionError(errno.EACCES, "injected: .metadata put denied")
        put(self, key, data, atomic=atomic, **conditions)
        if kind == "metadata" and _ACTIVE_FAULT == AMBIGUOUS_FAULT and rank == 0:
            raise dcpstore.StoreTimeoutError("injected: .metadata put timed out (the store "
                                             "had applied it; the response was lost)")

    def faulty_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if active("rank1-before-write"):
            raise RuntimeError("injected: rank 1 failed before writing")
        return write_data(self, plan, planner)

    Backend.open_upload = faulty_open_upload  # type: ignore[method-assign]
    Backend.put = faulty_put  # type: ignore[method-assign]
    dcpstore.dcp.writer.Writer.write_data = faulty_write_data  # type: ignore[method-assign]


@contextlib.contextmanager
def _fault(name: str | None) -> Iterator[None]:
    global _ACTIVE_FAULT
    _ACTIVE_FAULT = name
    try:
        yield
    finally:
        _ACTIVE_FAULT = None


def _snapshot(uri: str, options: dict[str, Any]) -> dict[str, str]:
    """Every object under ``uri`` with a digest of its bytes (key -> size:crc)."""
    from dcpstore.dcp.manifest import crc32c

    backend = dcpstore.open_backend(uri, **{k: v for k, v in options.items()
                                            if k != "files_per_rank"})
    out = {}
    for obj in backend.list():
        data = backend.get(obj.key)
        out[obj.key] = f"{len(data)}:{crc32c(data):08x}"
    backend.close()
    return out


def overwrite_with_faults(rank: int, world_size: int, uri: str, options: dict[str, Any],
                          faults: list[str]) -> dict[str, Any]:
    """Save version 1 at ``uri``; then, for each fault, try to overwrite it with version
    ``2 + i`` while that fault strikes. Rank 0 returns the object snapshot after version 1
    and after each failed overwrite; every rank returns the error each attempt raised
    (``None`` if the attempt succeeded)."""
    install_fault_hooks()
    dcpstore.save(rank_state(1, world_size), uri, **options)
    dist.barrier()
    out: dict[str, Any] = {"errors": {}, "snapshots": {}}
    if rank == 0:
        out["baseline"] = _snapshot(uri, options)
    for i, name in enumerate(faults):
        state = rank_state(2 + i, world_size)
        planner = _FailingPlanner(2) if FAULTS.get(name, (-1,))[0] == rank \
            and name == "rank1-resolve" else None
        with _fault(name):
            try:
                dcpstore.save(state, uri, overwrite=True, planner=planner, **options)
                out["errors"][name] = None
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                out["errors"][name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        if rank == 0:
            out["snapshots"][name] = _snapshot(uri, options)
        dist.barrier()
    return out


def torch_overwrite_with_fault(rank: int, world_size: int, path: str, fault: str
                               ) -> str | None:
    """The same overwrite with torch's own ``FileSystemWriter(overwrite=True)``: save
    version 1, then overwrite with version 2 while ``fault`` strikes rank 1. Returns the
    error this rank saw (``None`` if the save succeeded)."""
    dcp.save(rank_state(1, world_size), storage_writer=FileSystemWriter(path))
    dist.barrier()
    writer = FileSystemWriter(path, overwrite=True)
    planner = None
    if rank == 1 and fault == "rank1-before-write":
        def fail(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("injected: rank 1 failed before writing")
        writer.write_data = fail  # type: ignore[method-assign]
    elif rank == 1 and fault == "rank1-resolve":
        planner = _FailingPlanner(2)
    try:
        dcp.save(rank_state(2, world_size), storage_writer=writer, planner=planner)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return None


def contrast_overwrite(rank: int, world_size: int, torch_path: str, uri: str,
                       fault: str) -> dict[str, str | None]:
    """The same failed overwrite twice in one process group: with torch's
    ``FileSystemWriter(overwrite=True)`` at ``torch_path`` and with dcpstore at ``uri``
    (version 1 saved first, version 2 attempted while ``fault`` strikes rank 1)."""
    out: dict[str, str | None] = {"torch": torch_overwrite_with_fault(rank, world_size,
                                                                       torch_path, fault)}
    dist.barrier()
    result = overwrite_with_faults(rank, world_size, uri, {}, [fault])
    out["dcpstore"] = result["errors"][fault]
    return out


# -- concurrent saves -------------------------------------------------------------------


_JITTER = threading.local()


def set_jitter(key: str | None) -> None:
    """Seed this thread's random delays before store requests (``None``: none)."""
    _JITTER.rng = None if key is None else random.Random(key)


def jitter_patches() -> list[tuple[Any, str, Any]]:
    """``(owner, name, wrapper)`` triples that add a random 0-20 ms delay before
    ``get``/``put``/``open_upload``/``delete`` in threads that called
    :func:`set_jitter`: concurrent saves then interleave differently per seed."""
    patches = []
    for name in ("get", "put", "open_upload", "delete"):
        original = getattr(Backend, name)

        def wrapper(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            rng = getattr(_JITTER, "rng", None)
            if rng is not None:
                time.sleep(rng.uniform(0, 0.02))
            return _original(*args, **kwargs)

        patches.append((Backend, name, wrapper))
    return patches


def concurrent_save(rank: int, world_size: int, uri: str, options: dict[str, Any],
                    version: int, rendezvous: str, jobs: int, seed: int) -> str | None:
    """One of ``jobs`` independent jobs saving to the same ``uri`` with
    ``overwrite=True``: all jobs start together (a file rendezvous in the directory
    ``rendezvous``), with seeded jitter. Returns the error this rank saw (``None``:
    saved)."""
    for owner, name, wrapper in jitter_patches():
        setattr(owner, name, wrapper)
    set_jitter(f"{seed}-{version}-{rank}")
    state = rank_state(version, world_size)
    dist.barrier()
    if rank == 0:
        Path(rendezvous, f"ready-{version}").touch()
        deadline = time.monotonic() + 120
        while len(os.listdir(rendezvous)) < jobs and time.monotonic() < deadline:
            time.sleep(0.005)
    dist.barrier()
    try:
        dcpstore.save(state, uri, overwrite=True, **options)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return None


def load_with_torch(path: str) -> dict[str, Any]:
    """Load a checkpoint with torch's ``FileSystemReader`` in this (single) process."""
    out = empty_state()
    dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
    return out


def shard_rows(world_size: int = 2) -> list[tuple[int, int]]:
    """Row ranges of ``big`` held by each rank (``Shard(0)``, torch's even split)."""
    rows = BIG_SHAPE[0]
    step = -(-rows // world_size)
    return [(r * step, min(rows, (r + 1) * step)) for r in range(world_size)]


def as_dict(plan: CrashPlan) -> dict[str, Any]:
    """A plan as a dict, for log lines."""
    return {k: v for k, v in dataclasses.asdict(plan).items() if k not in ("env", "options")}
