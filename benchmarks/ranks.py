"""Long-lived torch.distributed ranks (gloo, CPU) that run the benchmark's timed jobs.

A :class:`RankPool` spawns ``world_size`` processes once; each initializes gloo and a 1-D
CPU device mesh and then runs one :class:`Job` after another (all ranks the same job),
like a trainer that checkpoints many times. Keeping the ranks alive keeps process
start-up and ``import torch`` out of every measurement and lets each rank cache the
workload it built.

Each rank measures only its own operation, between a barrier before it and its own
completion (:class:`Probe`):

- wall seconds (``time.perf_counter``);
- CPU seconds, user and system, of the whole process (all its threads:
  ``resource.getrusage(RUSAGE_SELF)``);
- peak *extra* resident memory: a thread samples ``/proc/self/statm`` every 5 ms and
  the peak is taken relative to the RSS just before the operation (after a garbage
  collection and ``malloc_trim``), so the state dict and the load destination, which
  exist before the operation, are not counted;
- local bytes read: the delta of ``rchar`` in ``/proc/self/io``.

A job that fails on any rank is reported with every rank's traceback; a pool whose
ranks do not all answer in time is killed and started again.

Memory: each rank caches the state of the last workload it ran (source and load
destination, or the source alone with ``RankPool(..., in_place=True)``, see
:class:`~.workload.RankState`) until a job with another workload arrives or
:meth:`RankPool.release` frees it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import resource
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dcpstore.testing.servers import free_port

from .workload import RankState, WorkloadSpec

if TYPE_CHECKING:
    from .servers import StoreInfo

__all__ = ["Job", "JobError", "Probe", "RankPool", "RankResult"]

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")
#: The message that makes a rank drop its cached state (:meth:`RankPool.release`).
_RELEASE = "release"


@dataclass
class Job:
    """One collective operation every rank of a pool runs.

    Attributes:
        op: ``"save"`` or ``"load"``.
        system: Name of the system (see :mod:`benchmarks.systems`).
        store: The store (picklable; for counting runs, its proxy endpoint).
        path: Checkpoint location relative to the store's root (a fresh prefix).
        workload: The state dict to save / load.
        options: Options for the system (``--opt``).
        counted: The store's endpoint is the request-counting proxy.
    """

    op: str
    system: str
    store: StoreInfo
    path: str
    workload: WorkloadSpec
    options: dict[str, Any] = field(default_factory=dict)
    counted: bool = False


@dataclass
class RankResult:
    """What one rank measured for one job.

    Attributes:
        rank: The rank.
        world_size: Ranks in the job.
        seconds: Wall time of the operation on this rank.
        cpu_user: User CPU seconds of the rank's process during the operation.
        cpu_sys: System CPU seconds.
        rss_before: Resident bytes just before the operation.
        rss_peak: Highest resident bytes sampled during the operation.
        rchar: Bytes the process read through syscalls (``/proc/self/io``).
        share_bytes: Bytes of this rank's part of the state dict.
        largest_tensor_bytes: Bytes of this rank's largest local shard.
        verified: Load: the destination is bit-exact; save: ``None``.
        extra: System-specific figures (reader bytes read/needed, part size, ...).
    """

    rank: int
    world_size: int
    seconds: float
    cpu_user: float
    cpu_sys: float
    rss_before: int
    rss_peak: int
    rchar: int
    share_bytes: int
    largest_tensor_bytes: int
    verified: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_extra_rss(self) -> int:
        """Peak resident memory the operation added."""
        return max(0, self.rss_peak - self.rss_before)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (with :attr:`peak_extra_rss`)."""
        d = asdict(self)
        d["peak_extra_rss"] = self.peak_extra_rss
        return d


class JobError(RuntimeError):
    """A job failed on at least one rank (the message has every rank's traceback)."""


