"""``python -m benchmarks``: the one command that runs the whole benchmark.

It starts the stores (a local directory, SeaweedFS, moto, fake-gcs-server, all on
127.0.0.1), spawns the ranks, runs every system's saves and loads interleaved, the
reshard loads and the request-counting runs, and writes ``results.json``,
``results.md`` and ``chart.png`` under ``--out``; the Markdown table and a PASS/FAIL
line per target are printed too. See ``docs/performance.md``.

Examples::

    python -m benchmarks --quick                     # < 2 min smoke run (CI)
    python -m benchmarks --out benchmarks/results/latest --publish
    python -m benchmarks --stores seaweedfs --systems 'dcpstore-*' 'limit-*' --runs 5
    python -m benchmarks --opt s3.part_size=64MiB --opt s3.max_concurrency=8
    python -m benchmarks --stores seaweedfs --systems msc --grid thread_count=1,8
    python -m benchmarks --opt s3torchconnector.part_size=32MiB --no-tune
    python -m benchmarks --quick --tls --stores seaweedfs gcs   # over HTTPS

Each peer runs at its defaults and, after a short tuning phase over a small grid
(:mod:`benchmarks.tuning`), at its best setting as ``<peer>[best]``; the runs of a
store go in a seeded, balanced random order (:func:`benchmarks.runner.balanced_order`);
the machine is checked for other load first (:func:`quiet_check`).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dcpstore.testing.tls import TLSFiles, throwaway_tls

from . import report, systems, tuning
from .env import (
    REPO,
    DirtyTree,
    add_output_args,
    default_out,
    machine_info,
    run_checkout,
    versions,
)
from .options import ALL_LIMITS, fill_defaults, options_for, parse_opts
from .ranks import RankPool
from .runner import Runner, StorePlan
from .servers import STORE_KINDS, Stores
from .workload import MIXES, WorkloadSpec, parse_size

__all__ = ["main", "options_for", "parse_args", "quiet_check"]

logger = logging.getLogger(__name__)

#: Where ``--publish`` copies the chart for the docs.
DOCS_CHART = REPO / "docs" / "img" / "performance.png"

# (full, quick) defaults
_DEFAULTS = {
    # quick: small enough that twice the runs of old, the [best] copies and the tuning
    # still fit in CI's 2 minutes
    "size": ("1GiB", "32MiB"),
    "moto_size": ("128MiB", "16MiB"),
    "gcs_size": ("256MiB", "16MiB"),
    # even: every ordered pair of systems is balanced (see runner.balanced_order)
    "runs": (6, 2),
    "tensors": (32, 16),
    # 3: every rank reads parts of the saved items (where reading more than needed
    # shows), about 2.5 min of a full run; 1 (one rank reads every file) is left to
    # --reshard 1 3, to keep the full run under 20 min
    "reshard": ([3], [1]),
    # the variants that were the fastest of all (ALL_LIMITS) for some store and
    # operation: boto3's client, one multipart object, 64 MiB x 8 (SeaweedFS save, moto
    # load in the full run at b067da1), and many single-PUT objects (faster than every
    # other variant on moto, where dcpstore with many files beat the old limit).
    # 16 MiB x 16 (moto's save at b067da1) never led on SeaweedFS in the three runs at
    # f4406e7 / 246c8a8 / 3866d0a and is left to --limit-s3 (make bench's moto run names
    # its two many-object variants). 32 MiB x 8 was within 3% of 64 MiB x 8 where it
    # led; the managed transfer and the CRT client never led
    "limit_s3": (["64MiBx8", "objects-16MiBx8"], ["64MiBx8", "objects-8MiBx4"]),
    "limit_gcs": (["32MiBx8", "16MiBx16"], ["32MiBx8"]),
    # the tuning phase: runs per grid point, the state size (at most the store's), and
    # the grid's values where they differ from the systems' (threads 1/4/8, parts 8/32 MiB)
    "tune_runs": (1, 1),
    # then per peer the 2 fastest saves and readers run once more (quick: the one point)
    "tune_confirm": (2, 1),
    # quick: tune on one store only, enough to run the tuning and [best] paths end to end
    "tune_stores": (list(STORE_KINDS), ["seaweedfs"]),
    "tune_size": ("256MiB", "16MiB"),
    # quick: one point per peer, enough to run the tuning and [best] paths end to end
    "grid": ([], ["thread_count=4", "part_size=32MiB"]),
    # wb: parallel writes with write-back started as they go (the fastest load);
    # direct: O_DIRECT (the fastest save); dd (write, then fsync) never led
    "limit_local": (["wb16MiBx2", "direct16MiBx4"], ["wb16MiBx2"]),
    # bytes written to SeaweedFS before it is replaced by a fresh server (quick: small,
    # so that the smoke run replaces it too)
    "server_budget": ("32GiB", "512MiB"),
}
#: Stores the reshard loads run on by default.
_RESHARD_STORES = ["local", "seaweedfs"]
#: MB/s (save, load) per store for the time estimate on a 2-core machine: the mean time
#: over the systems of the full run at commit 609060b (reshard loads: half the load's).
_ASSUMED_MBPS = {"local": (2300, 5600), "seaweedfs": (180, 600), "moto": (160, 300),
                 "gcs": (170, 900)}
#: Seconds per job beyond its timed part (that run: 0.17)
_JOB_OVERHEAD_S = 0.2
#: Measured / modelled duration per store of the full run at b067da1, whose config
#: :func:`estimate_seconds` gives 17.3 min (local, seaweedfs, gcs at 2 ranks; it took
#: 20.9, with ~1 min of SeaweedFS errors) and 5.1 min (moto, 1 rank, 256 MiB; it took
#: 7.7): what the model leaves out (set-up, deletes, verification, the proxy).
_CALIBRATION = {"local": 1.21, "seaweedfs": 1.21, "gcs": 1.21, "moto": 1.5}
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (quick/full defaults filled in)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Save/load throughput of dcpstore vs torch, s3torchconnector, MSC and "
                    "the raw limit, against local stores on 127.0.0.1.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Full-mode defaults: --size 1GiB --moto-size 128MiB --gcs-size 256MiB "
               "--runs 6 --tensors 32 --reshard 3 --tune-runs 1 --tune-confirm 2 "
               "--tune-size 256MiB --server-budget 32GiB --limit-s3 64MiBx8 "
               "objects-16MiBx8 --limit-local wb16MiBx2 direct16MiBx4.\n"
               "Quick-mode defaults: --size 32MiB --moto-size 16MiB --gcs-size 16MiB "
               "--runs 2 --tensors 16 --reshard 1 --tune-runs 1 --tune-confirm 1 "
               "--tune-size 16MiB --tune-stores seaweedfs --grid thread_count=4 "
               "part_size=32MiB --server-budget 512MiB --limit-s3 64MiBx8 objects-8MiBx4 "
               "--limit-local wb16MiBx2.\n"
               "The limit is the fastest of the variants run, per store and operation; "
               "--all-limits runs every variant (also dd, 32MiBx8, more objects "
               "variants, the managed transfer and the CRT client), to check that the "
               "defaults still hold the fastest.\n"
               "Duration: printed first (estimate_seconds, calibrated on a full run); "
               "`make bench` (this at 2 ranks on local, seaweedfs and gcs, then moto at "
               "1 rank and 256 MiB) is ~25 min on 2 cores at --size 1GiB and ~17.5 at "
               "512MiB (make bench BENCH_SIZE=512MiB); results.json records each "
               "phase's and each job's wall time.")
    p.add_argument("--quick", action="store_true",
                   help="small state, two runs, a small grid, one variant per limit "
                        "(< 2 min; CI smoke)")
    p.add_argument("--size", help="state size on local and seaweedfs (e.g. 1GiB)")
    p.add_argument("--moto-size", help="state size on moto (in-memory, slow)")
    p.add_argument("--gcs-size", help="state size on fake-gcs-server (in-memory)")
    p.add_argument("--world-size", type=int, default=2, help="ranks that save (default 2)")
    p.add_argument("--runs", type=int, help="timed runs per case (median and min-max "
                   "reported; even, so the order is balanced)")
    p.add_argument("--order-seed", type=int, help="seed of the run order (default: "
                   "random; recorded in the results)")
    p.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                   help="tune each peer over its grid first and also run it at its best "
                        "(default: on)")
    p.add_argument("--tune-runs", type=int, help="runs per grid point in the tuning phase")
    p.add_argument("--tune-confirm", type=int, metavar="N",
                   help="then one more run of each peer's N fastest saves and N fastest "
                        "readers (0: none)")
    p.add_argument("--tune-stores", nargs="+", choices=list(STORE_KINDS),
                   help="stores with a tuning phase (default: all; quick: seaweedfs)")
    p.add_argument("--tune-size", help="state size of the tuning phase (at most each "
                   "store's)")
    p.add_argument("--grid", nargs="+", metavar="KEY=V1,V2",
                   help="grid values replacing the peers' own (thread_count=1,4,8 "
                        "part_size=8MiB,32MiB)")
    p.add_argument("--tensors", type=int, help="tensors in the state dict")
    p.add_argument("--mix", choices=MIXES, default="mixed", help="tensor size mix")
    p.add_argument("--seed", type=int, default=0, help="changes every value")
    p.add_argument("--stores", nargs="+", choices=list(STORE_KINDS),
                   default=list(STORE_KINDS), help="stores to run on (default: all)")
    p.add_argument("--systems", nargs="+", metavar="PATTERN",
                   help="only systems matching these names / shell patterns "
                        f"(known: {', '.join(systems.names())})")
    p.add_argument("--reshard", nargs="*", type=int, metavar="M",
                   help="also load each DCP checkpoint at these world sizes "
                        "(empty: no reshard loads)")
    p.add_argument("--reshard-stores", nargs="+", choices=list(STORE_KINDS),
                   default=_RESHARD_STORES, help="stores with reshard loads "
                   f"(default: {' '.join(_RESHARD_STORES)})")
    p.add_argument("--limit-s3", nargs="+", metavar="[CLIENT-]PARTxN",
                   help="raw S3 limit variants, client (client: one multipart object; "
                        "objects: many single-PUT objects of part size; transfer; crt) - "
                        "part size x requests in flight (default 64MiBx8 "
                        "objects-16MiBx8; the fastest is the limit)")
    p.add_argument("--limit-gcs", nargs="+", metavar="PARTxN",
                   help="raw GCS limit variants (default 32MiBx8 16MiBx16)")
    p.add_argument("--limit-local", nargs="+", metavar="VARIANT",
                   help="local limit variants: dd, wbCHUNKxTHREADS, directCHUNKxTHREADS "
                        "(default wb16MiBx2 direct16MiBx4)")
    p.add_argument("--all-limits", action="store_true",
                   help="run every limit variant of every store (the --limit-* not "
                        "given): " + "; ".join(f"{k[6:]}: {' '.join(v)}"
                                               for k, v in ALL_LIMITS.items()))
    p.add_argument("--server-budget", metavar="SIZE",
                   help="bytes written to SeaweedFS before it is replaced by a fresh, "
                        "empty server between two cases (it reclaims deleted objects' "
                        "space lazily; default 32GiB, quick 512MiB)")
    p.add_argument("--opt", action="append", default=[], metavar="[SCOPE.]KEY=VALUE",
                   help="option for a system: SCOPE is a system name (torch-fsspec-s3."
                        "thread_count=4, s3torchconnector.part_size=32MiB; the msc peer: "
                        "multistorageclient.thread_count=4), a dcpstore backend "
                        "(s3.part_size=64MiB, file., gcs., msc.) or 'dcpstore' (every "
                        "dcpstore system; also the default scope). Repeatable.")
    p.add_argument("--count-requests", action=argparse.BooleanOptionalAction, default=True,
                   help="one extra untimed run per system (not the limits) through a "
                        "counting proxy "
                        "(default: on)")
    p.add_argument("--tls", action="store_true",
                   help="serve every store over HTTPS (a certificate for 127.0.0.1 from a "
                        "throwaway CA made at start-up) and have every client trust that "
                        "CA (AWS_CA_BUNDLE, SSL_CERT_FILE), as real object stores are "
                        "reached; the counting proxy serves HTTPS too")
    p.add_argument("--evict-cache", action="store_true",
                   help="cold loads: drop the page cache of the local checkpoint and of "
                        "SeaweedFS's data files before every load, for every system "
                        "(default: loads read a warm page cache)")
    p.add_argument("--local-dir", help="directory of the local store (default: a temporary "
                   "directory on the system's temp disk)")
    p.add_argument("--publish", action="store_true",
                   help=f"copy the chart to {DOCS_CHART.relative_to(REPO)}")
    p.add_argument("--list", action="store_true", help="list systems and exit")
    p.add_argument("--curves", action="store_true",
                   help="run the scaling curves instead (benchmarks/curves.py; "
                        "python -m benchmarks --curves --help lists their options)")
    add_output_args(p, "", "results.md, chart.png and the targets (no measuring)")
    args = p.parse_args(argv)
    fill_defaults(args, _DEFAULTS)
    if args.world_size < 1 or args.runs < 1 or args.tune_runs < 1 or args.tune_confirm < 0:
        p.error("--world-size, --runs and --tune-runs must be >= 1, --tune-confirm >= 0")
    if args.order_seed is None:
        args.order_seed = int.from_bytes(os.urandom(4), "little")
    args.reshard = sorted({m for m in args.reshard if m != args.world_size})
    if any(m < 1 for m in args.reshard):
        p.error("--reshard world sizes must be >= 1")
    try:
        args.sizes = {"local": parse_size(args.size), "seaweedfs": parse_size(args.size),
                      "moto": parse_size(args.moto_size), "gcs": parse_size(args.gcs_size)}
        args.options = parse_opts(args.opt)
        args.tune_bytes = parse_size(args.tune_size)
        args.server_budget_bytes = parse_size(args.server_budget)
        args.grid_values = tuning.parse_grid(args.grid)
        for name in ("s3", "gcs", "local"):
            for v in getattr(args, f"limit_{name}"):
                systems.get(f"limit-{name}[{v}]")
    except (ValueError, KeyError) as exc:
        p.error(str(exc))
    if args.out is None:
        args.out = default_out(args.mode)
    return args


def _selected(name: str, patterns: list[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def build_plans(args: argparse.Namespace) -> list[StorePlan]:
    """One plan per store: workload, systems (available and selected), reshard sizes."""
    plans = []
    for store in args.stores:
        kind = STORE_KINDS[store]
        spec = WorkloadSpec(args.sizes[store], tensors=args.tensors, mix=args.mix,
                            seed=args.seed)
        labels: list[str] = []
        skipped: dict[str, str] = {}
        for name in systems.DEFAULT_SYSTEMS[kind]:
            # a bracket in --systems names a variant of a system as given
            # (``dcpstore-s3[adaptive_concurrency=false]``: an A/B beside the defaults)
            given = [systems.split_variant(p)[1] for p in args.systems or ()
                     if "[" in p and systems.split_variant(p)[0] == name]
            plain = not args.systems or _selected(
                name, [p for p in args.systems if "[" not in p] or ["\0"])
            if not plain and not given:
                continue
            variants = {"limit-s3": args.limit_s3, "limit-gcs": args.limit_gcs,
                        "limit-local": args.limit_local}.get(name)
            if given:
                variants = ([""] if plain and not variants else list(variants or [])) + given
            for label in ([f"{name}[{v}]" if v else name for v in variants] if variants
                          else [name]):
                reason = systems.get(label).unavailable()
                if reason:
                    skipped[label] = reason
                else:
                    labels.append(label)
        note = ""
        if store == "moto":
            note = "moto: in-memory, single-threaded Python server; smaller state"
        elif store == "gcs":
            note = "fake-gcs-server: in-memory; smaller state"
        reshard = args.reshard if store in args.reshard_stores else []
        plans.append(StorePlan(store, spec, labels, reshard, note, skipped))
    return plans


def tune_plans(plans: list[StorePlan], args: argparse.Namespace) -> list[StorePlan]:
    """The tuning phase's plans: per store, every grid point of every peer that runs
    there, on a quarter of the store's state (at most ``--tune-size``), no reshard
    loads, no counting."""
    out = []
    for plan in plans:
        if plan.name not in args.tune_stores:
            continue
        labels = []
        for label in plan.systems:
            system = systems.get(label)
            if system.grid and not system.variant:
                labels += [tuning.point_label(label, p)
                           for p in tuning.grid_points(system.grid, args.grid_values)]
        if labels:
            w = plan.workload
            size = min(args.tune_bytes, max(w.total_bytes // 4, w.tensors * (64 << 10)))
            spec = WorkloadSpec(size, tensors=w.tensors, mix=w.mix, seed=w.seed)
            out.append(StorePlan(plan.name, spec, labels))
    return out


def confirm_plans(tplans: list[StorePlan], cases: list[dict[str, Any]], count: int
                  ) -> list[StorePlan]:
    """The tuning's second round: per store, each peer's leading grid points
    (:func:`benchmarks.tuning.leaders`) on the same state, to run once more."""
    out = []
    for tp in tplans:
        mine = [c for c in cases if c["store"] == tp.name]
        names = dict.fromkeys(systems.split_variant(x)[0] for x in tp.systems)
        labels = [label for n in names for label in tuning.leaders(n, mine, count)]
        if labels:
            out.append(StorePlan(tp.name, tp.workload, labels))
    return out


def apply_tuning(plans: list[StorePlan], tuned: dict[str, dict[str, Any]]) -> None:
    """Add ``<peer>[best]`` after each tuned peer whose best is not its defaults; the
    peer's defaults then run without reshard loads and counting run (the peer is judged
    at its best)."""
    for plan in plans:
        for name, best in tuned.get(plan.name, {}).items():
            if name not in plan.systems or tuning.is_default(name, best):
                continue
            if best["save"]["options"] is None or best["load"]["options"] is None:
                logger.warning("%s: no tuning result for %s (its grid points failed); it "
                               "runs at its defaults only", plan.name, name)
                continue
            plan.systems.insert(plan.systems.index(name) + 1, f"{name}[best]")
            plan.secondary.append(name)


def _grid_size(label: str, args: argparse.Namespace) -> int:
    system = systems.get(label)
    return len(tuning.grid_points(system.grid, args.grid_values)) if system.grid else 0


def estimate_seconds(plans: list[StorePlan], args: argparse.Namespace) -> float:
    """A rough duration of the run on a quiet 2-core machine (printed before it starts),
    assuming every tuned peer also runs as ``<peer>[best]``; calibrated on a full run
    (:data:`_CALIBRATION`)."""
    total = 30.0  # servers and ranks starting
    for plan in plans:
        before = total
        save_mbps, load_mbps = _ASSUMED_MBPS[plan.name]
        mb = plan.workload.state_bytes / 1e6
        tune_mb = min(args.tune_bytes, plan.workload.state_bytes // 4) / 1e6
        for label in plan.systems:
            system = systems.get(label)
            points = (_grid_size(label, args)
                      if args.tune and plan.name in args.tune_stores else 0)
            copies = 2 if points else 1  # defaults and [best]
            reshard = 0 if system.is_limit else len(plan.reshard)
            one = (mb / save_mbps + mb / load_mbps + 2 * _JOB_OVERHEAD_S)
            re = reshard * (2 * mb / load_mbps + _JOB_OVERHEAD_S)  # at [best] only
            total += args.runs * (copies * one + re)
            # the second round: at most the 2 x --tune-confirm leaders per peer
            tune_jobs = args.tune_runs * points + min(points, 2 * args.tune_confirm)
            total += tune_jobs * (tune_mb / save_mbps + tune_mb / load_mbps
                                  + 2 * _JOB_OVERHEAD_S)
            if args.count_requests and plan.kind != "local" and not system.is_limit:
                # through the proxy (about as fast as a timed run there); neither the
                # limits nor a peer's defaults when its [best] runs are counted
                total += one + re
        total = before + (total - before) * _CALIBRATION.get(plan.name, 1.0)
    return total


def quiet_check(seconds: float = 2.0) -> dict[str, Any]:
    """Is the machine quiet? The load averages and the CPU use of every other process
    over ``seconds`` (psutil; without it, the load averages only).

    Returns:
        ``{"quiet", "load_avg", "cpus", "busy", "warning"}``; ``busy`` lists the other
        processes using more than 5% of a core.
    """
    cpus = os.cpu_count() or 1
    load = list(os.getloadavg())
    busy: list[dict[str, Any]] = []
    others_cpu = None
    try:
        import psutil

        me = psutil.Process()
        mine = {me.pid, *(c.pid for c in me.children(recursive=True))}
        procs = [p for p in psutil.process_iter(["pid", "name"]) if p.pid not in mine]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.cpu_percent(None)
        time.sleep(seconds)
        others_cpu = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                pct = proc.cpu_percent(None)
                others_cpu += pct
                if pct > 5.0:
                    busy.append({"pid": proc.pid, "name": proc.info["name"],
                                 "cpu_percent": round(pct, 1)})
    except ImportError:
        pass
    busy.sort(key=lambda b: -b["cpu_percent"])
    reasons = []
    if others_cpu is not None and others_cpu > 25.0:
        reasons.append(f"other processes use {others_cpu:.0f}% of a core ("
                       + ", ".join(f"{b['name']} {b['cpu_percent']:.0f}%" for b in busy[:5])
                       + ")")
    if load[0] > 0.5 * cpus:
        reasons.append(f"load average {load[0]:.2f} on {cpus} CPUs")
    warning = ("the machine is not quiet: " + "; ".join(reasons)
               + ". The figures are noisier than on a quiet machine.") if reasons else None
    return {"quiet": not reasons, "load_avg": load, "cpus": cpus,
            "others_cpu_percent": others_cpu, "busy": busy[:10], "warning": warning}


def _job_timeout(state_bytes: int) -> float:
    # generous: 2 MB/s is far below anything healthy; this only catches hangs
    return max(180.0, state_bytes / 2e6)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 0 when every case ran and every load verified."""
    given = sys.argv[1:] if argv is None else argv
    if "--curves" in given:
        from . import curves

        return curves.main([a for a in given if a != "--curves"])
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    if args.list:
        for name in systems.names():
            s = systems.get(name)
            why = s.unavailable()
            print(f"{name:<20} {'/'.join(s.kinds):<6} {s.description}"
                  + (f"  [unavailable: {why}]" if why else ""))
        return 0
    if args.render is not None:
        return render(args.render)
    try:
        # before anything is measured: results for the committed tree need a clean one
        args.checkout = run_checkout(args.out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"python -m benchmarks: refusing to run: {exc}", file=sys.stderr)
        return 2
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    with tls_material(args.tls) as tls:
        return _run(args, argv, tls)


