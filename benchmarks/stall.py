"""``python -m benchmarks.stall``: how long a checkpoint stops training, and when it is
safe (issue 14 item 4).

For each state size and store, every system runs a short training loop on 2 gloo ranks:
``--saves`` checkpoints in a row with a compute step of fixed work between them
(:mod:`benchmarks.stall_systems` has what a rank does and how each figure is measured).
Per save: seconds training was **blocked**, seconds until the step was **durable** (its
commit marker visible in the store), and the **peak extra memory** per rank; then the
last step is loaded back and checked bit-exact. Steady state = saves 2..N.

Systems side by side (where they run): ``copy-limit`` (one copy of the rank's share into
preallocated memory: the limit; into one arena faulted in before the first save and
reused, as a stager's, the fastest of 3 copies per save),
``dcpstore[blocking|thread|process|process-shm|thread-pinned]``,
``dcpstore-tier[blocking|thread]`` (``local_tier``, S3 only),
``torch-async[thread|thread-cached|thread-shm|thread-pinned|process|process-shm|
process-pinned]`` (``dcp.async_save`` with ``FileSystemWriter`` / ``FsspecWriter``) and
``s3torchconnector-async[thread]``. Pinned staging needs CUDA: elsewhere its rows say
"n/a (no CUDA)".

Resume (SeaweedFS runs): a step saved through ``Checkpointer(remote, local_tier=...)``
is loaded by freshly restarted ranks from the local tier, from SeaweedFS, and -- the
reference -- a plain local dcpstore checkpoint of the same state.

Method (as issue 17 asks of every benchmark): ``--runs`` runs per case (6 by default)
in a seeded, balanced random order (rows of a Williams Latin square with randomly
relabelled systems, each row followed by its reverse: with an even ``--runs`` each system
runs before each other one in exactly half the runs, and over a full square each system
directly precedes each other one equally often; the resume loads are ordered the same
way), the median over runs with the min-max spread, a quiet-machine check at the start,
and the same request settings for every botocore-based client. Results written into
``benchmarks/results`` (but not its ``tmp/``) refuse a tree with uncommitted changes
unless ``--allow-dirty``; the commit and, for a dirty tree, the diff's SHA-256 are
recorded (``checkout`` in ``results.json``).

Examples::

    python -m benchmarks.stall --quick                    # CI smoke: tiny, 2 saves, local
    python -m benchmarks.stall --out benchmarks/results/stall   # the full suite
    python -m benchmarks.stall --sizes 256MiB --stores local seaweedfs --runs 1
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import logging
import os
import random
import shlex
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from . import stall_systems
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
from .ranks import Job, JobError, RankPool
from .servers import StoreInfo, Stores
from .systems import STALL_PREFIX
from .workload import WorkloadSpec, format_bytes, parse_size

__all__ = ["balanced_orders", "evaluate_targets", "main", "parse_args",
           "render_markdown", "summarize"]

logger = logging.getLogger(__name__)

#: Systems per store kind, in report order.
SYSTEMS: dict[str, list[str]] = {
    "local": ["copy-limit", "dcpstore[blocking]", "dcpstore[thread]", "dcpstore[process]",
              "dcpstore[process-shm]", "dcpstore[thread-pinned]",
              "torch-async[thread]", "torch-async[thread-cached]", "torch-async[thread-shm]",
              "torch-async[thread-pinned]", "torch-async[process]",
              "torch-async[process-shm]", "torch-async[process-pinned]"],
}
SYSTEMS["s3"] = [*SYSTEMS["local"][:6], "dcpstore-tier[blocking]", "dcpstore-tier[thread]",
                 *SYSTEMS["local"][6:], "s3torchconnector-async[thread]"]
STORE_KINDS = {"local": "local", "seaweedfs": "s3"}
#: Assumed blocking-save MB/s of the whole state per store (compute step sizing, estimate).
_ASSUMED_MBPS = {"local": 900.0, "seaweedfs": 170.0}
_LOAD_MBPS = {"local": 2000.0, "seaweedfs": 400.0}
_MiB = 1 << 20
#: Runs per case of the full mode: >= 5 for a median with a spread, even for a balanced
#: order (see :func:`balanced_orders`).
RUNS = 6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (quick / full defaults filled in)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.stall",
        description="Seconds a checkpoint blocks training, seconds until it is durable, "
                    "memory, and resume time: dcpstore vs torch dcp.async_save, "
                    "s3torchconnector and the copy limit.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Full defaults: --sizes 1GiB 4GiB --stores local seaweedfs --saves 5 --runs 6."
               "\nQuick defaults: --sizes 16MiB --stores local --saves 2 --runs 1, no resume.")
    p.add_argument("--quick", action="store_true", help="CI smoke run (tiny, local only)")
    p.add_argument("--sizes", nargs="+", help="state sizes (whole state, all ranks)")
    p.add_argument("--stores", nargs="+", choices=list(STORE_KINDS), help="stores")
    p.add_argument("--saves", type=int, help="saves in a row per run (>= 2)")
    p.add_argument("--runs", type=int, help="runs per case (median, min-max reported)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--tensors", type=int, default=32, help="tensors in the state")
    p.add_argument("--seed", type=int, default=0, help="values and run order")
    p.add_argument("--systems", nargs="+", metavar="PATTERN",
                   help="only these systems: exact names or shell patterns "
                        "(e.g. 'dcpstore*' copy-limit 'torch-async[[]thread]')")
    p.add_argument("--compute-s", type=float,
                   help="seconds of one compute step (fixed matmul work calibrated once "
                        "at the start; default: --compute-factor x the assumed blocking "
                        "save of the state on each store, at least 1 s; quick: 0.25 s)")
    p.add_argument("--compute-factor", type=float, default=1.5,
                   help="without --compute-s: the compute step is this many times the "
                        "assumed blocking save of the state on each store (default 1.5)")
    p.add_argument("--compute", choices=("matmul", "idle"), default="matmul",
                   help="the compute step: matmuls on the rank's core (default), or idle "
                        "for as long (a GPU step: the host CPU is left to the save)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                   help="measure resume after a restart (needs seaweedfs; full default on)")
    p.add_argument("--local-dir", help="directory of the local store and the local tiers")
    add_output_args(p, "stall-", "results.md and the chart")
    args = p.parse_args(argv)
    q = args.quick
    args.mode = "quick" if q else "full"
    defaults = {"sizes": ["16MiB"] if q else ["1GiB", "4GiB"],
                "stores": ["local"] if q else ["local", "seaweedfs"],
                "saves": 2 if q else 5, "runs": 1 if q else RUNS}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.resume is None:
        args.resume = not q
    if args.saves < 2 or args.runs < 1 or args.world_size < 1:
        p.error("--saves must be >= 2, --runs and --world-size >= 1")
    try:
        args.size_bytes = [parse_size(s) for s in args.sizes]
    except ValueError as exc:
        p.error(str(exc))
    if args.out is None:
        args.out = default_out(f"stall-{args.mode}")
    return args


# -- order ---------------------------------------------------------------------------------


def _williams(n: int) -> list[list[int]]:
    """A Williams design: rows in which every ordered pair of distinct items is adjacent
    equally often (n even: n rows, once; n odd: 2n rows, the square and its mirror,
    twice)."""
    first = [0]
    lo, hi = 1, n - 1
    for i in range(1, n):
        if i % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [list(reversed(row)) for row in rows]
    return rows


def balanced_orders(systems: list[str], runs: int, seed: int) -> list[list[str]]:
    """``runs`` orders of ``systems``: rows of a Williams square (see :func:`_williams`)
    with the systems relabelled by ``seed``, in pairs: a row drawn at random (``seed``),
    then its reverse. With an even ``runs`` each system runs before each other one in
    exactly half the runs; over a whole square (``runs`` = n, or 2n for odd n) each
    system also directly precedes each other one equally often. More runs repeat the
    square, fewer take part of it (an odd ``runs`` ends with an unpaired row)."""
    if not systems:
        return [[] for _ in range(runs)]
    rng = random.Random(seed)
    labels = list(systems)
    rng.shuffle(labels)
    rows = _williams(len(labels))
    # row r + len(rows) / 2 of _williams is row r reversed: the square is made of pairs
    half = rows[:len(rows) // 2] or rows
    rng.shuffle(half)
    paired = [row for base in half for row in (base, base[::-1])]
    return [[labels[i] for i in paired[r % len(paired)]] for r in range(runs)]


def _resume_orders(runs: int, seed: int) -> list[list[str]]:
    """The order of the resume loads' sources in each run (balanced as the systems)."""
    return balanced_orders(["tier", "remote", "local"], runs, seed * 1000)