# -- measurement ---------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _rchar() -> int:
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _settle() -> None:
    """Collect the garbage of what ran so far and freeze the survivors, so that the
    collection before the next measurement only walks objects created since (a full
    collection over torch's object graph takes a noticeable fraction of a second)."""
    gc.collect()
    gc.freeze()


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Probe:
    """Measure one operation of this process (see the module docstring).

    >>> with Probe(barrier=dist.barrier) as probe:
    ...     dcp.save(...)
    >>> probe.seconds, probe.peak_extra_rss
    """

    def __init__(self, barrier: Any = None, interval: float = 0.005) -> None:
        self._barrier = barrier
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rss_before = 0
        self.rss_peak = 0
        self.seconds = 0.0
        self.cpu_user = 0.0
        self.cpu_sys = 0.0
        self.rchar = 0

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            rss = _rss()
            if rss > self.rss_peak:
                self.rss_peak = rss

    def __enter__(self) -> Probe:
        gc.collect()
        _malloc_trim()
        self.rss_before = self.rss_peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="bench-rss")
        self._thread.start()
        if self._barrier is not None:
            self._barrier()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self._rchar0 = _rchar()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self._t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        self.rchar = _rchar() - self._rchar0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.rss_peak = max(self.rss_peak, _rss())
        self.cpu_user = ru1.ru_utime - self._ru0.ru_utime
        self.cpu_sys = ru1.ru_stime - self._ru0.ru_stime

    @property
    def peak_extra_rss(self) -> int:
        """Peak resident bytes added during the operation."""
        return max(0, self.rss_peak - self.rss_before)


# -- the rank process ----------------------------------------------------------------------


def _execute(job: Job, rank: int, world_size: int, mesh: Any,
             cache: dict[tuple[WorkloadSpec, int], RankState], in_place: bool) -> RankResult:
    import torch.distributed as dist

    from . import systems

    key = (job.workload, world_size)
    state = cache.get(key)
    if state is None:
        cache.clear()  # one workload at a time: the previous store's is done
        gc.collect()
        state = cache[key] = RankState(job.workload, mesh, in_place=in_place)
    system = systems.get(job.system)
    ctx = systems.OpContext(job.store, job.path, rank, world_size, job.options, job.counted)
    os.environ.update(systems.environment(ctx))
    if job.op == "save":
        op = system.prepare_save(ctx, state)
    elif job.op == "load":
        op = system.prepare_load(ctx, state)
    else:
        raise ValueError(f"unknown op {job.op!r}")
    try:
        with Probe(barrier=dist.barrier) as probe:
            extra = op.run()
        verified = None
        if job.op == "load":
            verified = bool(op.verify()) if op.verify is not None else state.verify()
    finally:
        if op.close is not None:
            op.close()
    return RankResult(
        rank=rank, world_size=world_size, seconds=probe.seconds, cpu_user=probe.cpu_user,
        cpu_sys=probe.cpu_sys, rss_before=probe.rss_before, rss_peak=probe.rss_peak,
        rchar=probe.rchar, share_bytes=state.share_bytes,
        largest_tensor_bytes=state.largest_local_bytes, verified=verified, extra=extra,
    )


def _warm_up(mesh: Any) -> None:
    """Pay the one-time costs (DTensor dispatch set-up, DCP imports) before any job."""
    import torch
    import torch.distributed.checkpoint
    from torch.distributed.tensor import DTensor, Shard

    DTensor.from_local(torch.zeros(2, 2), mesh, [Shard(0)], run_check=False)


def _worker(rank: int, world_size: int, port: int, conn: mpc.Connection,
            log_level: int, in_place: bool = False) -> None:
    logging.basicConfig(level=log_level, format=f"[rank {rank}] %(levelname)s %(name)s: "
                        "%(message)s")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    if log_level > logging.DEBUG:
        # gcsfs logs an ERROR with a traceback each time fake-gcs-server refuses its
        # moveTo request; it then falls back to copy + delete, which works
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)  # the ranks share the machine's cores, like the tests
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=900))
    mesh = init_device_mesh("cpu", (world_size,))
    _warm_up(mesh)
    cache: dict[tuple[WorkloadSpec, int], RankState] = {}
    _settle()
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        if job == _RELEASE:
            cache.clear()
            gc.collect()
            _malloc_trim()
            conn.send(("ok", _rss()))
            continue
        try:
            conn.send(("ok", _execute(job, rank, world_size, mesh, cache, in_place)))
        except BaseException as exc:  # report it; the orchestrator decides what next
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        _settle()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    conn.close()
    # native client pools (CRT, gRPC) sometimes abort during interpreter teardown
    os._exit(0)