@contextlib.contextmanager
def tls_material(enabled: bool) -> Iterator[TLSFiles | None]:
    """``--tls``: a throwaway CA and a server certificate for 127.0.0.1 in a temporary
    directory (removed on exit, never under ``--out``), its client variables
    (:meth:`TLSFiles.client_env`) set in this process's environment before the ranks
    are spawned, so that every client in them trusts it (aiohttp reads
    ``SSL_CERT_FILE`` when it is imported); ``None`` without ``--tls``."""
    if not enabled:
        yield None
        return
    with throwaway_tls() as tls:
        env = tls.client_env()
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield tls
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _run(args: argparse.Namespace, argv: list[str] | None, tls: TLSFiles | None) -> int:
    """The benchmark proper (after the arguments and ``--tls``'s CA)."""
    plans = build_plans(args)
    quiet = quiet_check()
    started = time.time()
    print(f"dcpstore benchmark, {args.mode} mode: {args.world_size} ranks, {args.runs} run(s) "
          f"per case (order seed {args.order_seed}), results in {args.out}")
    if tls is not None:
        print("  TLS: every store over HTTPS (throwaway CA; clients trust it through "
              "AWS_CA_BUNDLE / SSL_CERT_FILE, per system in results.md)")
    if quiet["warning"]:
        print(f"  WARNING: {quiet['warning']}")
    if args.runs % 2:
        print("  note: an odd --runs leaves one run order unpaired (not balanced)")
    tplans = tune_plans(plans, args) if args.tune else []
    for plan in plans:
        extra = f", reshard loads at {plan.reshard}" if plan.reshard else ""
        print(f"  {plan.name:<9} {plan.workload.describe()}: {', '.join(plan.systems)}{extra}")
        for label, reason in plan.skipped.items():
            print(f"  {plan.name:<9} SKIP {label}: {reason}")
    for plan in tplans:
        print(f"  {plan.name:<9} tuning, {plan.workload.describe()}, {args.tune_runs} run(s) "
              f"of {len(plan.systems)} grid points, then one more of each peer's "
              f"{args.tune_confirm} fastest saves and readers")
    print(f"  estimated duration: ~{estimate_seconds(plans, args) / 60:.1f} min "
          "(2-core machine; rough)")
    sys.stdout.flush()
    args.out.mkdir(parents=True, exist_ok=True)

    tuned: dict[str, dict[str, Any]] = {}
    #: wall seconds of each phase (start-up, tuning, confirmation, the runs per store)
    phases: dict[str, Any] = {}
    replacements: list[dict[str, Any]] = []
    grid_values = args.grid_values
    msc_parts = sorted({int(v) for k, vals in
                        [*systems.get("msc").grid.items(), *grid_values.items()]
                        if k == "part_size" for v in vals}
                       | {int(v) for k, v in args.options.get("msc", {}).items()
                          if k == "part_size"})
    pools: dict[int, RankPool] = {}
    try:
        # start the ranks (they import torch meanwhile) before the servers
        for size in sorted({args.world_size, *(m for p in plans for m in p.reshard)}):
            pools[size] = RankPool(size)
        with Stores([p.name for p in plans], args.out, local_dir=args.local_dir,
                    count_requests=args.count_requests, msc_part_sizes=tuple(msc_parts),
                    budgets={"seaweedfs": args.server_budget_bytes}, tls=tls) as stores:
            def progress(line: str) -> None:
                print(line, flush=True)

            phases["start"] = time.time() - started
            if tplans:
                mark = time.time()

                def tuner_for(runs: int, seed: int, label: str) -> Runner:
                    return Runner(
                        stores, pools, RankPool, world_size=args.world_size, runs=runs,
                        count_requests=False, evict_cache=args.evict_cache,
                        options=lambda store, label, op: options_for(args.options, label,
                                                                     op),
                        job_timeout=_job_timeout, progress=progress, seed=seed, label=label)

                tuner = tuner_for(args.tune_runs, args.order_seed + 1000, "tune ")
                tune_cases = [c.to_dict() for c in tuner.run(tplans)]
                replacements += tuner.replacements
                phases["tuning"] = time.time() - mark
                cplans = confirm_plans(tplans, tune_cases, args.tune_confirm)
                confirm_orders: dict[str, list[list[str]]] = {}
                if cplans:
                    mark = time.time()
                    confirmer = tuner_for(1, args.order_seed + 2000, "tune+")
                    tune_cases += [c.to_dict() for c in confirmer.run(cplans)]
                    replacements += confirmer.replacements
                    confirm_orders = confirmer.orders
                    phases["tuning confirm"] = time.time() - mark
                for tp in tplans:
                    mine = [c for c in tune_cases if c["store"] == tp.name]
                    names = dict.fromkeys(systems.split_variant(x)[0] for x in tp.systems)
                    tuned[tp.name] = {n: tuning.pick_best(n, mine, tp.workload.state_bytes)
                                      for n in names}
                    for n, best in tuned[tp.name].items():
                        best["state_bytes"] = tp.workload.state_bytes
                        best["orders"] = tuner.orders.get(tp.name)
                        best["confirm_order"] = confirm_orders.get(tp.name)
                        print(f"  {tp.name:<9} best {n}: save {best['save']['options']}, "
                              f"load {best['load']['options']}", flush=True)
                apply_tuning(plans, tuned)
            runner = Runner(
                stores, pools, RankPool, world_size=args.world_size, runs=args.runs,
                count_requests=args.count_requests, evict_cache=args.evict_cache,
                options=lambda store, label, op: options_for(args.options, label, op,
                                                             tuned.get(store)),
                job_timeout=_job_timeout, progress=progress, seed=args.order_seed)
            mark = time.time()
            cases = runner.run(plans)
            replacements += runner.replacements
            phases["runs"] = time.time() - mark
            phases["per store"] = runner.phase_seconds
            stores_info = stores.describe()
    finally:
        for pool in pools.values():
            pool.close()

    kinds = {}
    for plan in plans:
        for label in plan.systems:
            s = systems.get(label)
            kinds[label] = (s.is_limit, s.is_dcpstore)
    built = report.build([c.to_dict() for c in cases], kinds)
    for plan in plans:
        stores_info[plan.name].update(
            state_bytes=plan.workload.state_bytes, workload=plan.workload.describe(),
            note=plan.note, systems=plan.systems, reshard=plan.reshard,
            secondary=plan.secondary, order=runner.orders.get(plan.name),
            settings={label: system_settings(args, plan.name, label, tuned)
                      for label in plan.systems})
    result: dict[str, Any] = {
        "harness_version": 2,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "duration_s": time.time() - started,
        "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in (
            sys.argv[1:] if argv is None else argv)),
        "phases_s": phases,
        "server_replacements": replacements,
        "machine": machine_info(),
        "checkout": getattr(args, "checkout", None),
        "quiet": quiet,
        "versions": versions(),
        "config": {"mode": args.mode, "world_size": args.world_size, "runs": args.runs,
                   "order_seed": args.order_seed, "tensors": args.tensors, "mix": args.mix,
                   "seed": args.seed, "sizes": args.sizes, "reshard": args.reshard,
                   "reshard_stores": args.reshard_stores, "limit_s3": args.limit_s3,
                   "limit_gcs": args.limit_gcs, "limit_local": args.limit_local,
                   "options": args.options,
                   "tune": args.tune, "tune_runs": args.tune_runs,
                   "tune_confirm": args.tune_confirm,
                   "server_budget": args.server_budget_bytes,
                   "all_limits": args.all_limits,
                   "tune_stores": args.tune_stores,
                   "tune_size": args.tune_bytes, "grid": grid_values,
                   "count_requests": args.count_requests, "evict_cache": args.evict_cache,
                   "tls": args.tls},
        "stores": stores_info,
        "tuning": tuned,
        "skipped": [{"store": p.name, "system": k, "reason": v}
                    for p in plans for k, v in p.skipped.items()],
        "cases": built,
    }
    result["targets"] = report.evaluate_targets(built, args.world_size)
    return _finish(result, args.out, publish=args.publish)


