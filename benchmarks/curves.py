"""``python -m benchmarks --curves``: how dcpstore's costs grow with world size and state
size (issue 17, item 6).

Every point of a curve is one (store, world size, state size, tensor count) with the
same machinery as the main benchmark: long-lived gloo ranks (:class:`~.ranks.RankPool`,
one pool per world size, reused by every point of that size), the stores of
:class:`~.servers.Stores`, the systems of :mod:`.systems` and the interleaved runs of
:class:`~.runner.Runner`; every load is checked bit-exact. A point's figures are
:func:`.report.summarize`'s (median time over runs, CPU s/GiB, peak extra RSS per rank)
plus what a curve needs:

- **coordinator excess CPU**: rank 0's CPU seconds minus the median of the other ranks'
  (rank 0 also plans and commits: ``prepare_global_plan``, ``finish``; the figure is the
  cost of that, measured without hooks into the library);
- **RSS per share**: peak extra RSS per rank over the rank's share of the state;
- **growth**: each figure relative to the curve's first point, per unit of work, so a
  cost that grows faster than linearly shows as a factor above 1 (flagged past 1.15).

Three series:

``world``  world size 1/2/4/8 at 1 GiB (``mixed`` sizes, 32 tensors);
``size``   state size 1/4/8 GiB at world size 2;
``many``   an optimizer-like state of many small tensors (``mixed``, 1,024 tensors: 1/4
           small vectors, the rest 1-2 MiB matrices at 1 GiB), world size 1/2/4/8.

Memory: a point must fit beside whatever else runs on the machine (24 GiB shared, for
the 8 GiB point). The ranks hold their share of the state once (``RankPool(in_place=
True)``: a load goes into the zeroed source tensors and is checked bit-exact against
values regenerated chunk by chunk) and drop it between points
(:meth:`~.ranks.RankPool.release`); SeaweedFS is replaced by a fresh server before each
of its points (its Go heap keeps its high-water mark) and the stores' Go servers run
with a soft memory limit (``GOMEMLIMIT``, ``--server-memory``). Before a point runs,
:func:`estimate_memory` predicts its peak; a point that would not fit in the memory
available then (:func:`.env.check_memory`) is skipped, with the reason in the results,
rather than left to the OOM killer. The server's peak RSS during each point is recorded
(``server`` of each point), so a reader can see when the store was the bottleneck.

Outputs under ``--out``: ``results.json``, ``results.md``, ``world.png`` (MB/s and
CPU s/GiB against world size) and ``size.png`` (against state size).

Examples::

    python -m benchmarks --curves --quick                  # < 1 min smoke run
    python -m benchmarks --curves --out benchmarks/results/curves
    python -m benchmarks --curves --series world --stores local --worlds 1 2 4 8
    python -m benchmarks --curves --render benchmarks/results/curves
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import report, systems
from .env import (
    DirtyTree,
    add_output_args,
    check_memory,
    checkout_text,
    default_out,
    machine_info,
    run_checkout,
    versions,
)
from .options import fill_defaults, options_for, parse_opts
from .ranks import JobError, RankPool
from .runner import Runner, StorePlan
from .servers import STORE_KINDS, Stores
from .workload import (
    MIXES,
    VERIFY_CHUNK_BYTES,
    WorkloadSpec,
    format_bytes,
    parse_size,
    plan_tensors,
)

__all__ = ["MEMORY_HEADROOM", "RANK_BASE_RSS", "Point", "build_points", "estimate_memory",
           "estimate_seconds", "main", "parse_args", "render_markdown", "summarize_point",
           "write_charts"]

logger = logging.getLogger(__name__)

_GiB = float(1 << 30)
#: A figure this many times its first point's value (per unit of work) is superlinear.
SUPERLINEAR = 1.15
#: Peak extra RSS below this is allocator noise, not a cost worth a finding.
_RSS_FLOOR = 64 << 20
#: Floor of the non-coordinator ranks' RSS check (their peak is small and steady).
_OTHERS_FLOOR = 16 << 20
SERIES = ("world", "size", "many")
#: Systems per store by default: dcpstore and the reference (torch's own writer) where
#: it is cheap; ``--systems`` adds others (e.g. ``limit-*``).
_DEFAULT_SYSTEMS = {"local": ["dcpstore-local", "torch-fs"], "seaweedfs": ["dcpstore-s3"],
                    "moto": ["dcpstore-s3"], "gcs": ["dcpstore-gcs"]}
# (full, quick)
_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "worlds": ([1, 2, 4, 8], [1, 2]),
    "sizes": (["1GiB", "4GiB", "8GiB"], ["16MiB", "48MiB"]),
    "base_size": ("1GiB", "16MiB"),
    "size_world": (2, 2),
    "tensors": (32, 16),
    "many_tensors": (1024, 128),
    "runs": (3, 1),
    "stores": (["local", "seaweedfs"], ["local", "seaweedfs"]),
    "series": (list(SERIES), list(SERIES)),
}

# -- the duration estimate (a quiet 2-core machine) ---------------------------------------

#: Assumed MB/s (save, load) of one point, rounded down from the quiet ``make bench`` at
#: 512 MiB and 2 ranks (local 1,015 / 5,155, SeaweedFS 192 / 972 for dcpstore).
_ASSUMED_MBPS = {"local": (700, 1500), "seaweedfs": (150, 500), "moto": (60, 120),
                 "gcs": (90, 250)}
#: Past the kernel's dirty-page budget a local save goes at the disk's speed (``dd
#: conv=fdatasync`` of 1 GiB: 177 MB/s on the 2-core machine).
_DISK_MBPS = 180
_DIRTY_BYTES = 3 << 30
#: Wall seconds per (rank x tensor) item of a save or load on 2 cores (the many series:
#: about 7 CPU s for 8 x 1,024 items per GiB at 8 ranks).
_ITEM_S = 0.45e-3
#: Per core, MB/s of building the state and of the in-place check (regenerating values).
_FILL_MBPS, _CHECK_MBPS = 1200, 1900
_POOL_START_S = 6.0  # per rank: spawn, import torch, gloo
_SERVER_START_S = 5.0  # a fresh SeaweedFS
_CORES = 2

# -- the memory estimate ------------------------------------------------------------------

_MiB = 1 << 20
#: A rank's resident memory with torch, gloo and DCP loaded and no state (300-310 MiB
#: measured on the 2-core machine).
RANK_BASE_RSS = 320 * _MiB
#: Memory left free beyond a point's predicted peak (``--memory-headroom``; the stall
#: suite keeps the same).
MEMORY_HEADROOM = 1 << 30
#: Peak extra memory per rank of a save or a load, where it is a fixed bound (measured:
#: dcpstore-s3 290-310 MiB at every world and state size; dcpstore-local 1-50 MiB).
#: ``torch-fs`` reads an item whole (its largest local shard); other peers are assumed to
#: hold their share once, and the raw limits twice (their buffer and its source).
_OP_PEAK = {"dcpstore-local": 32 * _MiB, "dcpstore-s3": 320 * _MiB,
            "dcpstore-msc": 320 * _MiB, "dcpstore-gcs": 320 * _MiB}
#: Metadata every rank holds per (rank x tensor) item of the checkpoint (DCP's global
#: ``Metadata``; the curves measured about 2.5 KiB of RSS per added rank and tensor).
_PER_ITEM = 4 << 10
#: ``weed mini``'s resident memory with no request (about 115 MiB) plus margin.
_WEED_IDLE = 256 * _MiB
#: ``weed mini``'s heap per byte of PUT bodies in flight (15 MiB single PUTs from one
#: boto3 client, on the 2-core machine): live, about 3.3x (64 in flight under a 2 GiB
#: ``GOMEMLIMIT``: 3.2 GiB); without a limit Go's collector lets it grow to about twice
#: that (8 in flight: 1.1 GiB; 32: 3.8 GiB; 4 ranks of dcpstore-s3 at 1 GiB: 1.2 GiB).
_WEED_LIVE, _WEED_UNCAPPED = 3.5, 8.0
#: Request bodies in flight per dcpstore-s3 rank at its defaults: part_size x
#: max_concurrency (8 MiB x 8; files of up to 15 MiB go up in single PUTs, 4 at once).
_S3_INFLIGHT = 64 * _MiB
#: Default soft memory limit of the stores' Go servers (``GOMEMLIMIT``): it holds weed
#: at about 1.8 GiB with 32 PUTs of 15 MiB in flight (8 ranks) instead of 3.8 GiB, with
#: no throughput cost measurable on the shared machine.
DEFAULT_SERVER_MEMORY = "2GiB"
#: Stores whose server is replaced by a fresh one before each point.
_FRESH_PER_POINT = {"seaweedfs"}
#: How a store's server process is recognized (by name or command line); moto runs in
#: a thread of this process.
_SERVER_PROCESS = {"seaweedfs": "weed", "gcs": "fake-gcs-server"}


@dataclass(frozen=True)
class Point:
    """One point of a curve.

    Attributes:
        series: ``world``, ``size`` or ``many``.
        store: Store name.
        world_size: Ranks.
        workload: The state dict.
    """

    series: str
    store: str
    world_size: int
    workload: WorkloadSpec

    @property
    def x(self) -> float:
        """The curve's x value: world size, or state GiB for the size series."""
        return self.workload.state_bytes / _GiB if self.series == "size" else self.world_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line of ``python -m benchmarks --curves``."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks --curves",
        description="Scaling curves: dcpstore's throughput, CPU and memory against world "
                    "size and state size (see docs/performance.md, 'Scaling curves').")
    p.add_argument("--quick", action="store_true",
                   help="world 1/2, 16/48 MiB, 1 run (< 1 min smoke run)")
    p.add_argument("--series", nargs="+", choices=SERIES, help="curves to run (default: all)")
    p.add_argument("--stores", nargs="+", choices=list(STORE_KINDS),
                   help="stores (default: local seaweedfs)")
    p.add_argument("--systems", nargs="+", metavar="NAME",
                   help="systems per store (default: dcpstore, plus torch-fs on local)")
    p.add_argument("--worlds", nargs="+", type=int, help="world sizes (default 1 2 4 8)")
    p.add_argument("--sizes", nargs="+", help="state sizes of the size series "
                   "(default 1GiB 4GiB 8GiB)")
    p.add_argument("--base-size", help="state size of the world and many series (1GiB)")
    p.add_argument("--size-world", type=int, help="world size of the size series (2)")
    p.add_argument("--tensors", type=int, help="tensors of the world and size series (32)")
    p.add_argument("--many-tensors", type=int, help="tensors of the many series (1024)")
    p.add_argument("--mix", choices=MIXES, default="mixed", help="tensor size mix")
    p.add_argument("--runs", type=int, help="timed runs per point (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--opt", action="append", default=[], metavar="[SCOPE.]KEY=VALUE",
                   help="as for python -m benchmarks")
    p.add_argument("--local-dir", help="directory of the local store")
    p.add_argument("--server-memory", metavar="SIZE|off",
                   help="soft memory limit (GOMEMLIMIT) of the stores' Go servers "
                        f"(weed, fake-gcs-server); default: $GOMEMLIMIT, else "
                        f"{DEFAULT_SERVER_MEMORY}")
    p.add_argument("--memory-headroom", metavar="SIZE",
                   help="memory left free beyond a point's predicted peak; a point that "
                        "would not fit is skipped (default 1GiB)")
    add_output_args(p, "curves-", "results.md and the charts")
    args = p.parse_args(argv)
    fill_defaults(args, _DEFAULTS)
    if args.runs < 1 or args.size_world < 1 or any(w < 1 for w in args.worlds):
        p.error("--runs, --size-world and --worlds must be >= 1")
    try:
        args.size_bytes = sorted(parse_size(s) for s in args.sizes)
        args.base_bytes = parse_size(args.base_size)
        args.headroom_bytes = (parse_size(args.memory_headroom) if args.memory_headroom
                               else MEMORY_HEADROOM)
        memory = args.server_memory or os.environ.get("GOMEMLIMIT") or DEFAULT_SERVER_MEMORY
        args.server_memory_bytes = None if memory.lower() == "off" else parse_size(memory)
        args.options = parse_opts(args.opt)
        for name in args.systems or []:
            systems.get(name)
    except (ValueError, KeyError) as exc:
        p.error(str(exc))
    if args.out is None:
        args.out = default_out(f"curves-{args.mode}")
    return args