class RankPool:
    """``world_size`` spawned rank processes running :class:`Job` s.

    Args:
        world_size: Number of ranks.
        start_timeout: Seconds to wait for every rank to be ready.
        in_place: Each rank loads into its source tensors and checks the load against
            regenerated values (:class:`~.workload.RankState`'s ``in_place``): it holds
            its share of the state once rather than twice.
    """

    def __init__(self, world_size: int, *, start_timeout: float = 180.0,
                 in_place: bool = False) -> None:
        self.world_size = world_size
        self.start_timeout = start_timeout
        self.in_place = in_place
        self._procs: list[Any] = []
        self._conns: list[mpc.Connection] = []
        self._ready = False
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker,
                            args=(rank, self.world_size, port, child, level, self.in_place),
                            name=f"bench-rank-{rank}of{self.world_size}", daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._ready = False

    def wait_ready(self) -> None:
        """Block until every rank has initialized gloo (raises if one does not)."""
        if self._ready:
            return
        answers = self._collect(self.start_timeout)
        bad = [f"rank {r}: {a}" for r, a in enumerate(answers) if a is None or a[0] != "ready"]
        if bad:
            self.close()
            raise JobError(f"{self.world_size} ranks did not start:\n" + "\n".join(map(str, bad)))
        self._ready = True

    def _collect(self, timeout: float) -> list[tuple[str, Any] | None]:
        answers: list[tuple[str, Any] | None] = [None] * self.world_size
        pending: dict[Any, int] = {conn: r for r, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for ready in mpc.wait(list(pending), timeout=left):
                r = pending.pop(ready)
                conn = self._conns[r]
                answer: tuple[str, Any]
                try:
                    answer = conn.recv()
                except EOFError:
                    answer = ("error", "the rank process died")
                answers[r] = answer
                if answer[0] == "error":
                    # the others may be stuck in a collective: give them a short grace
                    deadline = min(deadline, time.monotonic() + 20.0)
        return answers

    def run(self, job: Job, timeout: float) -> list[RankResult]:
        """Run ``job`` on every rank; return their results in rank order.

        Raises:
            JobError: A rank failed or did not answer within ``timeout`` (the pool is
                restarted, so the next job starts clean).
        """
        self.wait_ready()
        for conn in self._conns:
            conn.send(job)
        answers = self._collect(timeout)
        errors = []
        for r, a in enumerate(answers):
            if a is None:
                errors.append(f"rank {r}: no answer within {timeout:.0f} s")
            elif a[0] != "ok":
                errors.append(f"rank {r}: {a[1]}")
        if errors:
            self.restart()
            raise JobError("\n".join(errors))
        return [a[1] for a in answers if a is not None]

    def release(self, timeout: float = 60.0) -> list[int]:
        """Make every rank drop its cached state (a garbage collection and
        ``malloc_trim`` after it), so its memory is free before a larger state is built.

        Returns:
            Each rank's resident bytes afterwards, in rank order.

        Raises:
            JobError: A rank did not answer (the pool is restarted).
        """
        self.wait_ready()
        for conn in self._conns:
            conn.send(_RELEASE)
        answers = self._collect(timeout)
        if any(a is None or a[0] != "ok" for a in answers):
            self.restart()
            raise JobError(f"{self.world_size} ranks did not release their state: {answers}")
        return [int(a[1]) for a in answers if a is not None]

    def restart(self) -> None:
        """Kill the ranks and start new ones."""
        self._kill()
        self._start()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(10)
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        for c in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(None)
        deadline = time.monotonic() + 15
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
