"""Rank side of the stall suite (:mod:`benchmarks.stall`): what one rank does for one
system.

A *save* job is a short training run: ``saves`` checkpoints in a row, each followed by
a compute step of fixed work, exactly as a trainer would checkpoint every N steps::

    for k in 1..saves:
        barrier                      # the ranks enter the save together
        t0; saver.save(k, state); blocked_k = now - t0
        compute step                 # flips bits of every parameter in place, then matmuls
    saver.finish()                   # untimed: wait until the last save is durable

- **blocked**: how long ``save`` kept the training loop from going on, including
  waiting for the previous save where the library does (``Checkpointer.save`` waits for
  the previous async save; torch allows one ``dcp.async_save`` in flight). That wait is
  also timed apart (**waited**) so the table shows how much of blocked it was.
- **durable**: from the moment the save could start (``t0`` plus the wait for the
  previous save) until the step's commit marker (``step-<k>/.metadata``) is visible in
  the store, seen by a watcher thread on rank 0 that polls for it (``stat``
  on local disk, ``HEAD`` on S3, every 20 / 50 ms): the same check for every system,
  whatever it reports about itself. With a local tier, the *remote* commit counts.
- **peak extra memory per rank**: a thread samples the rank's process tree every 20 ms
  (the rank and every helper process it started, e.g. a background writer): anonymous
  resident memory of each, plus the largest shared-memory mapping of any of them
  (shared pages counted once). Save ``k``'s peak is the highest sample while it is in
  flight, minus the sample just before the first save.
- The compute step XORs a mantissa bit pattern into every parameter *in place* right
  after ``save`` returns (an optimizer step touching all of them), then runs a fixed
  number of 256x256 matmuls (``compute_iters``), or, with ``compute_idle_s``, sleeps
  that long instead (a GPU step, which leaves the host CPU to the background save).
  A save that had not snapshotted the state when it returned writes torn values, and
  the bit-exact load of the last step catches it.

A *load* job loads the last step into a zeroed state and checks it bit-exact. The
``resume-*`` systems are the restart measurements (their loads run in freshly started
rank processes).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, cast

from .adapters import OpContext, Operation, System, split_variant
from .workload import RankState

__all__ = ["MASK", "STALL_SYSTEMS", "StallSystem", "get", "names", "step_name", "toggle"]

logger = logging.getLogger(__name__)

#: XORed into every float32 parameter by the compute step (mantissa bits only: the values
#: stay finite and in +-[1, 2)).
MASK = 0x0055AA55
_MATMUL = 256


def step_name(step: int) -> str:
    """Directory of a step, the same for every system: ``step-000000003``."""
    return f"step-{step:09d}"


def toggle(state: RankState) -> None:
    """Flip :data:`MASK` in every local shard of ``state``, in place (its own inverse)."""
    import torch

    for dt in state.source().values():
        dt.to_local().view(torch.int32).bitwise_xor_(MASK)


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # any import problem means no CUDA
        return False


# -- memory of the rank's process tree -----------------------------------------------------


def _status_kib(pid: int) -> tuple[int, int]:
    """(RssAnon, RssShmem) of ``pid`` in bytes; (0, 0) when it is gone."""
    anon = shmem = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith(b"RssShmem:"):
                    shmem = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return anon, shmem


class TreeMemory:
    """Samples the memory of this process and its descendants in a thread.

    ``samples`` holds ``(perf_counter, bytes)``; bytes = the sum of anonymous resident
    memory over the tree plus the largest resident shared-memory mapping of any one
    process of it.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="stall-mem")
        self._children: list[int] = []
        self._children_at = 0.0

    def measure(self) -> int:
        """One sample now."""
        import psutil

        now = time.perf_counter()
        if now - self._children_at > 0.25:
            with contextlib.suppress(psutil.Error):
                self._children = [p.pid for p in psutil.Process().children(recursive=True)]
            self._children_at = now
        anon, shmem = _status_kib(os.getpid())
        for pid in self._children:
            a, s = _status_kib(pid)
            anon += a
            shmem = max(shmem, s)
        return anon + shmem

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.perf_counter(), self.measure()))

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()

    def peak(self, t0: float, t1: float) -> int:
        """Highest sample in ``[t0, t1]`` (the nearest one when none falls inside)."""
        inside = [b for t, b in self.samples if t0 <= t <= t1]
        if inside:
            return max(inside)
        if not self.samples:
            return 0
        return min(self.samples, key=lambda s: abs(s[0] - t1))[1]


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# -- durable: the commit marker, seen from rank 0 ------------------------------------------