def build_points(args: argparse.Namespace) -> list[Point]:
    """Every point, ordered so that each world size's pool is used in one stretch and the
    largest states come last (pools of other sizes are closed by then)."""
    points: list[Point] = []
    for store in args.stores:
        base = WorkloadSpec(args.base_bytes, tensors=args.tensors, mix=args.mix,
                            seed=args.seed)
        if "world" in args.series:
            points += [Point("world", store, w, base) for w in args.worlds]
        if "many" in args.series:
            many = WorkloadSpec(args.base_bytes, tensors=args.many_tensors, mix=args.mix,
                                seed=args.seed)
            points += [Point("many", store, w, many) for w in args.worlds]
        if "size" in args.series:
            points += [Point("size", store, args.size_world,
                             WorkloadSpec(size, tensors=args.tensors, mix=args.mix,
                                          seed=args.seed)) for size in args.size_bytes]
    # world size first (one pool at a time), then state size; stable within
    return sorted(points, key=lambda p: (p.world_size, p.workload.state_bytes))


def systems_for(store: str, wanted: list[str] | None) -> list[str]:
    """The systems run on ``store`` (available ones only)."""
    kind = STORE_KINDS[store]
    names = ([n for n in wanted if kind in systems.get(n).kinds] if wanted
             else _DEFAULT_SYSTEMS[store])
    out = []
    for name in names:
        why = systems.get(name).unavailable()
        if why:
            logger.warning("%s: skipping %s (%s)", store, name, why)
        else:
            out.append(name)
    return out