# -- the quiet-machine check ---------------------------------------------------------------


def machine_quiet() -> dict[str, Any]:
    """Load average and the busiest other processes; ``warning`` when not quiet."""
    info: dict[str, Any] = {"loadavg": os.getloadavg(), "cpus": os.cpu_count()}
    busy: list[str] = []
    try:
        import psutil

        procs = list(psutil.process_iter(["pid", "name"]))
        for proc in procs:
            proc.cpu_percent(None)
        time.sleep(0.5)
        me = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
        for proc in procs:
            try:
                pct = proc.cpu_percent(None)
            except psutil.Error:
                continue
            if proc.pid not in me and pct > 20:
                busy.append(f"{proc.info['name']}({proc.pid}) {pct:.0f}%")
    except ImportError:
        pass
    info["busy"] = busy
    if info["loadavg"][0] > 0.5 * (os.cpu_count() or 1) or busy:
        info["warning"] = (f"machine not quiet: load average {info['loadavg'][0]:.1f} on "
                           f"{os.cpu_count()} CPUs; busy: {', '.join(busy) or 'none listed'}"
                           " -- figures from this run say little")
    return info


def _others_cpu() -> dict[tuple[int, float], float]:
    """CPU seconds used so far by every process outside this run's process tree."""
    try:
        import psutil
    except ImportError:
        return {}
    me = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    out: dict[tuple[int, float], float] = {}
    for proc in psutil.process_iter(["pid", "create_time", "cpu_times"]):
        if proc.info["pid"] in me or proc.info["cpu_times"] is None:
            continue
        t = proc.info["cpu_times"]
        out[(proc.info["pid"], proc.info["create_time"])] = t.user + t.system
    return out


class _LoadProbe:
    """Load while a case runs: the 1-minute load average at its start and end, and the
    cores other processes (not this run's) used on average meanwhile."""

    def __init__(self) -> None:
        self.load_start = os.getloadavg()[0]
        self._cpu = _others_cpu()
        self._t0 = time.monotonic()

    def finish(self) -> dict[str, float]:
        after = _others_cpu()
        used = sum(max(0.0, v - self._cpu.get(k, 0.0)) for k, v in after.items())
        wall = max(1e-6, time.monotonic() - self._t0)
        return {"load_start": self.load_start, "load_end": os.getloadavg()[0],
                "others_cores": used / wall}


