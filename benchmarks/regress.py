"""``python -m benchmarks.regress``: the quick run against the last committed full run.

``make bench-quick`` (and CI's smoke test) runs the benchmark in its quick mode: 32 MiB
instead of 512 MiB, two runs, on whatever machine runs it. Its MB/s cannot be compared
with the committed full run's (``benchmarks/results/latest``) as they are, so each case
is taken as a fraction of **the same run's limit** for its store, operation and world
size (the fastest ``limit-*`` variant of that run at its median, the report's "x the
limit"): a figure that a slower machine or a smaller state moves about as much for the
limit as for the system. The case's own figure is its fastest run: the quick run has
two, so its median is their mean, and one stalled run (a 1 s pause of one save of
two was seen on a shared machine: 5.2x "slower" by the medians) would fail the guard,
where a regression slows every run. For every (store, system, op, world size) present
in both runs::

    slowdown = (baseline best MB/s / baseline limit) / (quick best MB/s / quick limit)

A case more than ``--warn`` (1.5x) slower is printed as slower; one more than
``--fail`` (3x) slower fails the guard (exit status 1). Cases in one run only (another
world size, a system that did not run, a case with no figure) are listed, never failed.
The classes in :data:`EXCLUDED` are left out, each with its reason: there the quick
run's small size, not the code, moves the figure (measured, see the reasons).

Examples::

    python -m benchmarks --quick --out /tmp/quick && python -m benchmarks.regress /tmp/quick
    python -m benchmarks.regress /tmp/quick --baseline benchmarks/results/latest --warn 1.2
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .env import REPO

__all__ = ["DEFAULT_BASELINE", "EXCLUDED", "Comparison", "Row", "compare", "fractions",
           "load_baseline", "load_results", "main", "render"]

logger = logging.getLogger(__name__)

#: The last committed full run: ``results.json`` there and in its subfolders (moto's
#: single-process run, ``moto-1rank``).
DEFAULT_BASELINE = REPO / "benchmarks" / "results" / "latest"

#: (store, system, op) shell patterns left out of the comparison, and why. The figures
#: quoted are two quick runs (2 cores, shared) against the full run at 6f53242, by
#: medians and by :func:`fractions`; none of these moved because of the code.
EXCLUDED: list[tuple[tuple[str, str, str], str]] = [
    (("*", "limit-*", "*"),
     "the limits are the yardstick, and the quick run runs other variants of them"),
    (("*", "*[[]best]", "*"),
     "a peer's tuned best is picked from the quick run's small grid and from the full "
     "run's whole grid, so the two can name different settings (msc[best] loaded on "
     "SeaweedFS with 32 MiB parts and 1 thread in the full run at 41d805b); the peer at "
     "its defaults is compared"),
    (("local", "*", "save"),
     "the local save limit is not size-robust: write-back of 16 MiB per rank ran at "
     "914 MB/s against 506 at 256 MiB, while dcpstore-local's own MB/s moved 1.17x; "
     "every local save came out 1.8-2.5x 'slower'"),
    (("local", "*", "load"),
     "a quick local load (32 MiB, warm page cache) is ~85% fixed cost: dcpstore-local "
     "took 55 ms, ~48 of them per-load costs (process group, metadata, planning), the "
     "limit 10 ms; local loads came out 1.8-2.4x 'slower'"),
    (("gcs", "*", "load"),
     "a quick fake-gcs-server load (16 MiB) is mostly fixed cost: the limit took 25 ms, "
     "dcpstore-gcs ~57 of its 68 ms, torch-fsspec-gcs (gcsfs) ~0.48 of its 0.53 s; "
     "they came out 2.0-2.5x and 3.1-3.8x 'slower'"),
]

#: (store, system, op, world size)
Key = tuple[str, str, str, int]


@dataclass(frozen=True)
class Row:
    """One case present in both runs.

    Attributes:
        key: (store, system, op, world size).
        baseline: The case's MB/s as a fraction of the baseline run's limit.
        quick: The same in the quick run.
    """

    key: Key
    baseline: float
    quick: float

    @property
    def slowdown(self) -> float:
        """How many times slower the quick run is, relative to its limit (> 1: slower)."""
        return self.baseline / self.quick if self.quick > 0 else float("inf")


@dataclass
class Comparison:
    """What :func:`compare` found.

    Attributes:
        rows: The cases compared, slowest first.
        baseline_only: Cases with a figure in the baseline only.
        quick_only: Cases with a figure in the quick run only.
        excluded: Cases of both runs left out, and why (:data:`EXCLUDED`).
        warn: The slowdown printed as slower.
        fail: The slowdown that fails the guard.
    """

    rows: list[Row] = field(default_factory=list)
    baseline_only: list[Key] = field(default_factory=list)
    quick_only: list[Key] = field(default_factory=list)
    excluded: dict[Key, str] = field(default_factory=dict)
    warn: float = 1.5
    fail: float = 3.0

    @property
    def slower(self) -> list[Row]:
        """The rows at least ``warn`` times slower (the failing ones included)."""
        return [r for r in self.rows if r.slowdown >= self.warn]

    @property
    def failed(self) -> list[Row]:
        """The rows at least ``fail`` times slower."""
        return [r for r in self.rows if r.slowdown >= self.fail]


def fractions(result: dict[str, Any]) -> dict[Key, float | None]:
    """Each case of a run (``results.json``) as a fraction of that run's limit for its
    store, op and world size: the MB/s of the case's fastest run over the fastest limit
    variant's median MB/s. ``None``: the case or every limit of its store and op has no
    figure (failed or not run)."""
    limits: dict[tuple[str, str, int], float] = {}
    for c in result["cases"]:
        s = c["summary"]
        if s.get("is_limit") and s.get("mbps"):
            where = (c["store"], c["op"], c["world_size"])
            limits[where] = max(limits.get(where, 0.0), s["mbps"])
    out: dict[Key, float | None] = {}
    for c in result["cases"]:
        limit = limits.get((c["store"], c["op"], c["world_size"]))
        mbps = c["summary"].get("mbps") and (c["summary"].get("mbps_max")
                                             or c["summary"]["mbps"])
        out[(c["store"], c["system"], c["op"], c["world_size"])] = (
            mbps / limit if mbps and limit else None)
    return out


def _excluded(key: Key) -> str | None:
    store, system, op, _ = key
    for (p_store, p_system, p_op), reason in EXCLUDED:
        if (fnmatch.fnmatchcase(store, p_store) and fnmatch.fnmatchcase(system, p_system)
                and fnmatch.fnmatchcase(op, p_op)):
            return reason
    return None


def compare(quick: dict[str, Any], baselines: list[dict[str, Any]], *, warn: float = 1.5,
            fail: float = 3.0) -> Comparison:
    """Compare a quick run with the baseline runs (the first one naming a case wins).

    Args:
        quick: The quick run's ``results.json``.
        baselines: The committed full run's ``results.json`` files.
        warn: Slowdown from which a case is printed as slower.
        fail: Slowdown from which the guard fails.
    """
    base: dict[Key, float | None] = {}
    for result in baselines:
        for key, value in fractions(result).items():
            base.setdefault(key, value)
    mine = fractions(quick)
    comp = Comparison(warn=warn, fail=fail)
    for key in sorted(base.keys() | mine.keys()):
        b, q = base.get(key), mine.get(key)
        reason = _excluded(key)
        if b is not None and q is not None:
            if reason is not None:
                comp.excluded[key] = reason
            else:
                comp.rows.append(Row(key, b, q))
        elif reason is None:  # an excluded class is not listed as missing either
            if b is not None:
                comp.baseline_only.append(key)
            elif q is not None:
                comp.quick_only.append(key)
    comp.rows.sort(key=lambda r: -r.slowdown)
    return comp


def _grouped(keys: list[Key]) -> list[str]:
    """``store op @N: system, system`` lines."""
    groups: dict[tuple[str, str, int], list[str]] = {}
    for store, system, op, world in keys:
        groups.setdefault((store, op, world), []).append(system)
    return [f"  {store} {op} @{world}: {', '.join(names)}"
            for (store, op, world), names in groups.items()]


def render(comp: Comparison) -> str:
    """The comparison as text: the table, then the verdict, the cases in one run only
    and the excluded classes."""
    lines = [f"{'store':<10} {'system':<26} {'op':<4} {'ranks':>5} {'full':>6} "
             f"{'quick':>6} {'slowdown':>8}",
             "(full, quick: the fastest run's MB/s as a fraction of the same run's limit; "
             "slowdown = full / quick)"]
    for r in comp.rows:
        store, system, op, world = r.key
        flag = ("FAIL" if r.slowdown >= comp.fail else
                "slower" if r.slowdown >= comp.warn else "")
        lines.append(f"{store:<10} {system:<26} {op:<4} {world:>5} {r.baseline:6.2f} "
                     f"{r.quick:6.2f} {r.slowdown:7.2f}x {flag}".rstrip())
    lines.append("")
    lines.append(f"compared {len(comp.rows)} cases: {len(comp.slower)} more than "
                 f"{comp.warn:g}x slower, {len(comp.failed)} more than {comp.fail:g}x "
                 "(fails)")
    for r in comp.slower:
        store, system, op, world = r.key
        lines.append(f"  {'FAIL' if r.slowdown >= comp.fail else 'slower'}: {system} {op} "
                     f"@{world} on {store}: {r.slowdown:.2f}x slower relative to the limit "
                     f"({r.baseline:.2f} -> {r.quick:.2f} of it)")
    if comp.baseline_only:
        lines.append("not compared, in the baseline only (another world size, or not run "
                     "or failed in the quick run):")
        lines += _grouped(comp.baseline_only)
    if comp.quick_only:
        lines.append("not compared, in the quick run only:")
        lines += _grouped(comp.quick_only)
    if comp.excluded:
        reasons: dict[str, list[Key]] = {}
        for key, reason in comp.excluded.items():
            reasons.setdefault(reason, []).append(key)
        lines.append(f"excluded ({len(comp.excluded)} cases):")
        for reason, keys in reasons.items():
            lines.append(f"  {len(keys)} case(s): {reason}")
    return "\n".join(lines) + "\n"


def load_results(where: Path) -> dict[str, Any]:
    """``where/results.json`` (or ``where`` itself, a JSON file)."""
    path = where / "results.json" if where.is_dir() else where
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def load_baseline(where: Path) -> list[dict[str, Any]]:
    """``where/results.json`` and every ``where/*/results.json`` (the moto run)."""
    paths = [where / "results.json", *sorted(where.glob("*/results.json"))]
    found = [p for p in paths if p.is_file()]
    if not found:
        raise FileNotFoundError(f"no results.json in {where} or its subfolders")
    logger.info("baseline: %s", ", ".join(str(p) for p in found))
    return [json.loads(p.read_text()) for p in found]


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; return 1 when a case is ``--fail`` times slower, else 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.regress",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("quick", type=Path, metavar="QUICK_DIR",
                   help="the quick run's results folder (or its results.json)")
    p.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE, metavar="DIR",
                   help="the committed full run (default: benchmarks/results/latest, with "
                        "its subfolders' results.json)")
    p.add_argument("--warn", type=float, default=1.5,
                   help="print the cases this many times slower (default 1.5)")
    p.add_argument("--fail", type=float, default=3.0,
                   help="fail when a case is this many times slower (default 3)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        quick = load_results(args.quick)
        baselines = load_baseline(args.baseline)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    comp = compare(quick, baselines, warn=args.warn, fail=args.fail)
    print(render(comp), end="")
    if not comp.rows:  # nothing to judge: said loudly, but not a regression
        print("regression guard: WARNING, no case in both runs to compare", file=sys.stderr)
    if comp.failed:
        print(f"regression guard: FAIL, {len(comp.failed)} case(s) {args.fail:g}x slower "
              "than the committed full run, relative to the limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