def estimate_seconds(points: list[Point], args: argparse.Namespace) -> float:
    """The duration on a quiet 2-core machine (printed before the run starts): every
    unique point's saves and loads at :data:`_ASSUMED_MBPS` (a local save past the
    kernel's dirty-page budget at the disk's speed) plus a cost per (rank x tensor)
    item, and what is not timed: rank start-up, building the state, the in-place checks
    and the fresh servers. A loaded machine takes up to 2-3x longer."""
    total = 20.0 + _POOL_START_S * sum({p.world_size for p in points})
    unique = {(p.store, p.world_size, p.workload): p for p in points}
    for p in unique.values():
        save, load = _ASSUMED_MBPS[p.store]
        state = p.workload.state_bytes
        cores = min(p.world_size, _CORES)
        save_s = state / 1e6 / save
        if p.store == "local":
            save_s += max(0, state - _DIRTY_BYTES) / 1e6 / _DISK_MBPS
        per_op = 0.5 + _ITEM_S * p.world_size * p.workload.tensors
        one = (save_s + state / 1e6 / load + 2 * per_op
               + state / 1e6 / (_CHECK_MBPS * cores))  # the untimed in-place check
        total += args.runs * len(systems_for(p.store, args.systems)) * one
        total += state / 1e6 / (_FILL_MBPS * cores)
        if p.store in _FRESH_PER_POINT:
            total += _SERVER_START_S
    return total