class MarkerWatcher:
    """Polls for ``<root>/<path>/step-<k>/.metadata`` of the steps it is told about."""

    def __init__(self, ctx: OpContext, path: str) -> None:
        self.ctx = ctx
        self.path = path
        self.seen: dict[int, float] = {}
        self._wanted: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client: Any = None
        self.interval = 0.02
        if ctx.store.kind == "s3":
            import boto3
            from botocore.config import Config

            self._client = boto3.session.Session().client(
                "s3", endpoint_url=ctx.store.endpoint_url, region_name=ctx.store.region,
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                              connect_timeout=5, read_timeout=10))
            self.interval = 0.05
        self._thread = threading.Thread(target=self._loop, daemon=True, name="stall-marker")
        self._thread.start()

    def want(self, step: int) -> None:
        """Start watching for ``step``."""
        with self._lock:
            self._wanted.add(step)

    def _exists(self, step: int) -> bool:
        rel = f"{self.path}/{step_name(step)}/.metadata"
        if self._client is None:
            return os.path.exists(os.path.join(self.ctx.store.root, rel))
        try:
            self._client.head_object(Bucket=self.ctx.store.root, Key=rel)
            return True
        except Exception:  # 404 (not yet) or a transient error: poll again
            return False

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                wanted = sorted(self._wanted)
            for step in wanted:
                if self._exists(step):
                    now = time.perf_counter()
                    with self._lock:
                        self._wanted.discard(step)
                        self.seen[step] = now

    def forget(self, steps: list[int]) -> None:
        """Stop watching for ``steps`` (they never become durable)."""
        with self._lock:
            self._wanted.difference_update(steps)

    def wait_all(self, timeout: float) -> None:
        """Wait until every wanted step was seen (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._wanted:
                    return
            time.sleep(self.interval)

    def close(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join()
        if self._client is not None:
            self._client.close()


# -- savers --------------------------------------------------------------------------------


class Saver:
    """One system's save loop primitives (built untimed, before the first save)."""

    #: ``save`` returns only once the step is durable (no marker to wait for).
    durable_on_return: bool = False

    def wait_previous(self) -> None:
        """Wait for the previous save where ``save`` would wait for it anyway (timed
        apart, as part of blocked, to show how much of blocked was waiting)."""

    def save(self, step: int, state_dict: dict[str, Any]) -> Future[Any] | None:
        """Start saving ``step``; return once training may continue (a future that
        completes when the library says the save is done, if it has one)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait until every save is done (untimed)."""

    def close(self) -> None:
        """Release everything (untimed)."""

    def figures(self) -> dict[str, Any]:
        """System-specific figures for the results."""
        return {}

    def timed(self) -> float | None:
        """Seconds the last :meth:`save` itself reports as blocked (the copy limit's
        fastest repetition); ``None``: blocked is the wall time around ``save``."""
        return None

    def skipped(self) -> list[int]:
        """Steps that never become durable by design (a local tier's superseded drains);
        known after :meth:`finish`."""
        return []


#: Copies per save of the copy limit; the fastest one is its figure.
COPY_REPEATS = 3


