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
import json
import logging
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import report, systems
from .cli import REPO, fill_defaults, machine_info, options_for, versions
from .ranks import RankPool
from .runner import Runner, StorePlan
from .servers import STORE_KINDS, Stores
from .workload import MIXES, WorkloadSpec, format_bytes, parse_size

__all__ = ["Point", "build_points", "estimate_seconds", "main", "parse_args", "render_markdown",
           "summarize_point", "write_charts"]

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
#: Assumed MB/s (save, load) of one point on a 2-core machine, for the estimate.
_ASSUMED_MBPS = {"local": (700, 1500), "seaweedfs": (130, 300), "moto": (60, 120),
                 "gcs": (90, 250)}
_POOL_START_S = 6.0  # per rank: spawn, import torch, gloo


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
    p.add_argument("--out", type=Path, help="results folder (default: "
                   "benchmarks/results/tmp/curves-<mode>-<time>)")
    p.add_argument("--render", type=Path, metavar="DIR",
                   help="only rebuild results.md and the charts from DIR/results.json")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    fill_defaults(args, _DEFAULTS)
    if args.runs < 1 or args.size_world < 1 or any(w < 1 for w in args.worlds):
        p.error("--runs, --size-world and --worlds must be >= 1")
    try:
        args.size_bytes = sorted(parse_size(s) for s in args.sizes)
        args.base_bytes = parse_size(args.base_size)
        from .cli import _parse_opts

        args.options = _parse_opts(args.opt)
        for name in args.systems or []:
            systems.get(name)
    except (ValueError, KeyError) as exc:
        p.error(str(exc))
    if args.out is None:
        args.out = REPO / "benchmarks" / "results" / "tmp" / (
            f"curves-{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
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
    """A rough duration on a 2-core machine (printed before the run starts)."""
    total = 20.0 + _POOL_START_S * sum({p.world_size for p in points})
    unique = {(p.store, p.world_size, p.workload): p for p in points}
    for p in unique.values():
        save, load = _ASSUMED_MBPS[p.store]
        mb = p.workload.state_bytes / 1e6
        # ranks beyond the 2 cores add per-rank overhead; many small tensors, per tensor
        overhead = 0.5 + 0.05 * p.world_size + 0.002 * p.workload.tensors
        total += args.runs * len(systems_for(p.store, args.systems)) * (
            mb / save + mb / load + 2 * overhead)
    return total


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


def _run_points(points: list[Point], args: argparse.Namespace,
                result: dict[str, Any]) -> None:
    """Measure every point into ``result["points"]``, saving ``results.json`` after each
    one (``"complete": false`` until the last), so a run cut short keeps what it did."""
    pools: dict[int, RankPool] = {}
    measured: list[dict[str, Any]] = result["points"]
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
        try:
            for i, ((store, world, workload), same) in enumerate(jobs.items()):
                for w in [w for w in pools if w != world and not remaining.get(w)]:
                    pools.pop(w).close()  # no point left needs this pool
                plan = StorePlan(store, workload, systems_for(store, args.systems))
                load = _load_average()
                print(f"-- point {i + 1}/{len(jobs)}: {'+'.join(p.series for p in same)} "
                      f"{store} @{world} {workload.describe()} (load {load})", flush=True)
                runner = Runner(
                    stores, pools, RankPool, world_size=world, runs=args.runs,
                    count_requests=False, evict_cache=False,
                    options=lambda store, label, op: options_for(args.options, label, op),
                    job_timeout=lambda n: max(180.0, n / 2e6),
                    progress=lambda line: print("   " + line, flush=True))
                for case in runner.run([plan]):
                    target = systems.get(case.system)
                    for point in same:
                        raw = case.to_dict()
                        raw.update(series=point.series, x=point.x, tensors=workload.tensors,
                                   load_average=load)
                        raw["summary"] = summarize_point(
                            point, raw, is_limit=target.is_limit,
                            is_dcpstore=target.is_dcpstore)
                        measured.append(raw)
                remaining[world] -= 1
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
    """Run the curves; return 0 when every point ran and every load verified."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    if args.render is not None:
        result = json.loads((args.render / "results.json").read_text())
        return _finish(result, args.render)
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    points = build_points(args)
    load = _load_average()
    print(f"dcpstore scaling curves, {args.mode} mode: {len(points)} points "
          f"({', '.join(args.series)}) on {', '.join(args.stores)}, {args.runs} run(s) each, "
          f"results in {args.out}")
    print(f"  estimated duration: ~{estimate_seconds(points, args) / 60:.1f} min "
          f"(2-core machine; rough); load average now {load}")
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
        "load_average": {"start": load, "end": None},
        "versions": versions(),
        "config": {"mode": args.mode, "series": args.series, "stores": args.stores,
                   "worlds": args.worlds, "sizes": args.size_bytes,
                   "base_size": args.base_bytes, "size_world": args.size_world,
                   "tensors": args.tensors, "many_tensors": args.many_tensors,
                   "mix": args.mix, "runs": args.runs, "seed": args.seed,
                   "options": args.options},
        "stores": {},
        "points": [],
    }
    _run_points(points, args, result)
    result["duration_s"] = time.time() - started
    result["load_average"]["end"] = _load_average()
    return _finish(result, args.out)


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
        f"commit {m.get('git_commit')}, {m['cpus']} CPUs ({m['cpu_model']}), "
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
        "largest peak extra RSS of a rank, and over its share of the state.", "",
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
                  "| coord. CPU s | peak RSS/rank | RSS/share | load | ok |",
                  "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
        for p in sorted(pts, key=lambda p: (p["system"], p["op"] != "save", p["x"])):
            s = p["summary"]
            ok = ("FAILED" if not s["ok"] else
                  "MISMATCH" if s.get("verified") is False else "yes")
            rss = s.get("peak_extra_rss_max")
            lines.append(
                f"| {p['system']} | {p['op']} | {p['world_size']} | "
                f"{format_bytes(p['state_bytes'])} | {_f(s.get('mbps'), '.0f')} | "
                f"{_f(s.get('seconds_per_gib'), '.2f')} | {_f(s.get('cpu_s_per_gib'), '.2f')} | "
                f"{_f(s.get('cpu_s_per_rank_max'), '.2f')} | "
                f"{_f(s.get('coordinator_excess_cpu_s'), '.2f')} | "
                f"{'—' if rss is None else format_bytes(rss)} | "
                f"{_f(s.get('rss_per_share_max'), '.2f')} | "
                f"{_f((p.get('load_average') or [None])[0], '.1f')} | {ok} |")
        lines.append("")
    lines += [f"## Superlinear growth (> {SUPERLINEAR:.2f}x the curve's first point)", ""]
    found = result.get("findings") or []
    if not found:
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
                     f"load average {la}, commit {m.get('git_commit')}", fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