def _largest_local(spec: WorkloadSpec, world_size: int) -> int:
    """Bytes of the largest local shard of ``spec`` at ``world_size`` (``Shard(0)``:
    ``ceil(rows / world_size)`` rows)."""
    largest = 0
    for t in plan_tensors(spec):
        rows = t.shape[0]
        largest = max(largest, -(-rows // world_size) * (t.nbytes // max(rows, 1)))
    return largest


def _op_peak(name: str, point: Point) -> int:
    """Predicted peak extra memory per rank of ``name``'s save or load at ``point``."""
    system = systems.get(name)
    spec, world = point.workload, point.world_size
    items = _PER_ITEM * world * spec.tensors
    share = -(-spec.state_bytes // world)
    if system.name in _OP_PEAK:
        return _OP_PEAK[system.name] + items
    if system.name == "torch-fs":
        return _largest_local(spec, world) + 32 * _MiB + items
    return (2 if system.is_limit else 1) * share + 32 * _MiB + items


def _on_tmpfs(path: str) -> bool:
    """Whether ``path`` lies on a file system in memory (tmpfs, ramfs)."""
    real, best, fstype = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and \
                        len(mount) > len(best):
                    best, fstype = mount, fields[2]
    except OSError:
        return False
    return fstype in ("tmpfs", "ramfs")


def estimate_memory(point: Point, names: list[str], *, server_memory: int | None,
                    pool_running: bool = False, local_root: str | None = None
                    ) -> dict[str, int]:
    """The predicted peak memory of one point, by holder (bytes; ``total`` is the sum).

    - ``ranks``: the rank processes before any state, unless their pool runs already
      (it is then part of the memory in use);
    - ``state``: the state dict, held once (the ranks load in place);
    - ``operations``: every rank's peak extra memory of the most demanding system
      (:data:`_OP_PEAK`, the ``torch-fs`` reader's largest item, the metadata per item);
    - ``verify``: the scratch of the in-place checks;
    - ``server``: what the store's server grows by: a fresh SeaweedFS, its Go heap for the
      requests in flight (:data:`_WEED_LIVE` / :data:`_WEED_UNCAPPED` x the bodies in
      flight, bounded by ``server_memory``, its ``GOMEMLIMIT``); moto and
      fake-gcs-server keep the checkpoint in memory;
    - ``page_cache``: the local checkpoint where the local store is on tmpfs (elsewhere
      the page cache is reclaimed under pressure and is not counted).

    Args:
        point: The point.
        names: The systems run at it.
        server_memory: The Go servers' soft memory limit (``None``: none).
        pool_running: The ranks of this world size run already.
        local_root: Directory of the local store.
    """
    world, state = point.world_size, point.workload.state_bytes
    parts = {
        "ranks": 0 if pool_running else world * RANK_BASE_RSS,
        "state": state,
        "operations": world * max((_op_peak(n, point) for n in names), default=0),
        "verify": world * VERIFY_CHUNK_BYTES,
        "server": 0,
        "page_cache": 0,
    }
    kind = STORE_KINDS[point.store]
    if point.store == "seaweedfs" and names:
        inflight = world * _S3_INFLIGHT
        heap = _WEED_UNCAPPED * inflight
        if server_memory is not None:
            heap = min(heap, max(float(server_memory), _WEED_LIVE * inflight))
        parts["server"] = _WEED_IDLE + int(heap)
    elif kind != "local" and names:  # the in-memory servers (moto in this process)
        parts["server"] = 2 * state + 256 * _MiB
    elif kind == "local" and local_root is not None and _on_tmpfs(local_root):
        parts["page_cache"] = state
    parts["total"] = sum(parts.values())
    return parts


def _memory_text(estimate: dict[str, int]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in estimate.items()
                     if v and k != "total")


# -- figures of one point ----------------------------------------------------------------


def summarize_point(point: Point, case: dict[str, Any], *, is_limit: bool,
                    is_dcpstore: bool) -> dict[str, Any]:
    """:func:`.report.summarize` plus the curve's figures (see the module docstring)."""
    s = report.summarize(case, is_limit=is_limit, is_dcpstore=is_dcpstore)
    runs = case["runs"]
    if not runs:
        return s
    if point.world_size > 1:
        excess = []
        for run in runs:
            cpu = [r["cpu_user"] + r["cpu_sys"] for r in run]
            excess.append(cpu[0] - statistics.median(cpu[1:]))
        s["coordinator_excess_cpu_s"] = statistics.median(excess)
    s["cpu_s_per_rank_max"] = statistics.median(
        max(r["cpu_user"] + r["cpu_sys"] for r in run) for run in runs)
    shares = s["share_bytes"]
    s["rss_per_share_max"] = max(
        (peak / share for peak, share in zip(s["peak_extra_rss"], shares, strict=True)
         if share), default=None)
    s["seconds_per_gib"] = s["seconds"] / (case["state_bytes"] / _GiB)
    return s


def _growth(curve: list[dict[str, Any]], key: str) -> list[float | None]:
    """``key`` of each point over its value at the curve's first point that has one."""
    values: list[float | None] = [p["summary"].get(key) for p in curve]
    first = next((v for v in values if v), None)
    return [None if first is None or v is None else v / first for v in values]


def curves(points: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], list[dict[str, Any]]]:
    """Points grouped by (series, store, system, op), each curve sorted by x."""
    out: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for p in points:
        out.setdefault((p["series"], p["store"], p["system"], p["op"]), []).append(p)
    for curve in out.values():
        curve.sort(key=lambda p: p["x"])
    return out


def _others_rss(point: dict[str, Any]) -> float | None:
    """Median peak extra RSS of the ranks other than the coordinator (``None`` for one
    rank): the memory every rank pays, whatever the coordinator adds."""
    peaks = point["summary"].get("peak_extra_rss") or []
    return float(statistics.median(peaks[1:])) if len(peaks) > 1 else None


def findings(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where a dcpstore cost grows faster than linearly (growth > :data:`SUPERLINEAR`).

    Checked per curve: CPU s/GiB (total work per byte: should stay flat with world size
    and with state size); peak extra RSS over the rank's share, where it is above 64 MiB
    (below, allocator noise) and above the backend's memory bound (a fixed buffer is not
    a growth); along the world size, the non-coordinator ranks' peak extra RSS, where it
    is above 16 MiB (each rank handles the same items whatever the world size, so it must
    not grow); and (size series) seconds per GiB.
    """
    found = []
    for (series, store, system, op), curve in curves(points).items():
        if not curve[0]["summary"].get("is_dcpstore") or len(curve) < 2:
            continue
        checks = {"cpu_s_per_gib": _growth(curve, "cpu_s_per_gib"),
                  "rss_per_share_max": _growth(curve, "rss_per_share_max")}
        if series == "size":
            checks["seconds_per_gib"] = _growth(curve, "seconds_per_gib")
        else:
            others = [_others_rss(p) for p in curve]
            first = next((v for v in others if v), None)
            checks["others_peak_rss"] = [None if first is None or v is None or v < _OTHERS_FLOOR
                                         else v / first for v in others]
        for figure, growth in checks.items():
            for p, g in zip(curve, growth, strict=True):
                s = p["summary"]
                if figure == "rss_per_share_max" and (
                        (s.get("peak_extra_rss_max") or 0) < _RSS_FLOOR
                        or (s.get("peak_extra_rss_max") or 0) <= (s.get("memory_bound") or 0)):
                    continue
                if g is not None and g > SUPERLINEAR:
                    value = _others_rss(p) if figure == "others_peak_rss" else s.get(figure)
                    found.append({"series": series, "store": store, "system": system,
                                  "op": op, "figure": figure, "x": p["x"],
                                  "growth": round(g, 3), "value": value})
    return found


# -- the run -----------------------------------------------------------------------------


def _load_average() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


class _ServerWatch:
    """The resident memory of a store's server process while a point runs (psutil every
    0.2 s; the process is looked up again when it changes, e.g. after a replacement):
    its RSS at the start and its peak. moto runs in this process, which is watched then;
    the local store has no server."""

    def __init__(self, store: str, limit: int | None, interval: float = 0.2) -> None:
        self.store = store
        self.limit = limit
        self.interval = interval
        self.rss_start: int | None = None
        self.rss_peak = 0
        self.process = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _find(self) -> list[Any]:
        import psutil

        if self.store == "moto":
            return [psutil.Process()]
        needle = _SERVER_PROCESS.get(self.store)
        if needle is None:
            return []
        found = []
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.name() == needle or any(needle in a for a in proc.cmdline()[:1]):
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def _sample(self, procs: list[Any]) -> list[Any]:
        import psutil

        if not procs:
            procs = self._find()
        rss, alive = 0, []
        for proc in procs:
            try:
                rss += proc.memory_info().rss
                alive.append(proc)
                self.process = proc.name()
            except psutil.Error:
                continue
        if alive:
            if self.rss_start is None:
                self.rss_start = rss
            self.rss_peak = max(self.rss_peak, rss)
        return alive

    def _loop(self) -> None:
        procs: list[Any] = []
        while not self._stop.wait(self.interval):
            procs = self._sample(procs)

    def __enter__(self) -> _ServerWatch:
        if self.store != "moto" and self.store not in _SERVER_PROCESS:
            return self
        try:
            import psutil  # noqa: F401
        except ImportError:  # pragma: no cover - psutil is in requirements/bench.txt
            return self
        self._sample([])
        self._thread = threading.Thread(target=self._loop, daemon=True, name="server-rss")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def figures(self) -> dict[str, Any] | None:
        """``process``, ``rss_start``, ``rss_peak``, ``memory_limit`` (``None``: no
        server watched); the run adds ``replaced`` (a fresh server for this point)."""
        if self.rss_start is None:
            return None
        return {"process": self.process, "rss_start": self.rss_start,
                "rss_peak": self.rss_peak,
                "memory_limit": self.limit if self.store != "moto" else None}


def _prepare_point(stores: Stores, pools: dict[int, RankPool], store: str, world: int
                   ) -> tuple[bool, list[int] | None]:
    """Free what the previous point left: the ranks' cached state, and (SeaweedFS) the
    server, replaced by a fresh one if anything was written to it.

    Returns:
        Whether the server was replaced, and the ranks' RSS after they dropped their
        state (``None`` when their pool was not running).
    """
    released = None
    pool = pools.get(world)
    if pool is not None:
        try:
            released = pool.release()
        except JobError as exc:  # the pool was restarted: its memory is free too
            logger.warning("ranks did not release their state: %s", exc)
    if store in _FRESH_PER_POINT and stores.written.get(store):
        stores.replace(store)
        return True, released
    return False, released


def _run_points(points: list[Point], args: argparse.Namespace,
                result: dict[str, Any]) -> None:
    """Measure every point into ``result["points"]`` (or, when it would not fit in memory,
    into ``result["skipped"]``), saving ``results.json`` after each one (``"complete":
    false`` until the last), so a run cut short keeps what it did."""
    pools: dict[int, RankPool] = {}
    measured: list[dict[str, Any]] = result["points"]
    skipped: list[dict[str, Any]] = result["skipped"]
    # a point of two series (the size series' base size at its world size is also a
    # point of the world series) is measured once and reported in both
    jobs: dict[tuple[str, int, WorkloadSpec], list[Point]] = {}
    for point in points:
        jobs.setdefault((point.store, point.world_size, point.workload), []).append(point)
    remaining: dict[int, int] = {}
    for _store, world, _workload in jobs:
        remaining[world] = remaining.get(world, 0) + 1
    with Stores(sorted({p.store for p in points}), args.out, local_dir=args.local_dir,
                count_requests=False) as stores:
        result["stores"] = stores.describe()
        local_root = stores.info["local"].root if "local" in stores.info else None
        try:
            for i, ((store, world, workload), same) in enumerate(jobs.items()):
                for w in [w for w in pools if w != world and not remaining.get(w)]:
                    pools.pop(w).close()  # no point left needs this pool
                names = systems_for(store, args.systems)
                plan = StorePlan(store, workload, names)
                load = _load_average()
                print(f"-- point {i + 1}/{len(jobs)}: {'+'.join(p.series for p in same)} "
                      f"{store} @{world} {workload.describe()} (load {load})", flush=True)
                replaced, released = _prepare_point(stores, pools, store, world)
                estimate = estimate_memory(same[0], names,
                                           server_memory=args.server_memory_bytes,
                                           pool_running=world in pools, local_root=local_root)
                reason = check_memory(estimate["total"] + args.headroom_bytes,
                                      f"{_memory_text(estimate)}, plus "
                                      f"{format_bytes(args.headroom_bytes)} headroom")
                remaining[world] -= 1
                if reason is not None:
                    print(f"   {reason}", flush=True)
                    skipped += [{"series": p.series, "store": store, "world_size": world,
                                 "state_bytes": workload.state_bytes, "x": p.x,
                                 "tensors": workload.tensors, "reason": reason,
                                 "memory_estimate": estimate} for p in same]
                    _save_json(result, args.out)
                    continue
                runner = Runner(
                    stores, pools, functools.partial(RankPool, in_place=True),
                    world_size=world, runs=args.runs, count_requests=False,
                    evict_cache=False,
                    options=lambda store, label, op: options_for(args.options, label, op),
                    job_timeout=lambda n: max(180.0, n / 2e6),
                    progress=lambda line: print("   " + line, flush=True))
                with _ServerWatch(store, args.server_memory_bytes) as watch:
                    cases = runner.run([plan])
                server = watch.figures()
                if server is not None:
                    server["replaced"] = replaced
                    print(f"   server {server['process']}: peak RSS "
                          f"{format_bytes(server['rss_peak'])}", flush=True)
                for case in cases:
                    target = systems.get(case.system)
                    for point in same:
                        raw = case.to_dict()
                        raw.update(series=point.series, x=point.x, tensors=workload.tensors,
                                   load_average=load, server=server,
                                   memory_estimate=estimate, ranks_rss_released=released)
                        raw["summary"] = summarize_point(
                            point, raw, is_limit=target.is_limit,
                            is_dcpstore=target.is_dcpstore)
                        measured.append(raw)
                result["stores"] = stores.describe()
                _save_json(result, args.out)
            result["complete"] = True
        except KeyboardInterrupt:
            print("interrupted: reporting the points measured so far", flush=True)
        finally:
            for pool in pools.values():
                pool.close()


def _save_json(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the curves; return 0 when every point that fitted in memory ran and every
    load verified (points skipped for memory are listed in the results)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    if args.render is not None:
        rendered = json.loads((args.render / "results.json").read_text())
        return _finish(rendered, args.render)
    try:
        # before anything is measured: results for the committed tree need a clean one
        checkout = run_checkout(args.out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"python -m benchmarks --curves: refusing to run: {exc}", file=sys.stderr)
        return 2
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    # inherited by the servers the stores start (weed, fake-gcs-server), not the ranks'
    if args.server_memory_bytes is None:
        os.environ.pop("GOMEMLIMIT", None)
    else:
        os.environ["GOMEMLIMIT"] = f"{args.server_memory_bytes // _MiB}MiB"
    points = build_points(args)
    load = _load_average()
    print(f"dcpstore scaling curves, {args.mode} mode: {len(points)} points "
          f"({', '.join(args.series)}) on {', '.join(args.stores)}, {args.runs} run(s) each, "
          f"results in {args.out}")
    print(f"  estimated duration: ~{estimate_seconds(points, args) / 60:.0f} min on a quiet "
          f"2-core machine (up to 2-3x on a loaded one); load average now {load}")
    _print_memory_plan(points, args)
    if load and load[0] > 0.5 * (os.cpu_count() or 1):
        print("  WARNING: the machine is busy; figures will be noisy")
    sys.stdout.flush()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result: dict[str, Any] = {
        "harness_version": 1,
        "kind": "curves",
        "complete": False,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "duration_s": 0.0,
        "command": "python -m benchmarks --curves " + " ".join(shlex.quote(a) for a in (
            sys.argv[1:] if argv is None else argv) if a != "--curves"),
        "machine": machine_info(),
        "checkout": checkout,
        "load_average": {"start": load, "end": None},
        "versions": versions(),
        "config": {"mode": args.mode, "series": args.series, "stores": args.stores,
                   "worlds": args.worlds, "sizes": args.size_bytes,
                   "base_size": args.base_bytes, "size_world": args.size_world,
                   "tensors": args.tensors, "many_tensors": args.many_tensors,
                   "mix": args.mix, "runs": args.runs, "seed": args.seed,
                   "options": args.options, "load_in_place": True,
                   "server_memory": args.server_memory_bytes,
                   "memory_headroom": args.headroom_bytes,
                   "fresh_server_per_point": sorted(_FRESH_PER_POINT & set(args.stores))},
        "stores": {},
        "points": [],
        "skipped": [],
    }
    _run_points(points, args, result)
    result["duration_s"] = time.time() - started
    result["load_average"]["end"] = _load_average()
    return _finish(result, args.out)


def _print_memory_plan(points: list[Point], args: argparse.Namespace) -> None:
    """The largest predicted peak of a point (its ranks included) against the memory."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is in requirements/bench.txt
        return
    unique = {(p.store, p.world_size, p.workload): p for p in points}
    worst = max(((estimate_memory(p, systems_for(p.store, args.systems),
                                  server_memory=args.server_memory_bytes), p)
                 for p in unique.values()), key=lambda e: e[0]["total"], default=None)
    if worst is None:
        return
    estimate, p = worst
    vm = psutil.virtual_memory()
    limit = ("none" if args.server_memory_bytes is None
             else format_bytes(args.server_memory_bytes))
    print(f"  memory: largest predicted peak {format_bytes(estimate['total'])} at {p.store} "
          f"@{p.world_size} {format_bytes(p.workload.state_bytes)} ({_memory_text(estimate)}); "
          f"{format_bytes(vm.available)} of {format_bytes(vm.total)} available now; servers' "
          f"GOMEMLIMIT {limit}; a point that does not fit when it starts is skipped")


def _finish(result: dict[str, Any], out: Path) -> int:
    result["findings"] = findings(result["points"])
    _save_json(result, out)
    md = render_markdown(result)
    (out / "results.md").write_text(md)
    charts = write_charts(result, out)
    print()
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, "
          f"{', '.join(str(c) for c in charts)} ({result['duration_s'] / 60:.1f} min)")
    healthy = bool(result["points"]) and result.get("complete", True) and all(
        p["summary"]["ok"] and not p["errors"] and p["summary"].get("verified", True)
        for p in result["points"])
    return 0 if healthy else 1


