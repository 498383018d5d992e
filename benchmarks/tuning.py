"""The tuning phase: each peer's best setting from a small grid, per store.

Before the timed runs, every peer with a ``grid`` (:attr:`benchmarks.systems.System.grid`)
saves and loads a smaller state at every point of its grid (:func:`grid_points`): threads
1/4/8, and part size 8/32 MiB for s3torchconnector and MSC, crossed; then, one at a time
at the crossed grid's defaults, the fsspec filesystems' block size, s3torchconnector's
reader type and its CRT throughput target. ``--tune-runs`` times (1), in a balanced
random order like the main runs. Then the leading points (:func:`leaders`: per peer, the
``--tune-confirm`` (2) fastest saves and the as many fastest readers) run once more, so
that a point is not picked on one lucky run while points that were never close are not
repeated. Per operation, the point with the shortest time (the fastest of its runs) is
the peer's best; for the load only the options its reader uses count
(:attr:`~benchmarks.systems.System.reader_keys`; none: the reader's defaults). The main
runs then run each peer at its defaults **and** as ``<peer>[best]``, and the targets are
judged against the faster of the two. Every point's figures are in the results.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from .systems import get as get_system
from .systems import options_variant, parse_option_value, split_variant

__all__ = ["grid_points", "is_default", "leaders", "parse_grid", "pick_best", "point_label"]

logger = logging.getLogger(__name__)


def parse_grid(items: list[str]) -> dict[str, tuple[Any, ...]]:
    """``["thread_count=1,4,8", "part_size=8MiB,32MiB"]`` -> values per option.

    Raises:
        ValueError: An item is not ``KEY=V1[,V2...]``.
    """
    out: dict[str, tuple[Any, ...]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise ValueError(f"--grid {item!r}: use KEY=V1,V2,... (e.g. thread_count=1,4,8)")
        out[key.strip()] = tuple(dict.fromkeys(parse_option_value(v) for v in vals))
    return out


def grid_points(grid: dict[str, tuple[Any, ...]], override: dict[str, tuple[Any, ...]]
                ) -> list[dict[str, Any]]:
    """A peer's grid points: the cross product of its crossed options, then one point per
    value of an option tried one at a time (:class:`benchmarks.adapters.Grid`).

    ``override`` (``--grid``) replaces the values of the options it names (options the
    peer does not have are ignored). A one-at-a-time option it names joins the cross
    product with those values; one it does not name is tried (each value but its default,
    the first, at the crossed grid's first point) only when ``override`` changes none of
    the peer's options, so that ``--grid`` pins a peer to the points it asks for (quick
    mode's one point per peer).

    Args:
        grid: The peer's :attr:`~benchmarks.adapters.System.grid`.
        override: ``--grid``'s values per option (:func:`parse_grid`).

    Returns:
        The points, each ``{option: value}``, crossed points first, no point twice.
    """
    single: dict[str, tuple[Any, ...]] = dict(getattr(grid, "single", {}))
    crossed = {**grid, **{k: v for k, v in single.items() if k in override}}
    keys = sorted(crossed)
    values = [override.get(k, crossed[k]) for k in keys]
    points = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]
    if single and not any(k in override for k in (*grid, *single)):
        base = {k: v[0] for k, v in zip(keys, values, strict=True) if v}
        for key in sorted(single):
            for value in single[key][1:]:
                points.append({**base, key: value})
    out: list[dict[str, Any]] = []
    for point in points:
        if point not in out:
            out.append(point)
    return out


def point_label(name: str, options: dict[str, Any]) -> str:
    """``("msc", {"thread_count": 4})`` -> ``"msc[thread_count=4]"``."""
    return f"{name}[{options_variant(options)}]" if options else name


def _best_seconds(case: dict[str, Any]) -> float | None:
    runs = case.get("runs") or []
    times = [max(r["seconds"] for r in run) for run in runs if run]
    return min(times) if times else None


def _points(name: str, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``variant -> {"options", "save_s", "load_s", "runs"}`` of peer ``name``'s grid
    points: the fastest run of each operation over every case given (the cases of
    several rounds of the same point are merged)."""
    points: dict[str, dict[str, Any]] = {}
    for c in cases:
        base, variant = split_variant(c["system"])
        if base != name or not variant or c["world_size"] != c["saved_at"]:
            continue
        opts = get_system(c["system"]).variant_options()
        entry = points.setdefault(variant, {"options": opts, "save_s": None, "load_s": None,
                                            "save_runs": 0, "load_runs": 0})
        seconds = _best_seconds(c)
        entry[f"{c['op']}_runs"] += len(c.get("runs") or [])
        if seconds is not None:
            old = entry[f"{c['op']}_s"]
            entry[f"{c['op']}_s"] = seconds if old is None else min(old, seconds)
    return points


def leaders(name: str, cases: list[dict[str, Any]], count: int) -> list[str]:
    """The grid points of peer ``name`` worth another run: the ``count`` fastest saves,
    and for each of the ``count`` fastest readers (points that differ only in writer
    options are one reader) its point with the fastest load. Labels, as
    :func:`point_label` gives them, in grid order of first appearance."""
    if count < 1:
        return []
    system = get_system(name)
    points = _points(name, cases)
    saves = sorted((p["save_s"], v) for v, p in points.items() if p["save_s"])
    chosen = [v for _, v in saves[:count]]
    readers: dict[tuple[tuple[str, Any], ...], tuple[float, str]] = {}
    for v, p in points.items():
        if not p["load_s"]:
            continue
        key = tuple(sorted((k, x) for k, x in p["options"].items() if k in system.reader_keys))
        if key not in readers or p["load_s"] < readers[key][0]:
            readers[key] = (p["load_s"], v)
    chosen += [v for _, v in sorted(readers.values())[:count]]
    return [f"{name}[{v}]" for v in dict.fromkeys(chosen)]


def pick_best(name: str, cases: list[dict[str, Any]], state_bytes: int) -> dict[str, Any]:
    """The best grid point of peer ``name`` per operation, from the tuning cases.

    Args:
        name: The peer.
        cases: :meth:`benchmarks.runner.Case.to_dict` of the tuning runs (any systems;
            the cases of several rounds are merged per point and operation).
        state_bytes: Bytes of the tuning state.

    Returns:
        ``{"save": {"options", "mbps"}, "load": {...}, "points": [{"options",
        "save_mbps", "load_mbps", "save_runs", "load_runs"}]}``; an operation none of
        whose points ran has ``options`` ``None``.
    """
    system = get_system(name)
    points = _points(name, cases)

    def mbps(seconds: float | None) -> float | None:
        return state_bytes / seconds / 1e6 if seconds else None

    out: dict[str, Any] = {"points": [
        {"options": p["options"], "save_mbps": mbps(p["save_s"]),
         "load_mbps": mbps(p["load_s"]), "save_runs": p["save_runs"],
         "load_runs": p["load_runs"]} for p in points.values()]}
    saves = [p for p in points.values() if p["save_s"]]
    best = min(saves, key=lambda p: p["save_s"]) if saves else None
    out["save"] = {"options": dict(best["options"]) if best else None,
                   "mbps": mbps(best["save_s"]) if best else None}
    # a load is judged by the options its reader uses: points that differ only in
    # writer options are the same reader, and count as one (its fastest run)
    groups: dict[tuple[tuple[str, Any], ...], float] = {}
    for p in points.values():
        if p["load_s"]:
            key = tuple(sorted((k, v) for k, v in p["options"].items()
                               if k in system.reader_keys))
            groups[key] = min(groups.get(key, p["load_s"]), p["load_s"])
    if groups:
        key = min(groups, key=lambda k: groups[k])
        out["load"] = {"options": dict(key), "mbps": mbps(groups[key])}
    else:
        out["load"] = {"options": None, "mbps": None}
    return out


def is_default(name: str, tuned: dict[str, Any]) -> bool:
    """Whether the tuned best of both operations are the peer's library defaults."""
    defaults = get_system(name).defaults
    for op in ("save", "load"):
        opts = tuned.get(op, {}).get("options")
        if opts is None:
            return False
        if any(defaults.get(k, object()) != v for k, v in opts.items()):
            return False
    return True