def load_note(result: dict[str, Any]) -> str | None:
    """A warning when other processes used a noticeable share of the CPUs during cases."""
    samples = [x for c in result.get("cases", []) for x in c.get("load", [])]
    samples += [x for r in result.get("resume", []) for x in r.get("load", [])]
    if not samples:
        return None
    cpus = result.get("machine", {}).get("cpus") or os.cpu_count() or 1
    others = [x["others_cores"] for x in samples]
    loads = [x["load_end"] for x in samples]
    text = (f"other processes (not this run's) used {statistics.median(others):.2f} "
            f"[{min(others):.2f}-{max(others):.2f}] of {cpus} cores on average during the "
            f"cases; 1-min load average at case ends {min(loads):.1f}-{max(loads):.1f} "
            "(this run's own ranks and servers included)")
    if max(others) > 0.25 * cpus:
        return "machine not quiet: " + text + " -- figures are noisy"
    return text


# -- running -------------------------------------------------------------------------------


def _selected(label: str, patterns: list[str] | None) -> bool:
    # an exact name first: its brackets would be a character class to fnmatch
    return not patterns or any(label == p or fnmatch.fnmatchcase(label, p) for p in patterns)


def _calibrate(seconds: float = 0.5) -> float:
    """256x256 float32 matmuls per second on one thread (as the ranks run them)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.rand(256, 256), torch.rand(256, 256)
    c = torch.empty(256, 256)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.mm(a, b, out=c)
        n += 10
    return n / (time.perf_counter() - t0)


def compute_seconds(args: argparse.Namespace, store: str, size: int) -> float:
    """Seconds one compute step is sized to (see ``--compute-s``)."""
    if args.compute_s is not None:
        return float(args.compute_s)
    return max(0.25 if args.quick else 1.0,
               args.compute_factor * size / 1e6 / _ASSUMED_MBPS[store])


def estimate_seconds(args: argparse.Namespace, plan: list[tuple[int, str, list[str]]]) -> float:
    """A rough duration on a 2-core machine."""
    total = 40.0
    for size, store, labels in plan:
        save = size / 1e6 / _ASSUMED_MBPS[store]
        one = args.saves * (compute_seconds(args, store, size) + 0.3 * save) + save \
            + size / 1e6 / _LOAD_MBPS[store] + 3.0
        total += args.runs * len(labels) * one
        if args.resume and store == "seaweedfs":
            total += args.runs * (2 * save + 3 * (25.0 + size / 1e6 / _LOAD_MBPS["local"]))
    return total


class _Suite:
    def __init__(self, args: argparse.Namespace, stores: Stores, pool: RankPool,
                 rate: float) -> None:
        self.args = args
        self.stores = stores
        self.pool = pool
        self.rate = rate
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.cases: dict[tuple[int, str, str], dict[str, Any]] = {}
        self.resume: dict[tuple[int, str], dict[str, Any]] = {}
        self.local_root = stores.info["local"].root if "local" in stores.info else None
        #: system -> largest peak extra memory per byte of the rank's share seen so far
        self.memory_ratio: dict[str, float] = {}
        self.skipped: list[dict[str, Any]] = []

    def _fits(self, size: int, store_name: str, label: str, state_bytes: int) -> bool:
        """Whether the system's peak, scaled from a smaller size already run, fits in
        the memory available now (else the case is skipped, with the reason)."""
        ratio = self.memory_ratio.get(label)
        if ratio is None:
            return True
        reason = check_memory(ratio * state_bytes + (1 << 30), "its peak per byte of state "
                              "at a smaller size, plus 1 GiB")
        if reason is None:
            return True
        if not any(s["system"] == label and s["size"] == size and s["store"] == store_name
                   for s in self.skipped):
            self.skipped.append({"store": store_name, "size": size, "system": label,
                                 "reason": reason})
        print(f"  {store_name:<9} {format_bytes(size):>7} {label:<32} {reason}", flush=True)
        return False

    def _reserve(self, store_name: str, nbytes: int) -> None:
        """Account the bytes a case is about to write (:meth:`Stores.reserve`: SeaweedFS
        is replaced by a fresh, empty server once its budget would be passed)."""
        before = self.stores.written[store_name]
        if self.stores.reserve(store_name, nbytes):
            print(f"  (fresh SeaweedFS server: {format_bytes(before)} written to the last "
                  "one)", flush=True)

    def _timeout(self, size: int, compute_s: float) -> float:
        return 300.0 + self.args.saves * (3 * compute_s + size / 2e6)

    def _job(self, op: str, label: str, store: StoreInfo, path: str, spec: WorkloadSpec,
             options: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        job = Job(op=op, system=STALL_PREFIX + label, store=store, path=path, workload=spec,
                  options={**options, "local_root": self.local_root})
        return [r.to_dict() for r in self.pool.run(job, timeout)]

    def run_case(self, size: int, store_name: str, label: str, rep: int,
                 compute_s: float) -> None:
        args = self.args
        store = self.stores.info[store_name]
        spec = WorkloadSpec(size, tensors=args.tensors, seed=args.seed)
        case = self.cases.setdefault((size, store_name, label), {
            "size": size, "state_bytes": spec.state_bytes, "store": store_name,
            "system": label, "runs": [], "loads": [], "errors": []})
        system = stall_systems.get(label)
        if not self._fits(size, store_name, label, spec.state_bytes):
            case["errors"].append(f"run {rep + 1}: not run: memory")
            return
        safe = label.replace("[", "_").replace("]", "")
        path = f"stall/{self.run_id}/{format_bytes(size).replace(' ', '')}/{safe}/r{rep}"
        options: dict[str, Any] = {"saves": args.saves}
        if args.compute == "idle":
            options.update(compute_iters=0, compute_idle_s=compute_s)
        else:
            options["compute_iters"] = max(1, round(compute_s * self.rate))
        timeout = self._timeout(size, compute_s)
        self._reserve(store_name, size * args.saves)
        store = self.stores.info[store_name]
        probe = _LoadProbe()
        started = time.monotonic()
        try:
            ranks = self._job("save", label, store, path, spec, options, timeout)
            case["runs"].append(ranks)
            peak = max(s["peak_extra_bytes"] for r in ranks for s in r["extra"]["saves"])
            ratio = peak / max(1, min(r["share_bytes"] for r in ranks))
            self.memory_ratio[label] = max(ratio, self.memory_ratio.get(label, 0.0))
            line = _progress_line(ranks)
            if system.loads:
                loaded = self._job("load", label, store, path, spec, options, timeout)
                case["loads"].append(loaded)
                ok = all(r["verified"] for r in loaded)
                line += f"  load {max(r['seconds'] for r in loaded):.2f} s " + (
                    "verified" if ok else "MISMATCH")
            print(f"  {store_name:<9} {format_bytes(size):>7} r{rep + 1} {label:<32} {line}"
                  f"  (job {time.monotonic() - started:.0f} s)", flush=True)
        except JobError as exc:
            first = str(exc).strip().splitlines()
            case["errors"].append(f"run {rep + 1}: {exc}")
            print(f"  {store_name:<9} {format_bytes(size):>7} r{rep + 1} {label:<32} FAILED: "
                  f"{first[0] if first else exc}", flush=True)
        finally:
            case.setdefault("load", []).append(probe.finish())
            self._cleanup(store_name, path)

    def _cleanup(self, store_name: str, path: str) -> None:
        self.stores.delete(store_name, path)
        if self.local_root is not None:
            import shutil

            base = os.path.join(self.local_root, path.replace("/", "_"))
            shutil.rmtree(base + "-tier", ignore_errors=True)
            shutil.rmtree(os.path.join(self.local_root, path + "-plain"), ignore_errors=True)

    def run_resume(self, size: int, rep: int) -> None:
        """Prepare a tiered checkpoint, then load it in restarted ranks three ways."""
        self._reserve("seaweedfs", 2 * size)
        store = self.stores.info["seaweedfs"]
        spec = WorkloadSpec(size, tensors=self.args.tensors, seed=self.args.seed)
        entry = self.resume.setdefault((size, "seaweedfs"), {
            "size": size, "state_bytes": spec.state_bytes, "store": "seaweedfs",
            "loads": {"tier": [], "remote": [], "local": []}, "errors": [], "load": []})
        probe = _LoadProbe()
        path = f"stall/{self.run_id}/{format_bytes(size).replace(' ', '')}/resume/r{rep}"
        timeout = 300.0 + 4 * size / 2e6
        try:
            self._job("save", "resume-prep", store, path, spec, {}, timeout)
            order = _resume_orders(rep + 1, self.args.seed)[rep]
            for source in order:
                self.pool.restart()
                ranks = self._job("load", f"resume[{source}]", store, path, spec, {}, timeout)
                entry["loads"][source].append(ranks)
                ok = all(r["verified"] for r in ranks)
                print(f"  seaweedfs {format_bytes(size):>7} r{rep + 1} resume from {source:<7}"
                      f" {max(r['seconds'] for r in ranks):7.2f} s  "
                      f"{'verified' if ok else 'MISMATCH'}", flush=True)
        except JobError as exc:
            entry["errors"].append(f"run {rep + 1}: {exc}")
            print(f"  seaweedfs {format_bytes(size):>7} r{rep + 1} resume FAILED: "
                  f"{str(exc).strip().splitlines()[0]}", flush=True)
        finally:
            entry["load"].append(probe.finish())
            self._cleanup("seaweedfs", path)


def _progress_line(ranks: list[dict[str, Any]]) -> str:
    saves = ranks[0]["extra"]["saves"]
    blocked = [max(r["extra"]["saves"][i]["blocked_s"] for r in ranks)
               for i in range(len(saves))]
    durable = [s.get("durable_s") for s in saves]
    return ("blocked " + " ".join(f"{b:.2f}" for b in blocked) + "  durable "
            + " ".join("—" if d is None else f"{d:.2f}" for d in durable))


def build_plan(args: argparse.Namespace) -> tuple[list[tuple[int, str, list[str]]],
                                                  list[dict[str, Any]]]:
    """``(size, store, runnable labels)`` per case group, and what is skipped (why)."""
    plan: list[tuple[int, str, list[str]]] = []
    skipped: list[dict[str, Any]] = []
    for size in args.size_bytes:
        copied_on: str | None = None
        for store in args.stores:
            labels = []
            for label in SYSTEMS[STORE_KINDS[store]]:
                if not _selected(label, args.systems):
                    continue
                if label == "copy-limit" and copied_on is not None:
                    # the copy into preallocated memory does not touch the store
                    skipped.append({"store": store, "size": size, "system": label,
                                    "reason": f"not run again: measured on {copied_on} (the "
                                              "copy does not touch the store)"})
                    continue
                if label == "copy-limit":
                    copied_on = store
                reason = stall_systems.get(label).unavailable()
                if reason:
                    skipped.append({"store": store, "size": size, "system": label,
                                    "reason": reason})
                else:
                    labels.append(label)
            plan.append((size, store, labels))
    return plan, skipped


def main(argv: list[str] | None = None) -> int:
    """Run the suite; return 0 when every case ran and every load was bit-exact."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    if args.render is not None:
        return _finish(json.loads((args.render / "results.json").read_text()), args.render)
    try:  # before anything is measured
        tree = run_checkout(args.out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"python -m benchmarks.stall: {exc}", file=sys.stderr)
        return 2
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    plan, skipped = build_plan(args)
    resume = args.resume and "seaweedfs" in args.stores
    quiet = machine_quiet()
    started = time.time()
    print(f"dcpstore stall suite, {args.mode} mode: {args.world_size} ranks, {args.saves} "
          f"saves per run, {args.runs} run(s) per case, results in {args.out}")
    if "warning" in quiet:
        print(f"  WARNING: {quiet['warning']}")
    for size, store, labels in plan:
        print(f"  {store:<9} {format_bytes(size):>7}: {', '.join(labels)}")
    for s in skipped:
        print(f"  {s['store']:<9} {format_bytes(s['size']):>7}: SKIP {s['system']}: "
              f"{s['reason']}")
    print(f"  estimated duration: ~{estimate_seconds(args, plan) / 60:.0f} min (2-core "
          "machine; rough)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rate = _calibrate()
    store_names = sorted({s for _, s, _ in plan} | ({"local"} if resume or any(
        "tier" in label for _, _, labels in plan for label in labels) else set()),
        key=list(STORE_KINDS).index)
    pool = RankPool(args.world_size)
    compute: dict[tuple[int, str], float] = {}
    #: "<size> <store>" -> the system order of every run ("... resume": the load sources)
    orders: dict[str, list[list[str]]] = {}

    def result_of(suite: _Suite, stores: Stores, *, partial: bool) -> dict[str, Any]:
        cases = [copy.deepcopy(c) for c in suite.cases.values()
                 if c["runs"] or c["errors"] != [
                     f"run {i + 1}: not run: memory" for i in range(len(c["errors"]))]]
        return {
            "harness_version": 1,
            "suite": "stall",
            "partial": partial,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "duration_s": time.time() - started,
            "command": "python -m benchmarks.stall " + " ".join(shlex.quote(a) for a in (
                sys.argv[1:] if argv is None else argv)),
            "machine": machine_info(),
            "checkout": tree,
            "quiet": quiet,
            "versions": versions(),
            "config": {"mode": args.mode, "world_size": args.world_size, "saves": args.saves,
                       "runs": args.runs, "sizes": args.size_bytes, "stores": args.stores,
                       "tensors": args.tensors, "seed": args.seed,
                       "matmuls_per_s": rate, "resume": resume, "compute": args.compute,
                       "compute_s": {f"{format_bytes(k[0])} {k[1]}": v
                                     for k, v in compute.items()},
                       "request_settings": stall_systems.REQUEST_SETTINGS,
                       "orders": orders},
            "stores": stores.describe(),
            "skipped": skipped + suite.skipped,
            "cases": cases,
            "resume": copy.deepcopy(list(suite.resume.values())),
        }

    # SIGTERM (a stopped run) unwinds like Ctrl-C: servers and ranks are stopped, and the
    # results of the cases that finished are on disk already
    signal.signal(signal.SIGTERM, _terminate)
    try:
        # one Stores for them all: SeaweedFS is replaced by a fresh server between cases
        # once SERVER_BUDGETS' bytes were written to it (weed mini reclaims space lazily)
        stores = Stores(store_names, args.out, local_dir=args.local_dir, count_requests=False)
        with stores:
            suite = _Suite(args, stores, pool, rate)
            for size, store, labels in plan:
                compute[(size, store)] = cs = compute_seconds(args, store, size)
                key = f"{format_bytes(size)} {store}"
                orders[key] = balanced_orders(labels, args.runs, args.seed)
                for rep, order in enumerate(orders[key]):
                    for label in order:
                        suite.run_case(size, store, label, rep, cs)
                        _write_results(result_of(suite, stores, partial=True), args.out)
                if resume and store == "seaweedfs":
                    orders[f"{key} resume"] = _resume_orders(args.runs, args.seed)
                    for rep in range(args.runs):
                        suite.run_resume(size, rep)
                        _write_results(result_of(suite, stores, partial=True), args.out)
            result = result_of(suite, stores, partial=False)
    finally:
        pool.close()
    return _finish(result, args.out)


# -- summaries and targets -----------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def summarize(case: dict[str, Any]) -> dict[str, Any]:
    """Figures of one case: per save index and over the steady state (saves 2..N).

    A run's blocked time of a save is the slowest rank's; durable is rank 0's (the
    commit is global); memory is the largest rank's. Steady-state spreads pool the
    saves 2..N of every run.
    """
    runs = case["runs"]
    out: dict[str, Any] = {"runs_ok": len(runs), "ok": bool(runs) and not case["errors"]}
    if not runs:
        return out
    n = len(runs[0][0]["extra"]["saves"])

    def per_save(run: list[dict[str, Any]], i: int, key: str, how: Any = max) -> Any:
        vals = [r["extra"]["saves"][i].get(key) for r in run]
        vals = [v for v in vals if v is not None]
        return how(vals) if vals else None

    blocked = [[per_save(run, i, "blocked_s") for run in runs] for i in range(n)]
    durable = [[run[0]["extra"]["saves"][i].get("durable_s") for run in runs]
               for i in range(n)]
    memory = [[per_save(run, i, "peak_extra_bytes") for run in runs] for i in range(n)]
    compute = [[per_save(run, i, "compute_s") for run in runs] for i in range(n)]
    waited = [[per_save(run, i, "waited_s") for run in runs] for i in range(n)]
    out["per_save"] = [{"save": i + 1, "blocked_s": _spread(blocked[i]),
                        "durable_s": _spread(durable[i]),
                        "peak_extra_bytes": _spread(memory[i]),
                        "compute_s": _spread(compute[i])} for i in range(n)]
    out["steady_blocked_s"] = _spread([v for row in blocked[1:] for v in row])
    out["steady_durable_s"] = _spread([v for row in durable[1:] for v in row])
    out["steady_waited_s"] = _spread([v for row in waited[1:] for v in row])
    out["first_blocked_s"] = _spread(blocked[0])
    out["compute_s"] = _spread([v for row in compute for v in row])
    # growth of the peak from save 2 to save N, worst run and rank
    growth = []
    for run in runs:
        for r in run:
            saves = r["extra"]["saves"]
            growth.append(saves[-1]["peak_extra_bytes"] - saves[1]["peak_extra_bytes"])
    out["rss_growth_bytes"] = max(growth)
    out["share_bytes"] = max(r["share_bytes"] for r in runs[0])
    # a local tier's drains skipped because a newer step superseded them (latest wins):
    # those saves have no durable time
    skipped = [len(run[0]["extra"].get("drains_skipped") or []) for run in runs]
    if any(skipped):
        out["drains_skipped"] = skipped
    allocs = [r["extra"].get("staging_allocations") for run in runs for r in run]
    if any(a is not None for a in allocs):
        out["staging_allocations"] = max(a for a in allocs if a is not None)
    if case["loads"]:
        out["load_s"] = _spread([max(r["seconds"] for r in run) for run in case["loads"]])
        out["verified"] = all(r["verified"] for run in case["loads"] for r in run)
        out["ok"] = out["ok"] and out["verified"]
    return out


def _med(s: dict[str, Any] | None) -> float | None:
    return None if not s else s["median"]


def copy_limit(result: dict[str, Any], size: int, store: str) -> float | None:
    """Steady blocked seconds of ``copy-limit`` at ``size``: this store's run, else any
    store's (the copy into preallocated memory does not touch the store)."""
    found = None
    for c in result["cases"]:
        if c["size"] == size and c["system"] == "copy-limit":
            value = _med(c["summary"].get("steady_blocked_s"))
            if c["store"] == store and value is not None:
                return value
            found = value if found is None else found
    return found


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 14's targets per store and size: PASS / FAIL / SKIP with the figures."""
    targets: list[dict[str, Any]] = []

    def add(tid: str, text: str, status: str, detail: str) -> None:
        targets.append({"id": tid, "target": text, "status": status, "detail": detail})

    groups: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    for c in result["cases"]:
        groups.setdefault((c["size"], c["store"]), {})[c["system"]] = c["summary"]
    for (size, store), by in groups.items():
        where = f"{store} {format_bytes(size)}"
        copy = copy_limit(result, size, store)
        torch_best = None
        for label, s in by.items():
            b = _med(s.get("steady_blocked_s"))
            if (label.startswith("torch-async") and b is not None and s.get("ok")
                    and (torch_best is None or b < torch_best[1])):
                torch_best = (label, b)
        blocking = _med((by.get("dcpstore[blocking]") or {}).get("steady_durable_s"))
        for label in ("dcpstore[thread]", "dcpstore[process]", "dcpstore[process-shm]",
                      "dcpstore-tier[thread]"):
            b = _med((by.get(label) or {}).get("steady_blocked_s"))
            text = f"{where}: {label} steady blocked <= 1.5x copy limit and <= torch's best"
            if b is None or copy is None or torch_best is None:
                add(f"blocked-{store}-{size}-{label}", text, "SKIP",
                    "missing " + ", ".join(n for n, v in ((label, b), ("copy-limit", copy),
                                                          ("torch-async", torch_best))
                                           if v is None))
            else:
                ok = b <= 1.5 * copy and b <= torch_best[1]
                add(f"blocked-{store}-{size}-{label}", text, "PASS" if ok else "FAIL",
                    f"{b:.3f} s = {b / copy:.2f}x copy ({copy:.3f} s); {torch_best[0]} "
                    f"{torch_best[1]:.3f} s")
        for label in ("dcpstore[process]", "dcpstore[process-shm]"):
            d = _med((by.get(label) or {}).get("steady_durable_s"))
            text = f"{where}: {label} durable <= 1.1x blocking"
            if d is None or blocking is None:
                add(f"durable-{store}-{size}-{label}", text, "SKIP",
                    f"no durable figure for {label if d is None else 'dcpstore[blocking]'}")
            else:
                add(f"durable-{store}-{size}-{label}", text,
                    "PASS" if d <= 1.1 * blocking else "FAIL",
                    f"{d:.2f} s vs blocking {blocking:.2f} s = {d / blocking:.2f}x")
        for label, s in by.items():
            if not label.startswith("dcpstore") or "rss_growth_bytes" not in s:
                continue
            slack = max(32 * _MiB, 0.05 * s["share_bytes"])
            g = s["rss_growth_bytes"]
            add(f"rss-{store}-{size}-{label}", f"{where}: {label} memory flat from save 2 "
                f"to save N", "PASS" if g <= slack else "FAIL",
                f"peak grew {format_bytes(g)} (allowed {format_bytes(slack)}: 5% of the "
                f"rank's share or 32 MiB)" + (f"; staging allocations "
                                              f"{s['staging_allocations']}"
                                              if "staging_allocations" in s else ""))
    for entry in result.get("resume", []):
        s = entry["summary"]
        tier, local = _med(s.get("tier")), _med(s.get("local"))
        text = f"resume {format_bytes(entry['size'])}: local tier >= 0.8x a plain local load"
        if tier is None or local is None:
            add(f"resume-{entry['size']}", text, "SKIP", "a resume load did not run")
        else:
            add(f"resume-{entry['size']}", text, "PASS" if local / tier >= 0.8 else "FAIL",
                f"tier {tier:.2f} s, plain local {local:.2f} s: {local / tier:.2f}x; remote "
                f"{_med(s.get('remote')) or float('nan'):.2f} s")
    return targets


def _summarize_resume(entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for source, runs in entry["loads"].items():
        out[source] = _spread([max(r["seconds"] for r in run) for run in runs])
    out["verified"] = all(r["verified"] for runs in entry["loads"].values()
                          for run in runs for r in run)
    out["ok"] = out["verified"] and not entry["errors"] and all(entry["loads"].values())
    return out


# -- outputs -------------------------------------------------------------------------------


def _s(sp: dict[str, Any] | None, fmt: str = ".2f") -> str:
    if not sp:
        return "—"
    if sp["n"] == 1 or sp["min"] == sp["max"]:
        return f"{sp['median']:{fmt}}"
    return f"{sp['median']:{fmt}} [{sp['min']:{fmt}}-{sp['max']:{fmt}}]"


def _mib(v: float | None) -> str:
    return "—" if v is None else f"{v / _MiB:.0f}"


def render_markdown(result: dict[str, Any]) -> str:
    """The Markdown report (``result`` as in ``results.json``)."""
    cfg, m = result["config"], result["machine"]
    lines = [f"# dcpstore stall suite ({cfg['mode']} mode, {result['started']})", ""]
    if result.get("partial"):
        lines += ["**Partial: the run was stopped or is still going; these are the cases "
                  "that finished.**", ""]
    lines.append(f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), "
                 f"{format_bytes(m['memory_bytes'])} RAM, Linux {m['kernel']}, Python "
                 f"{m['python']}, {checkout_text(result.get('checkout'), m.get('git_commit'))}. "
                 "Versions: "
                 + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v) + ".")
    lines.append("")
    q = result.get("quiet", {})
    if q.get("warning"):
        lines += [f"**Warning (at the start): {q['warning']}.**", ""]
    note = load_note(result)
    if note:
        lines += [f"**Warning: {note}.**" if note.startswith("machine not quiet")
                  else f"Load: {note}.", ""]
    lines.append(
        f"{cfg['world_size']} ranks (gloo, CPU); {cfg['saves']} saves per run with a compute "
        f"step of fixed work between ({cfg.get('compute', 'matmul')}); {cfg['runs']} run(s) "
        "per case in a seeded balanced random order; **median [min-max]** over runs, "
        "steady state = saves 2.."
        f"{cfg['saves']} of every run. Blocked: slowest rank; durable: until the step's "
        "commit marker is visible in the store, from when the save could start; memory: "
        "peak extra per rank (process tree). "
        f"{cfg['request_settings']}. Duration {result['duration_s'] / 60:.1f} min. "
        f"Command: `{result['command']}`")
    lines.append("")
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for c in result["cases"]:
        groups.setdefault((c["size"], c["store"]), []).append(c)
    for (size, store), cases in groups.items():
        order = {label: i for i, label in enumerate(
            SYSTEMS[STORE_KINDS.get(store, "local")])}
        cases.sort(key=lambda c: order.get(c["system"], 99))
        copy = copy_limit(result, size, store)
        blocking = next((_med(c["summary"].get("steady_durable_s")) for c in cases
                         if c["system"] == "dcpstore[blocking]"), None)
        compute = cfg.get("compute_s", {}).get(f"{format_bytes(size)} {store}")
        lines += [f"## {store}, {format_bytes(cases[0]['state_bytes'])} state"
                  + (f" (compute step ~{compute:.1f} s)" if compute else ""), "",
                  "| system | blocked s, steady | of which waiting | x copy | blocked s, save 1 "
                  "| durable s, steady | x blocking | peak extra MiB/rank, save 1 / 2 / N | "
                  "compute s | load s | verified |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|:-:|"]
        for c in cases:
            s = c["summary"]
            if not s.get("runs_ok"):
                lines.append(f"| {c['system']} | failed | | | | | | | | | — |")
                continue
            b, d = _med(s["steady_blocked_s"]), _med(s["steady_durable_s"])
            ps = s["per_save"]
            mem = " / ".join(_mib(_med(ps[i]["peak_extra_bytes"])) for i in (0, 1, -1))
            lines.append("| " + " | ".join([
                c["system"], _s(s["steady_blocked_s"], ".3f"),
                _s(s.get("steady_waited_s"), ".3f"),
                f"{b / copy:.2f}" if b is not None and copy else "—",
                _s(s["first_blocked_s"], ".3f"), _s(s["steady_durable_s"]),
                f"{d / blocking:.2f}" if d is not None and blocking else "—",
                mem, _s(s["compute_s"]), _s(s.get("load_s")),
                "—" if "verified" not in s else ("yes" if s["verified"] else "**NO**"),
            ]) + " |")
        for c in cases:
            if c["summary"].get("drains_skipped"):
                lines.append(f"| {c['system']} | drains skipped (latest wins) per run: "
                             f"{c['summary']['drains_skipped']}; durable over the drained "
                             "saves | | | | | | | | | |")
        for sk in result.get("skipped", []):
            if sk["store"] == store and sk["size"] == size:
                lines.append(f"| {sk['system']} | {sk['reason']} | | | | | | | | | |")
        lines.append("")
    if result.get("resume"):
        lines += ["## Resume after a restart (SeaweedFS remote)", "",
                  "| state | from the local tier, s | from SeaweedFS, s | plain local load, s "
                  "| local / tier | verified |", "|---|--:|--:|--:|--:|:-:|"]
        for e in result["resume"]:
            s = e["summary"]
            tier, local = _med(s.get("tier")), _med(s.get("local"))
            lines.append("| " + " | ".join([
                format_bytes(e["state_bytes"]), _s(s.get("tier")), _s(s.get("remote")),
                _s(s.get("local")), f"{local / tier:.2f}" if tier and local else "—",
                "yes" if s["verified"] else "**NO**"]) + " |")
        lines.append("")
    lines += ["## Targets", "", "| target | result | |", "|---|---|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | {t['detail']} | {t['status']} |")
    errors = [(c["store"], c["system"], e) for c in result["cases"] for e in c["errors"]]
    errors += [("seaweedfs", "resume", e) for r in result.get("resume", []) for e in r["errors"]]
    if errors:
        lines += ["", "## Errors", ""]
        for store, system, e in errors:
            lines.append(f"- {store} {system}: `{e.strip().splitlines()[0][:300]}`")
    return "\n".join(lines) + "\n"