# -- report ------------------------------------------------------------------------------


def _f(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def render_markdown(result: dict[str, Any]) -> str:
    """The curves as tables, one per (series, store), and the superlinear findings."""
    m = result["machine"]
    la = result.get("load_average", {})
    lines = [
        "# dcpstore scaling curves", "",
        f"`{result['command']}` — {result['started']}, {result['duration_s'] / 60:.1f} min, "
        f"{checkout_text(result.get('checkout'), m.get('git_commit'))}, "
        f"{m['cpus']} CPUs ({m['cpu_model']}), "
        f"{m['memory_bytes'] / _GiB:.0f} GiB RAM."
        + ("" if result.get("complete", True) else
           " **Incomplete**: the run was cut short; the points below are those measured."),
        "",
        f"Load average (1/5/15 min) at the start {la.get('start')}, at the end "
        f"{la.get('end')}; each point's 1-min load is in the tables. Median of "
        f"{result['config']['runs']} run(s) per point; every load verified bit-exact "
        "unless marked.", "",
        "Columns: MB/s = state bytes / the slowest rank's time; CPU s/GiB = all ranks' "
        "CPU per GiB of state; max rank CPU = the busiest rank's CPU seconds; coord. = "
        "rank 0's CPU minus the median of the others' (planning and commit); RSS = the "
        "largest peak extra RSS of a rank, and over its share of the state; server RSS = "
        "the store's server process's peak RSS during the point.", "",
        _memory_note(result["config"]), "",
    ]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in result["points"]:
        groups.setdefault((p["series"], p["store"]), []).append(p)
    titles = {"world": "against world size", "size": "against state size",
              "many": "against world size, many small tensors"}
    for (series, store), pts in groups.items():
        first = pts[0]
        what = (f"{first['world_size']} ranks" if series == "size"
                else f"{format_bytes(first['state_bytes'])}, {first['tensors']} tensors")
        lines += [f"## {store}: {titles[series]} ({what})", "",
                  "| system | op | ranks | state | MB/s | s/GiB | CPU s/GiB | max rank CPU s "
                  "| coord. CPU s | peak RSS/rank | RSS/share | server RSS | load | ok |",
                  "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
        for p in sorted(pts, key=lambda p: (p["system"], p["op"] != "save", p["x"])):
            s = p["summary"]
            ok = ("FAILED" if not s["ok"] else
                  "MISMATCH" if s.get("verified") is False else "yes")
            rss = s.get("peak_extra_rss_max")
            server = (p.get("server") or {}).get("rss_peak")
            lines.append(
                f"| {p['system']} | {p['op']} | {p['world_size']} | "
                f"{format_bytes(p['state_bytes'])} | {_f(s.get('mbps'), '.0f')} | "
                f"{_f(s.get('seconds_per_gib'), '.2f')} | {_f(s.get('cpu_s_per_gib'), '.2f')} | "
                f"{_f(s.get('cpu_s_per_rank_max'), '.2f')} | "
                f"{_f(s.get('coordinator_excess_cpu_s'), '.2f')} | "
                f"{'—' if rss is None else format_bytes(rss)} | "
                f"{_f(s.get('rss_per_share_max'), '.2f')} | "
                f"{'—' if server is None else format_bytes(server)} | "
                f"{_f((p.get('load_average') or [None])[0], '.1f')} | {ok} |")
        lines.append("")
    lines += _skipped_and_store_notes(result)
    lines += [f"## Superlinear growth (> {SUPERLINEAR:.2f}x the curve's first point)", ""]
    found = result.get("findings") or []
    if not result["points"]:
        lines.append("No point was measured.")
    elif not found:
        lines.append("None: every dcpstore cost per GiB and memory per share stayed within "
                     f"{SUPERLINEAR:.2f}x of the curve's first point.")
    for f in found:
        rss = f["figure"] == "others_peak_rss" and f["value"] is not None
        value = format_bytes(f["value"]) if rss else _f(f["value"], ".3g")
        lines.append(f"- {f['store']} {f['system']} {f['op']}, {f['series']} series at "
                     f"x={f['x']:g}: {f['figure']} {f['growth']:.2f}x the first point "
                     f"({value})")
    errors = [(p["store"], p["system"], p["op"], p["world_size"], e)
              for p in result["points"] for e in p["errors"]]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {s} {sy} {op} @{w}: {e.splitlines()[0] if e else e}"
                  for s, sy, op, w, e in errors]
    return "\n".join(lines) + "\n"


def _memory_note(config: dict[str, Any]) -> str:
    limit = config.get("server_memory")
    if "load_in_place" not in config:  # results of an older harness
        return "Memory: each rank held a source and a separate load destination."
    return ("Memory: each rank holds its share once (loads go into the zeroed source tensors "
            "and are checked against regenerated values) and drops it between points; "
            + ("SeaweedFS is a fresh server at each point; " if config.get(
                "fresh_server_per_point") else "")
            + "the stores' Go servers run with GOMEMLIMIT "
            + ("unset" if limit is None else format_bytes(limit))
            + "; a point predicted not to fit in the memory available when it starts (plus "
            + format_bytes(config.get("memory_headroom") or 0) + ") is skipped.")


def _skipped_and_store_notes(result: dict[str, Any]) -> list[str]:
    """The points skipped for memory, and the points whose server reached 90% of its
    memory limit (its collector then works harder: the store may be the bottleneck)."""
    lines: list[str] = []
    skipped = result.get("skipped") or []
    if skipped:
        lines += ["## Skipped for memory", ""]
        seen = set()
        for k in skipped:
            key = (k["store"], k["world_size"], k["state_bytes"], k["tensors"])
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"- {k['store']} @{k['world_size']} {format_bytes(k['state_bytes'])} "
                         f"in {k['tensors']} tensors ({k['series']}): {k['reason']}")
        lines.append("")
    bound = {}
    for p in result["points"]:
        server = p.get("server") or {}
        limit = server.get("memory_limit")
        if limit and server.get("rss_peak", 0) >= 0.9 * limit:
            bound[(p["store"], p["world_size"], p["state_bytes"])] = server
    if bound:
        lines += ["## Servers at their memory limit", ""]
        lines += [f"- {store} @{w} {format_bytes(size)}: {srv['process']} peaked at "
                  f"{format_bytes(srv['rss_peak'])} (GOMEMLIMIT "
                  f"{format_bytes(srv['memory_limit'])}): its collector ran against the "
                  "limit, so the store may be the bottleneck here"
                  for (store, w, size), srv in sorted(bound.items())]
        lines.append("")
    return lines