class CopyLimitSaver(Saver):
    """The limit: one copy of the rank's share into preallocated memory, at its fastest.

    - The destination is one arena (an anonymous mapping, as dcpstore's stager uses in
      thread mode) allocated and written once before the first save, so no copy pays
      for page faults: every save is the steady state of a reused staging buffer.
    - The copy is torch's ``copy_`` with ``threads`` intra-op threads (the rank's own
      setting, or more where the rank has idle cores to itself).
    - Each save copies ``repeats`` times; its blocked figure is the fastest copy
      (:meth:`timed`), all of them are kept (``copy_repeats_s``).

    Args:
        tensors: The rank's local tensors (its share of the state).
        threads: Intra-op threads during the copy.
        repeats: Copies per save.
    """

    durable_on_return = True

    def __init__(self, tensors: list[Any], *, threads: int = 1,
                 repeats: int = COPY_REPEATS) -> None:
        import mmap

        import torch

        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.threads = max(1, threads)
        self.repeats = repeats
        self._sources = [t.contiguous() for t in tensors]
        size = max(1, sum(t.nbytes for t in self._sources))
        self._mm: Any = mmap.mmap(-1, size)
        view = memoryview(self._mm)
        torch.frombuffer(view, dtype=torch.uint8).fill_(0)  # fault every page in now
        self.destinations = []
        offset = 0
        for t in self._sources:
            self.destinations.append(
                torch.frombuffer(view[offset:offset + t.nbytes], dtype=t.dtype).view(t.shape)
                if t.nbytes else torch.empty_like(t))
            offset += t.nbytes
        self.repeat_seconds: list[float] = []

    def save(self, step: int, state_dict: dict[str, Any]) -> None:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                for src, dst in zip(self._sources, self.destinations, strict=True):
                    dst.copy_(src)
                times.append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
        self.repeat_seconds = times
        return None

    def timed(self) -> float | None:
        """The fastest copy of the last save (its blocked figure)."""
        return min(self.repeat_seconds) if self.repeat_seconds else None

    def close(self) -> None:
        self.destinations = []
        self._sources = []
        with contextlib.suppress(BufferError):
            self._mm.close()