def write_chart(result: dict[str, Any], path: Path) -> None:
    """Blocked and durable seconds (steady state, median with min-max bars) per system,
    one row of panels per store and size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for c in result["cases"]:
        if c["summary"].get("runs_ok"):
            groups.setdefault((c["size"], c["store"]), []).append(c)
    rows = max(1, len(groups))
    fig, axes = plt.subplots(rows, 2, figsize=(12, 0.32 * 14 * rows + 1), squeeze=False)
    for row, ((size, store), cases) in enumerate(groups.items()):
        order = {label: i for i, label in enumerate(SYSTEMS[STORE_KINDS.get(store, "local")])}
        cases.sort(key=lambda c: order.get(c["system"], 99))
        names = [c["system"] for c in cases]
        for col, key in enumerate(("steady_blocked_s", "steady_durable_s")):
            ax = axes[row][col]
            sp = [c["summary"].get(key) for c in cases]
            med = [s["median"] if s else 0.0 for s in sp]
            err = [[(s["median"] - s["min"]) if s else 0 for s in sp],
                   [(s["max"] - s["median"]) if s else 0 for s in sp]]
            colors = ["#E3A33B" if n == "copy-limit" else "#2F6DB5" if n.startswith(
                "dcpstore") else "#9A9A9A" for n in names]
            ax.barh(range(len(names)), med, xerr=err, color=colors, capsize=2)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("seconds", fontsize=8)
            ax.grid(axis="x", alpha=0.3)
            what = "blocked" if col == 0 else "until durable"
            ax.set_title(f"{store} {format_bytes(size)}: {what} (saves 2..N)", fontsize=9)
    fig.suptitle("checkpoint stall: dcpstore (blue), torch / s3torchconnector (grey), one "
                 "memory copy (orange); median, min-max bars", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _write_results(result: dict[str, Any], out: Path) -> str:
    """results.json and results.md of the cases finished so far (``"partial": true``
    until the end); returns the Markdown."""
    for c in result["cases"]:
        c["summary"] = summarize(c)
    for e in result.get("resume", []):
        e["summary"] = _summarize_resume(e)
    result["targets"] = evaluate_targets(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = render_markdown(result)
    (out / "results.md").write_text(md)
    return md


def _finish(result: dict[str, Any], out: Path) -> int:
    md = _write_results(result, out)
    try:
        write_chart(result, out / "chart.png")
    except ImportError as exc:
        logger.warning("no chart: %s", exc)
    print()
    print(md.split("\n## Targets")[0])
    for t in result["targets"]:
        print(f"{t['status']}: {t['target']} -- {t['detail']}")
    print(f"\nwrote {out / 'results.json'}, results.md, chart.png "
          f"({result['duration_s'] / 60:.1f} min)")
    healthy = all(c["summary"]["ok"] for c in result["cases"]) and all(
        e["summary"]["ok"] for e in result.get("resume", []))
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