def write_charts(result: dict[str, Any], out: Path) -> list[Path]:
    """``world.png`` and ``size.png``: MB/s (top row) and CPU s/GiB (bottom row), save
    and load, one line per (store, system); the main chart's colours (dcpstore blue,
    peers grey, limits amber)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"dcpstore": "#2F6DB5", "peer": "#9A9A9A", "limit": "#E3A33B"}
    styles = {"local": "-", "seaweedfs": "--", "moto": ":", "gcs": "-."}
    marks = {"world": "o", "many": "s", "size": "D"}
    by_curve = curves(result["points"])
    written = []
    m = result["machine"]
    la = (result.get("load_average") or {}).get("start")
    for name, series, xlabel in (("world", ("world", "many"), "world size (ranks)"),
                                 ("size", ("size",), "state size (GiB)")):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
        for col, op in enumerate(("save", "load")):
            for (ser, store, system, cop), curve in by_curve.items():
                if ser not in series or cop != op:
                    continue
                s0 = curve[0]["summary"]
                kind = ("limit" if s0.get("is_limit") else
                        "dcpstore" if s0.get("is_dcpstore") else "peer")
                xs = [p["x"] for p in curve]
                label = f"{system} ({store}" + (", many tensors)" if ser == "many" else ")")
                for row, key in enumerate(("mbps", "cpu_s_per_gib")):
                    ys = [p["summary"].get(key) for p in curve]
                    axes[row][col].plot(xs, [float("nan") if y is None else y for y in ys],
                                        styles.get(store, "-"), marker=marks[ser],
                                        color=colors[kind], label=label,
                                        alpha=1.0 if ser != "many" else 0.6)
            for row, ylabel in enumerate(("MB/s", "CPU s per GiB (all ranks)")):
                ax = axes[row][col]
                ax.set_title(f"{op}: {ylabel}", fontsize=9)
                ax.set_xlabel(xlabel, fontsize=8)
                ax.set_ylabel(ylabel, fontsize=8)
                ax.tick_params(labelsize=7)
                ax.grid(alpha=0.3)
                ax.set_ylim(bottom=0)
                if name == "world":
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(result["config"]["worlds"],
                                  [str(w) for w in result["config"]["worlds"]])
                if row == 0 and col == 0 and ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
        fig.suptitle(f"dcpstore scaling against {'world size' if name == 'world' else 'size'}"
                     f": {m['cpus']} CPUs, median of {result['config']['runs']} run(s), "
                     f"load average {la}, "
                     f"{checkout_text(result.get('checkout'), m.get('git_commit'))}",
                     fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