class CheckpointerSaver(Saver):
    """``dcpstore.Checkpointer`` (blocking, thread, process, local tier)."""

    def __init__(self, root: str, kwargs: dict[str, Any]) -> None:
        import dcpstore

        self.ckpt = dcpstore.Checkpointer(root, **kwargs)
        self.durable_on_return = kwargs.get("async_mode") is None and not kwargs.get(
            "local_tier")
        # Checkpointer.save waits for the previous async save; with a local tier it may
        # not wait for the previous drain, so nothing is waited for apart there
        self._wait_apart = kwargs.get("async_mode") is not None and not kwargs.get(
            "local_tier")

    def wait_previous(self) -> None:
        if self._wait_apart:
            self.ckpt.wait()

    def save(self, step: int, state_dict: dict[str, Any]) -> None:
        self.ckpt.save(step, state_dict)
        return None

    def finish(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()

    def skipped(self) -> list[int]:
        return [int(s) for s in getattr(self.ckpt, "skipped_drains", [])]

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {"drains_skipped": self.skipped()}
        stager = getattr(self.ckpt, "stager", None)
        if stager is not None and hasattr(stager, "allocations"):
            out["staging_allocations"] = int(stager.allocations)
        timings = getattr(self.ckpt, "last_timings", None)
        if timings:
            out["last_timings"] = dict(timings)
        return out


_ASYNC_GROUP: list[Any] = []


def _async_group() -> Any:
    """One extra gloo group per rank process for torch's background collectives (as
    torch's docs recommend), so they never interleave with the training group's."""
    import torch.distributed as dist

    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


class TorchAsyncSaver(Saver):
    """``dcp.async_save`` with one storage writer reused for every step
    (``checkpoint_id`` per save) and, optionally, one persistent stager."""

    def __init__(self, writer: Any, uri: Callable[[int], str], process: bool,
                 stager: Any = None) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.writer = writer
        self.uri = uri
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.stager = stager
        self.group = _async_group()
        if process:
            import multiprocessing

            # the benchmark's ranks are daemonic processes, which multiprocessing forbids
            # to start children; torch's checkpoint process must be the rank's child
            cast(Any, multiprocessing.current_process())._config.pop("daemon", None)
        self._pending: Future[Any] | None = None

    def wait_previous(self) -> None:
        if self._pending is not None:
            self._pending.result()  # one save in flight at a time, as torch asks

    def save(self, step: int, state_dict: dict[str, Any]) -> Future[Any]:
        import torch.distributed.checkpoint as dcp

        self.wait_previous()
        response = dcp.async_save(state_dict, checkpoint_id=self.uri(step),
                                  storage_writer=self.writer, process_group=self.group,
                                  async_checkpointer_type=self.kind, async_stager=self.stager)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()  # the state is only safe to modify once staged
        future = cast(Future[Any], getattr(response, "upload_completion", response))
        self._pending = future
        return future

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.kind == AsyncCheckpointerType.PROCESS:
            # torch keeps one checkpoint process per rank process for good; stop it, so
            # that every job starts its background process anew, as dcpstore's does
            from torch.distributed.checkpoint import _async_process_executor as executor

            proc = executor._CHECKPOINT_PROCESS
            executor._CHECKPOINT_PROCESS = None
            if proc is not None:
                proc.__del__()  # sends TERMINATE and joins (what torch runs on collection)


# -- systems -------------------------------------------------------------------------------


def _uri(ctx: OpContext, path: str) -> str:
    if ctx.store.kind == "local":
        return os.path.join(ctx.store.root, path)
    return f"s3://{ctx.store.root}/{path}"


def _dcpstore_options(ctx: OpContext) -> dict[str, Any]:
    if ctx.store.kind == "s3":
        # the same request settings as s3fs below: unsigned payload, checksums only
        # where required
        return {"endpoint_url": ctx.store.endpoint_url, "region": ctx.store.region,
                "unsigned_payload": True}
    return {}


def _s3fs_options(ctx: OpContext) -> dict[str, Any]:
    return {"endpoint_url": ctx.store.endpoint_url,
            "client_kwargs": {"region_name": ctx.store.region},
            "config_kwargs": {"s3": {"payload_signing_enabled": False,
                                     "addressing_style": "path"},
                              "request_checksum_calculation": "when_required",
                              "response_checksum_validation": "when_required"}}


#: Settings of every botocore-based client, stated in the report.
REQUEST_SETTINGS = ("botocore clients (dcpstore S3 backend, s3fs): UNSIGNED-PAYLOAD "
                    "(payload_signing_enabled=False), request/response checksums "
                    "'when_required', path-style addressing; s3torchconnector (CRT): "
                    "its defaults, path-style")


class StallSystem(System):
    """A system of the stall suite (see the module docstring)."""

    kinds: ClassVar[tuple[str, ...]] = ("local", "s3")
    #: Run only where CUDA is available (pinned staging).
    needs_cuda: bool = False
    #: Its checkpoints are loaded back (and checked) after the saves.
    loads: ClassVar[bool] = True

    def unavailable(self) -> str | None:
        if self.needs_cuda and not _has_cuda():
            return ("n/a (no CUDA: torch's cached staging pins memory)"
                    if self.variant.endswith("cached") else "n/a (no CUDA)")
        return super().unavailable()

    def saver(self, ctx: OpContext, state: RankState) -> Saver:
        """Build the saver (untimed)."""
        raise NotImplementedError

    def load_into(self, ctx: OpContext, destination: dict[str, Any], step: int) -> None:
        """Load ``step`` into ``destination``."""
        raise NotImplementedError

    def watch_root(self, ctx: OpContext) -> OpContext:
        """The store whose commit markers mean durable (default: the job's)."""
        return ctx

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        saves = int(ctx.options.get("saves", 5))
        iters = int(ctx.options.get("compute_iters", 100))
        idle_s = float(ctx.options.get("compute_idle_s", 0.0))
        saver = self.saver(ctx, state)
        watcher = None
        if ctx.rank == 0 and not saver.durable_on_return:
            watcher = MarkerWatcher(self.watch_root(ctx), ctx.path)
        return Operation(lambda: _save_loop(ctx, state, saver, watcher, saves, iters, idle_s),
                         close=lambda: _close_all(saver, watcher))

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        saves = int(ctx.options.get("saves", 5))
        destination = state.destination()

        def run() -> dict[str, Any]:
            self.load_into(ctx, destination, saves)
            return {"step": saves}

        return Operation(run, verify=lambda: _verify(state, saves),
                         close=state.release_destination)


def _close_all(saver: Saver, watcher: MarkerWatcher | None) -> None:
    try:
        saver.close()
    finally:
        if watcher is not None:
            watcher.close()


def _verify(state: RankState, step: int) -> bool:
    """Bit-exact check of a loaded step: step ``k`` was saved after ``k - 1`` toggles."""
    odd = (step - 1) % 2 == 1
    if odd:
        toggle(state)
    try:
        return state.verify()
    finally:
        if odd:
            toggle(state)


def _compute(state: RankState, a: Any, b: Any, c: Any, iters: int, idle_s: float) -> None:
    import torch

    toggle(state)
    if idle_s > 0:
        time.sleep(idle_s)  # a GPU step: the host CPU is free meanwhile
    for _ in range(iters):
        torch.mm(a, b, out=c)


def _stamp(done: dict[int, float], step: int) -> Callable[[Future[Any]], None]:
    """A done-callback recording when ``step``'s future completed."""
    def callback(_future: Future[Any]) -> None:
        done[step] = time.perf_counter()

    return callback


def _save_loop(ctx: OpContext, state: RankState, saver: Saver, watcher: MarkerWatcher | None,
               saves: int, iters: int, idle_s: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    sd = state.source()
    g = torch.Generator().manual_seed(ctx.rank)
    a, b = (torch.rand(_MATMUL, _MATMUL, generator=g) for _ in range(2))
    c = torch.empty(_MATMUL, _MATMUL)
    done: dict[int, float] = {}
    rows: list[dict[str, Any]] = []
    memory = TreeMemory()
    _trim()
    baseline = memory.measure()
    memory.start()
    toggles = 0
    try:
        for k in range(1, saves + 1):
            dist.barrier()
            t0 = time.perf_counter()
            saver.wait_previous()
            tw = time.perf_counter()
            future = saver.save(k, sd)
            t1 = time.perf_counter()
            blocked = t1 - t0
            extra: dict[str, Any] = {}
            own = saver.timed()
            if own is not None:  # the copy limit: its fastest repetition
                blocked = tw - t0 + own
                extra["copy_repeats_s"] = list(getattr(saver, "repeat_seconds", []))
            if watcher is not None:
                watcher.want(k)
            if future is not None:
                future.add_done_callback(_stamp(done, k))
            _compute(state, a, b, c, iters, idle_s)
            toggles += 1
            rows.append({"step": k, "t0": t0, "tw": tw, "blocked_s": blocked,
                         "waited_s": tw - t0, "compute_s": time.perf_counter() - t1,
                         **extra})
        f0 = time.perf_counter()
        saver.finish()
        finish_s = time.perf_counter() - f0
        skipped = set(saver.skipped())
        if watcher is not None:
            watcher.forget(sorted(skipped))
            watcher.wait_all(timeout=120.0)
        end = time.perf_counter()
    finally:
        memory.stop()
        if toggles % 2:
            toggle(state)  # leave the cached state as built
    for row in rows:
        tw = row.pop("tw")
        # durable: from the moment the save could start (the previous one out of the way)
        if row["step"] in skipped:  # superseded locally: never drained to the store
            row["durable_s"] = None
            row["skipped"] = True
        elif saver.durable_on_return:
            row["durable_s"] = row["blocked_s"] - row["waited_s"]
        elif watcher is not None:
            seen = watcher.seen.get(row["step"])
            row["durable_s"] = None if seen is None else seen - tw
        if row["step"] in done:
            row["done_s"] = done[row["step"]] - tw
    for i, row in enumerate(rows):
        t0 = row["t0"]
        # in flight until durable (rank 0 knows) or until the next save starts; a skipped
        # save until the newer step that superseded it is durable
        nxt = rows[i + 1]["t0"] if i + 1 < len(rows) else end
        until = max(t0 + row["blocked_s"], nxt)
        if row.get("durable_s") is not None:
            until = max(t0 + row["blocked_s"], t0 + row["durable_s"])
        elif row.get("skipped"):
            later = next((r for r in rows[i + 1:] if r.get("durable_s") is not None), None)
            if later is not None:
                until = max(until, later["t0"] + later["durable_s"])
        row["peak_extra_bytes"] = max(0, memory.peak(t0, until) - baseline)
    for row in rows:
        del row["t0"]
    return {"saves": rows, "finish_s": finish_s, "baseline_bytes": baseline,
            "end_extra_bytes": max(0, memory.measure() - baseline),
            "compute_iters": iters, **saver.figures()}


class CopyLimit(StallSystem):
    name = "copy-limit"
    is_limit = True
    loads = False
    description = ("one copy of the rank's share into preallocated memory (pre-faulted, "
                   "reused; the fastest of 3 copies per save)")

    def saver(self, ctx: OpContext, state: RankState) -> Saver:
        import torch

        # the rank's threads, or its share of the cores where that is more
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        threads = max(torch.get_num_threads(), cores // max(1, ctx.world_size))
        repeats = int(ctx.options.get("copy_repeats", COPY_REPEATS))
        return CopyLimitSaver([dt.to_local() for dt in state.source().values()],
                              threads=threads, repeats=repeats)


class DcpstoreCheckpointer(StallSystem):
    """``dcpstore.Checkpointer``; the variant picks the mode and staging."""

    name = "dcpstore"
    is_dcpstore = True
    requires = ("dcpstore",)
    description = "dcpstore.Checkpointer"
    MODES: ClassVar[dict[str, dict[str, Any]]] = {
        "blocking": {"async_mode": None},
        "thread": {"async_mode": "thread"},
        "process": {"async_mode": "process"},
        "process-shm": {"async_mode": "process", "staging": {"use_shared_memory": True}},
        "thread-pinned": {"async_mode": "thread", "staging": {"use_pinned_memory": True}},
    }

    def __init__(self, variant: str = "") -> None:
        super().__init__(variant or "blocking")
        if self.variant not in self.MODES:
            raise KeyError(f"dcpstore[{variant}]: modes are {', '.join(self.MODES)}")
        self.needs_cuda = "pinned" in self.variant

    def kwargs(self, ctx: OpContext) -> dict[str, Any]:
        """Checkpointer arguments."""
        kw = {**_dcpstore_options(ctx), **self.MODES[self.variant]}
        staging = kw.get("staging")
        if isinstance(staging, dict):
            import dcpstore

            kw["staging"] = dcpstore.StagingOptions(**staging)
        return kw

    def saver(self, ctx: OpContext, state: RankState) -> Saver:
        return CheckpointerSaver(_uri(ctx, ctx.path), self.kwargs(ctx))

    def load_into(self, ctx: OpContext, destination: dict[str, Any], step: int) -> None:
        import dcpstore

        kw = {k: v for k, v in self.kwargs(ctx).items()
              if k not in ("async_mode", "staging")}
        with dcpstore.Checkpointer(_uri(ctx, ctx.path), **kw) as ckpt:
            ckpt.load(destination, step=step)


def tier_dir(ctx: OpContext) -> str:
    """The node-local tier of a job: next to the local store's checkpoints."""
    local_root = ctx.options.get("local_root")
    if not local_root:
        raise ValueError("the local-tier systems need the local store (local_root)")
    return os.path.join(local_root, ctx.path.replace("/", "_") + "-tier")


class DcpstoreTier(DcpstoreCheckpointer):
    """``Checkpointer(remote, local_tier=<local dir>)``: durable = committed remotely."""

    name = "dcpstore-tier"
    kinds: ClassVar[tuple[str, ...]] = ("s3",)
    description = "dcpstore.Checkpointer with local_tier (remote commit = durable)"
    MODES: ClassVar[dict[str, dict[str, Any]]] = {
        "blocking": {"async_mode": None},
        "thread": {"async_mode": "thread"},
    }

    def kwargs(self, ctx: OpContext) -> dict[str, Any]:
        return {**super().kwargs(ctx), "local_tier": tier_dir(ctx)}

    def saver(self, ctx: OpContext, state: RankState) -> Saver:
        saver = CheckpointerSaver(_uri(ctx, ctx.path), self.kwargs(ctx))
        saver.durable_on_return = False
        return saver


class TorchAsync(StallSystem):
    """``dcp.async_save`` with torch's writer for the store: ``FileSystemWriter``
    (``sync_files=True``) on local disk, ``FsspecWriter`` over s3fs on S3.

    Variants: ``thread`` / ``process``, each with ``-cached`` (the writer's own
    ``cache_staged_state_dict=True``), ``-shm`` (a persistent ``DefaultStager`` into
    shared memory) or ``-pinned`` (pinned memory: CUDA only); no suffix = the default
    staging (a fresh copy every save).
    """

    name = "torch-async"
    requires: ClassVar[tuple[str, ...]] = ("torch",)
    description = "torch dcp.async_save (FileSystemWriter / FsspecWriter over s3fs)"
    VARIANTS: ClassVar[tuple[str, ...]] = ("thread", "thread-cached", "thread-shm", "thread-pinned",
                "process", "process-shm", "process-pinned")

    def __init__(self, variant: str = "") -> None:
        super().__init__(variant or "thread")
        if self.variant not in self.VARIANTS:
            raise KeyError(f"torch-async[{variant}]: variants are {', '.join(self.VARIANTS)}")
        # torch's cache_staged_state_dict=True stages into pinned memory (CUDA only)
        self.needs_cuda = self.variant.endswith(("pinned", "cached"))

    def writer(self, ctx: OpContext, cached: bool) -> Any:
        """The storage writer (its path is set per save)."""
        if ctx.store.kind == "local":
            from torch.distributed.checkpoint import FileSystemWriter

            return FileSystemWriter(os.path.join(ctx.store.root, ctx.path), sync_files=True,
                                    cache_staged_state_dict=cached)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(f"s3://{ctx.store.root}/{ctx.path}", sync_files=False,
                            cache_staged_state_dict=cached, **_s3fs_options(ctx))

    def step_uri(self, ctx: OpContext, step: int) -> str:
        """Checkpoint id of ``step``."""
        if ctx.store.kind == "local":
            return os.path.join(ctx.store.root, ctx.path, step_name(step))
        return f"s3://{ctx.store.root}/{ctx.path}/{step_name(step)}"

    def saver(self, ctx: OpContext, state: RankState) -> Saver:
        stager = None
        if self.variant.endswith("shm") or self.variant.endswith("pinned"):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = self.variant.endswith("pinned")
            stager = DefaultStager(StagingOptions(use_pinned_memory=pinned,
                                                  use_shared_memory=True,
                                                  use_async_staging=False,
                                                  use_non_blocking_copy=pinned))
        return TorchAsyncSaver(self.writer(ctx, self.variant.endswith("cached")),
                               lambda k: self.step_uri(ctx, k),
                               self.variant.startswith("process"), stager)

    def load_into(self, ctx: OpContext, destination: dict[str, Any], step: int) -> None:
        import torch.distributed.checkpoint as dcp

        uri = self.step_uri(ctx, step)
        if ctx.store.kind == "local":
            from torch.distributed.checkpoint import FileSystemReader

            reader: Any = FileSystemReader(uri)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader = FsspecReader(uri, **_s3fs_options(ctx))
        dcp.load(destination, storage_reader=reader)


class S3TCAsync(TorchAsync):
    """s3torchconnector's ``S3StorageWriter`` under ``dcp.async_save`` (thread)."""

    name = "s3torchconnector-async"
    kinds: ClassVar[tuple[str, ...]] = ("s3",)
    requires = ("s3torchconnector", "s3torchconnectorclient")
    description = "s3torchconnector S3StorageWriter under dcp.async_save"
    VARIANTS: ClassVar[tuple[str, ...]] = ("thread", "process")

    def writer(self, ctx: OpContext, cached: bool) -> Any:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter

        # endpoint from AWS_ENDPOINT_URL (benchmarks.systems.environment)
        return S3StorageWriter(ctx.store.region, f"s3://{ctx.store.root}/{ctx.path}",
                               s3client_config=S3ClientConfig(force_path_style=True))

    def load_into(self, ctx: OpContext, destination: dict[str, Any], step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(ctx.store.region, self.step_uri(ctx, step),
                                 s3client_config=S3ClientConfig(force_path_style=True))
        dcp.load(destination, storage_reader=reader)


# -- resume after a restart ----------------------------------------------------------------


class ResumePrep(StallSystem):
    """Untimed set-up of the resume measurement: step 1 saved through a
    ``Checkpointer(remote, local_tier=...)`` (drained), and the same state saved plainly
    to the local store (``path-plain``)."""

    name = "resume-prep"
    kinds: ClassVar[tuple[str, ...]] = ("s3",)
    requires = ("dcpstore",)
    loads = False
    description = "resume set-up"

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        import dcpstore

        sd = state.source()
        local_root = ctx.options["local_root"]

        def run() -> dict[str, Any]:
            with dcpstore.Checkpointer(_uri(ctx, ctx.path), local_tier=tier_dir(ctx),
                                       **_dcpstore_options(ctx)) as ckpt:
                ckpt.save(1, sd)
                ckpt.wait()
            plain = os.path.join(local_root, ctx.path + "-plain")
            with dcpstore.Checkpointer(plain) as ckpt:
                ckpt.save(1, sd)
            return {}

        return Operation(run)


class Resume(StallSystem):
    """A load in freshly started ranks: ``tier`` (Checkpointer with the local tier that
    holds the step), ``remote`` (Checkpointer without it: reads SeaweedFS) or ``local``
    (a plain local dcpstore checkpoint)."""

    name = "resume"
    kinds: ClassVar[tuple[str, ...]] = ("s3",)
    requires = ("dcpstore",)
    description = "resume after a restart"

    def __init__(self, variant: str = "") -> None:
        super().__init__(variant or "tier")
        if self.variant not in ("tier", "remote", "local"):
            raise KeyError(f"resume[{variant}]: variants are tier, remote, local")

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        raise ValueError("resume systems only load (resume-prep saves)")

    def load_into(self, ctx: OpContext, destination: dict[str, Any], step: int) -> None:
        import dcpstore

        if self.variant == "local":
            uri, kw = os.path.join(ctx.options["local_root"], ctx.path + "-plain"), {}
        elif self.variant == "tier":
            uri = _uri(ctx, ctx.path)
            kw = {**_dcpstore_options(ctx), "local_tier": tier_dir(ctx)}
        else:
            uri, kw = _uri(ctx, ctx.path), _dcpstore_options(ctx)
        with dcpstore.Checkpointer(uri, **kw) as ckpt:
            got = ckpt.load(destination, step=step)
            # where the load read from (a listing of the root here would be timed too)
            if self.variant == "tier" and ckpt.last_load.get("where") != "local":
                raise RuntimeError(f"step {got} was not read from the local tier: "
                                   f"{ckpt.last_load}")

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        destination = state.destination()

        def run() -> dict[str, Any]:
            self.load_into(ctx, destination, 1)
            return {"step": 1}

        return Operation(run, verify=lambda: _verify(state, 1), close=state.release_destination)


# -- registry ------------------------------------------------------------------------------

STALL_SYSTEMS: dict[str, type[StallSystem]] = {cls.name: cls for cls in (
    CopyLimit, DcpstoreCheckpointer, DcpstoreTier, TorchAsync, S3TCAsync, ResumePrep, Resume,
)}


def get(label: str) -> StallSystem:
    """The stall system called ``label`` (``name`` or ``name[variant]``).

    Raises:
        KeyError: No such system or variant.
    """
    name, variant = split_variant(label)
    if name not in STALL_SYSTEMS:
        raise KeyError(f"unknown stall system {name!r}; known: {', '.join(STALL_SYSTEMS)}")
    return STALL_SYSTEMS[name](variant)


def names() -> list[str]:
    """Every stall system name."""
    return list(STALL_SYSTEMS)