def system_settings(args: argparse.Namespace, store: str, label: str,
                    tuned: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a system ran with on ``store``: request settings and save / load options."""
    system = systems.get(label)
    trust = system.tls_trust()
    tls = {} if trust is None or STORE_KINDS[store] == "local" else {
        "tls": f"HTTPS, CA via {trust}" if getattr(args, "tls", False)
        else "off (plain HTTP)"}
    return {**system.settings(), **tls,
            "save options": options_for(args.options, label, "save", tuned.get(store)),
            "load options": options_for(args.options, label, "load", tuned.get(store))}


def _finish(result: dict[str, Any], out: Path, *, publish: bool) -> int:
    paths = report.write_outputs(result, out)
    if publish:
        DOCS_CHART.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(paths["chart"], DOCS_CHART)
    print()
    print(paths["markdown"].read_text().split("\n## Targets")[0])
    for t in result["targets"]:
        print(f"{t['status']}: {t['target']} -- {t['detail']}")
    print(f"\nwrote {paths['json']}, {paths['markdown']}, {paths['chart']}"
          + (f" and {DOCS_CHART}" if publish else "")
          + f" ({result['duration_s'] / 60:.1f} min)")
    cases = result["cases"]
    healthy = all(c["summary"]["ok"] and not c["errors"] for c in cases) and all(
        c["summary"].get("verified", True) for c in cases)
    return 0 if healthy else 1


def render(out: Path) -> int:
    """Rebuild the summaries, targets, Markdown and chart of ``out/results.json``."""
    result = json.loads((out / "results.json").read_text())
    kinds = {c["system"]: (c["summary"]["is_limit"], c["summary"]["is_dcpstore"])
             for c in result["cases"]}
    raw = [{k: v for k, v in c.items() if k not in ("summary", "ratios", "vs_limit")}
           for c in result["cases"]]
    result["cases"] = report.build(raw, kinds)
    result["targets"] = report.evaluate_targets(result["cases"],
                                                result["config"]["world_size"])
    return _finish(result, out, publish=False)
