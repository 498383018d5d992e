"""Turns the raw measurements into the report: summaries, ratios, targets, and the three
outputs (``results.json``, ``results.md``, ``chart.png``).

How the figures are computed (also in ``docs/performance.md``):

- a run's time is the slowest rank's (each rank times itself from a common barrier);
  a case's time is the **median** over its runs; MB/s = state bytes / median time
  (MB = 10^6 bytes); the **spread** is the MB/s of the slowest and the fastest run
  (min-max), in the tables and as error bars in the chart;
- ratios are taken between medians of cases of the same store, operation and world
  size, pairwise between every two systems; "the limit" of a store and operation is
  the fastest of its limit variants;
- CPU s/GiB = median over runs of the ranks' summed user + system CPU seconds, per GiB
  of state;
- peak extra RSS per rank = the largest over runs of each rank's peak resident memory
  above its resident memory just before the operation;
- requests and bytes on the wire come from the untimed counting run through the
  proxy; "bytes read" of a load is the proxy's response bytes on the servers, for every
  system alike (dcpstore's own ``Reader.bytes_read`` is kept beside it), and the ranks'
  ``rchar`` on the local disk;
- targets against a peer are judged against the peer's best: the faster of its
  defaults and its tuned ``<peer>[best]``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .env import checkout_text
from .workload import format_bytes

__all__ = ["build", "evaluate_targets", "render_markdown", "summarize", "write_chart",
           "write_outputs"]

logger = logging.getLogger(__name__)

_GiB = float(1 << 30)


# -- summaries -----------------------------------------------------------------------------


def _median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(case: dict[str, Any], *, is_limit: bool, is_dcpstore: bool) -> dict[str, Any]:
    """Summary figures of one case (see the module docstring)."""
    runs = case["runs"]
    out: dict[str, Any] = {"is_limit": is_limit, "is_dcpstore": is_dcpstore,
                           "runs_ok": len(runs), "ok": bool(runs)}
    state = case["state_bytes"]
    if runs:
        seconds = [max(r["seconds"] for r in run) for run in runs]
        med = _median(seconds) or 0.0
        cpu = [sum(r["cpu_user"] + r["cpu_sys"] for r in run) for run in runs]
        ranks = len(runs[0])
        peak = [max(run[i]["peak_extra_rss"] for run in runs if i < len(run))
                for i in range(ranks)]
        out.update(
            seconds=med, seconds_all=seconds,
            seconds_min=min(seconds), seconds_max=max(seconds),
            mbps=state / med / 1e6 if med > 0 else None,
            mbps_min=state / max(seconds) / 1e6 if max(seconds) > 0 else None,
            mbps_max=state / min(seconds) / 1e6 if min(seconds) > 0 else None,
            cpu_seconds=_median(cpu),
            cpu_s_per_gib=(_median(cpu) or 0.0) / (state / _GiB),
            peak_extra_rss=peak, peak_extra_rss_max=max(peak) if peak else 0,
            share_bytes=[r["share_bytes"] for r in runs[0]],
            largest_tensor_bytes=max(r["largest_tensor_bytes"] for r in runs[0]),
            rchar=_median(sum(r["rchar"] for r in run) for run in runs),
        )
        if case["op"] == "load":
            out["verified"] = all(r["verified"] for run in runs for r in run)
        first = runs[0][0].get("extra", {})
        if "part_size" in first and "max_concurrency" in first and not is_limit:
            out["part_size"] = first["part_size"]
            out["max_concurrency"] = first["max_concurrency"]
            out["memory_bound"] = (2 * first["part_size"] * first["max_concurrency"]
                                   + out["largest_tensor_bytes"])
        if "bytes_needed" in first:
            # dcpstore's own count: the items' stored lengths (tensor bytes plus DCP's
            # per-item serialization header) and the bytes its range requests fetched
            out["reader_bytes_needed"] = sum(r["extra"]["bytes_needed"] for r in runs[0])
            out["reader_bytes_read"] = sum(r["extra"]["bytes_read"] for r in runs[0])
    counted = case.get("counted")
    if counted:
        out["requests"] = counted.get("requests")
        out["bytes_up"] = counted.get("bytes_up")
        out["bytes_down"] = counted.get("bytes_down")
        if case["op"] == "load":
            out["counted_verified"] = counted.get("verified")
    if case["op"] == "load":
        # what the load read: the same measure for every system of a store (the proxy
        # on servers); dcpstore's own count only where there is no proxy figure
        if out.get("bytes_down") is not None:
            out["bytes_read"] = out["bytes_down"]
            out["read_measure"] = "proxy"
        elif "reader_bytes_read" in out and case["store"] != "local":
            out["bytes_read"] = out["reader_bytes_read"]
            out["read_measure"] = "reader"
        elif out.get("rchar") is not None and case["store"] == "local":
            out["bytes_read"] = int(out["rchar"])
            out["read_measure"] = "rchar"
        # what the load must deliver: the tensor bytes of the whole state, whatever the
        # world size (each element is loaded by exactly one rank)
        out["bytes_needed"] = state
    out["errors"] = case.get("errors", [])
    return out


def _limits(cases: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """The fastest limit variant per (store, op, world size)."""
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for c in cases:
        s = c["summary"]
        if not s["is_limit"] or not s.get("mbps"):
            continue
        key = (c["store"], c["op"], c["world_size"])
        if key not in best or s["mbps"] > best[key]["summary"]["mbps"]:
            best[key] = c
    return best


def build(raw_cases: list[dict[str, Any]], kinds: dict[str, tuple[bool, bool]]
          ) -> list[dict[str, Any]]:
    """Add ``summary``, ``ratios`` (to every other system) and ``vs_limit`` to each case.

    Args:
        raw_cases: :meth:`benchmarks.runner.Case.to_dict` of every case.
        kinds: ``system -> (is_limit, is_dcpstore)``.
    """
    cases = []
    for raw in raw_cases:
        is_limit, is_dcpstore = kinds.get(raw["system"], (False, False))
        c = dict(raw)
        c["summary"] = summarize(raw, is_limit=is_limit, is_dcpstore=is_dcpstore)
        cases.append(c)
    limits = _limits(cases)
    for c in cases:
        s = c["summary"]
        c["ratios"] = {}
        if not s.get("mbps"):
            continue
        for other in cases:
            o = other["summary"]
            if other is c or not o.get("mbps"):
                continue
            if (other["store"], other["op"], other["world_size"]) != (
                    c["store"], c["op"], c["world_size"]):
                continue
            c["ratios"][other["system"]] = s["mbps"] / o["mbps"]
        lim = limits.get((c["store"], c["op"], c["world_size"]))
        if lim is not None:
            c["vs_limit"] = {"limit": lim["system"], "ratio": s["mbps"] / lim["summary"]["mbps"]}
    return cases


# -- targets -------------------------------------------------------------------------------


def _find(cases: list[dict[str, Any]], store: str, system: str, op: str, world: int
          ) -> dict[str, Any] | None:
    for c in cases:
        if (c["store"], c["system"], c["op"], c["world_size"]) == (store, system, op, world):
            return c if c["summary"].get("mbps") else None
    return None


def _find_best(cases: list[dict[str, Any]], store: str, name: str, op: str, world: int
               ) -> dict[str, Any] | None:
    """The fastest case of system ``name`` in any variant (its defaults, ``[best]``)."""
    found = [c for c in cases
             if (c["store"], c["op"], c["world_size"]) == (store, op, world)
             and c["system"].split("[", 1)[0] == name and c["summary"].get("mbps")]
    return max(found, key=lambda c: c["summary"]["mbps"]) if found else None


def evaluate_targets(cases: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The issue's targets, each ``PASS``, ``FAIL`` or ``SKIP`` (with why). A peer is
    judged at its best (the faster of its defaults and ``<peer>[best]``)."""
    targets: list[dict[str, Any]] = []
    limits = _limits(cases)

    def add(tid: str, text: str, status: str, detail: str) -> None:
        targets.append({"id": tid, "target": text, "status": status, "detail": detail})

    def ratio_target(tid: str, text: str, store: str, system: str, op: str, other: str,
                     threshold: float, *, strict: bool = False) -> None:
        a = _find(cases, store, system, op, world_size)
        if other == "limit":
            lim = limits.get((store, op, world_size))
            b = lim
        else:
            b = _find_best(cases, store, other, op, world_size)
        if a is None or b is None:
            missing = system if a is None else other
            add(tid, text, "SKIP", f"no result for {missing} {op} on {store}")
            return
        ra, rb = a["summary"]["mbps"], b["summary"]["mbps"]
        ratio = ra / rb
        ok = ratio > threshold if strict else ratio >= threshold
        detail = (f"{system} {ra:.0f} MB/s vs {b['system']} {rb:.0f} MB/s = {ratio:.2f}x "
                  f"(needs {'>' if strict else '>='} {threshold:.2f}x)")
        lim = limits.get((store, op, world_size))
        if other != "limit" and lim is not None and threshold > 1.0:
            # a peer target set on a baseline where that peer was far from the limit:
            # say what it asks for against the limit measured in this run
            need = threshold * rb
            detail += (f"; {threshold:g}x {b['system']} = {need:.0f} MB/s = "
                       f"{need / lim['summary']['mbps']:.2f}x the raw limit of this run")
        add(tid, text, "PASS" if ok else "FAIL", detail)

    s3, local = "seaweedfs", "local"
    ratio_target("s3-save-limit", "S3 save >= 90% of the raw limit", s3, "dcpstore-s3",
                 "save", "limit", 0.90)
    ratio_target("s3-load-limit", "S3 load >= 85% of the raw limit", s3, "dcpstore-s3",
                 "load", "limit", 0.85)
    ratio_target("s3-save-fsspec", "S3 save >= 1.5x FsspecWriter", s3, "dcpstore-s3", "save",
                 "torch-fsspec-s3", 1.5)
    ratio_target("s3-save-msc", "S3 save >= 1.5x MSC writer", s3, "dcpstore-s3", "save",
                 "msc", 1.5)
    ratio_target("s3-save-s3tc", "S3 save ahead of s3torchconnector", s3, "dcpstore-s3",
                 "save", "s3torchconnector", 1.0, strict=True)
    ratio_target("s3-load-fsspec", "S3 load >= 3x FsspecReader", s3, "dcpstore-s3", "load",
                 "torch-fsspec-s3", 3.0)
    ratio_target("s3-load-s3tc", "S3 load >= 1.3x s3torchconnector", s3, "dcpstore-s3",
                 "load", "s3torchconnector", 1.3)
    for op in ("save", "load"):
        a = _find(cases, s3, "dcpstore-s3", op, world_size)
        b = _find_best(cases, s3, "s3torchconnector", op, world_size)
        text = f"S3 client CPU s/GiB on {op} <= s3torchconnector's (at its best)"
        if a is None or b is None:
            add(f"s3-cpu-{op}", text, "SKIP", "no result for dcpstore-s3 or s3torchconnector")
        else:
            ca, cb = a["summary"]["cpu_s_per_gib"], b["summary"]["cpu_s_per_gib"]
            add(f"s3-cpu-{op}", text, "PASS" if ca <= cb else "FAIL",
                f"dcpstore-s3 {ca:.2f} vs {b['system']} {cb:.2f} CPU s/GiB")
    ratio_target("local-save-torch", "local save >= 1.0x FileSystemWriter (both fsync)", local,
                 "dcpstore-local", "save", "torch-fs", 1.0)
    ratio_target("local-save-limit",
                 "local save >= 85% of the local limit (fastest of dd, write-back, O_DIRECT)",
                 local, "dcpstore-local", "save", "limit", 0.85)
    ratio_target("local-load-torch", "local load >= 1.2x FileSystemReader", local,
                 "dcpstore-local", "load", "torch-fs", 1.2)
    for op in ("save", "load"):
        text = f"moto, single process: {op} >= 2x FsspecWriter"
        if world_size != 1:
            add(f"moto-1-{op}-fsspec", text, "SKIP",
                f"a {world_size}-rank run (the single-process run is `--world-size 1 "
                "--stores moto`, make bench's second command)")
        else:
            ratio_target(f"moto-1-{op}-fsspec", text, "moto", "dcpstore-s3", op,
                         "torch-fsspec-s3", 2.0)
    _peer_targets(cases, world_size, add)
    _memory_targets(cases, world_size, add)
    return targets


#: The dcpstore system judged at its defaults on each store.
_DCPSTORE_ON = {"local": "dcpstore-local", "seaweedfs": "dcpstore-s3", "moto": "dcpstore-s3",
                "gcs": "dcpstore-gcs"}


def _peer_targets(cases: list[dict[str, Any]], world_size: int, add: Any) -> None:
    """No stand-in on which a peer at its best beats dcpstore at its defaults."""
    mine = [c for c in cases if c["world_size"] == world_size and c["summary"].get("mbps")]
    for store in dict.fromkeys(c["store"] for c in mine):
        ours = _DCPSTORE_ON.get(store)
        for op in ("save", "load"):
            a = _find(mine, store, ours, op, world_size) if ours else None
            peers = [c for c in mine if (c["store"], c["op"]) == (store, op)
                     and not c["summary"]["is_limit"] and not c["summary"]["is_dcpstore"]]
            text = f"{store} {op}: no peer at its best beats {ours} at its defaults"
            if a is None or not peers:
                add(f"peers-{store}-{op}", text, "SKIP", f"no {ours} or no peer {op}")
                continue
            best = max(peers, key=lambda c: c["summary"]["mbps"])
            ra, rb = a["summary"]["mbps"], best["summary"]["mbps"]
            add(f"peers-{store}-{op}", text, "PASS" if ra >= rb else "FAIL",
                f"{ours} {ra:.0f} MB/s vs the fastest peer, {best['system']}, {rb:.0f} MB/s "
                f"= {ra / rb:.2f}x")


def _memory_targets(cases: list[dict[str, Any]], world_size: int, add: Any) -> None:
    """Per dcpstore case: peak extra RSS/rank within the issue's bound, and no full copy
    (a peak below the rank's share of the state -- checked only when one window of
    ``part_size x max_concurrency`` is smaller than that share, else a pipeline this
    size could not be told apart from a copy)."""
    saves = {(c["store"], c["system"]): c for c in cases
             if c["op"] == "save" and c["world_size"] == world_size}
    for c in cases:
        s = c["summary"]
        if not s["is_dcpstore"] or not s.get("ok") or "memory_bound" not in s:
            continue
        where = f"{c['system']} {c['op']} @{c['world_size']} on {c['store']}"
        peak, bound = s["peak_extra_rss_max"], s["memory_bound"]
        share = max(s["share_bytes"])
        save = saves.get((c["store"], c["system"]))
        if c["op"] == "load" and save is not None:
            # a reshard load must not buffer a whole data file (one saving rank's share)
            share = min(share, max(save["summary"].get("share_bytes") or [share]))
        window = s["part_size"] * s["max_concurrency"]
        within = peak <= bound
        detail = (f"peak {format_bytes(peak)} vs bound {format_bytes(bound)} "
                  f"(2 x {format_bytes(s['part_size'])} x {s['max_concurrency']} + "
                  f"{format_bytes(s['largest_tensor_bytes'])})")
        if window < share:
            no_copy = peak < share
            detail += f"; no full copy: peak {'<' if no_copy else '>='} {format_bytes(share)}"
        else:
            no_copy = True
            detail += (f"; full copy not tellable (one window, {format_bytes(window)}, "
                       f">= the {format_bytes(share)} share)")
        add(f"memory-{c['store']}-{c['system']}-{c['op']}-{c['world_size']}",
            f"memory: {where} peak extra RSS/rank <= 2 x part x concurrency + largest "
            "tensor, no full copy", "PASS" if within and no_copy else "FAIL", detail)


# -- markdown ------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".0f", suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{v:{spec}}{suffix}"


def _requests(req: dict[str, int] | None) -> str:
    if not req:
        return "—"
    order = ["PUT", "POST", "GET", "HEAD", "LIST", "DELETE"]
    keys = [k for k in order if req.get(k)] + sorted(k for k in req if k not in order)
    return " ".join(f"{k} {req[k]}" for k in keys)


def render_markdown(result: dict[str, Any]) -> str:
    """The Markdown report of a finished run (``result`` as in ``results.json``)."""
    cfg, machine = result["config"], result["machine"]
    cases = result["cases"]
    n = cfg["world_size"]
    lines = [f"# dcpstore benchmark ({cfg['mode']} mode, {result['started']})", ""]
    # the commit the run really ran at (results from before checkout() name git_commit)
    lines += [f"Ran at {checkout_text(result.get('checkout'), machine.get('git_commit'))}.",
              ""]
    lines.append(
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), "
        f"{format_bytes(machine['memory_bytes'])} RAM, Linux {machine['kernel']}, "
        f"Python {machine['python']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v) + ".")
    lines.append("")
    quiet = result.get("quiet") or {}
    if quiet.get("warning"):
        lines += [f"> **Warning:** {quiet['warning']}", ""]
    elif quiet:
        lines += [f"Quiet machine: load average {quiet['load_avg'][0]:.2f}, other processes "
                  f"{quiet.get('others_cpu_percent') or 0:.0f}% of a core at the start.", ""]
    order = ("systems interleaved in a seeded random order balanced over pairs (seed "
             f"{cfg['order_seed']}; every run's order is in results.json)"
             if "order_seed" in cfg else "systems interleaved round-robin")
    lines.append(
        f"{n} ranks (gloo, CPU, one process each); {cfg['runs']} run(s) per case, {order}; "
        "**median** MB/s reported with the min-max over runs in parentheses; "
        f"MB = 10^6 bytes. Duration {result['duration_s'] / 60:.1f} min. "
        f"Command: `{result['command']}`")
    lines.append("")
    phases = result.get("phases_s") or {}
    if phases:
        lines += ["Phases: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in phases.items()
                                         if isinstance(v, (int, float))) + ".", ""]
    fresh = result.get("server_replacements") or []
    if fresh:
        stores = sorted({r["store"] for r in fresh})
        budget = cfg.get("server_budget")
        lines += [f"Servers replaced by fresh, empty ones between cases (after "
                  f"{format_bytes(budget) if budget else 'their budget'} of writes, so "
                  f"that lazy space reclaim cannot fail a run): "
                  + ", ".join(f"{s} {sum(r['store'] == s for r in fresh)}x" for s in stores)
                  + ".", ""]
    lines += _settings_section(result)
    lines += _tuning_section(result)
    for store, info in result["stores"].items():
        lines += _store_section(store, info, cases, n)
    reshard = [c for c in cases if c["op"] == "load" and c["world_size"] != n]
    if reshard:
        lines += _reshard_section(reshard, n)
    skipped = result.get("skipped") or []
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- {s['store']}: {s['system']} — {s['reason']}" for s in skipped]
        lines.append("")
    failed = [c for c in cases if c.get("errors")]
    if failed:
        lines += ["## Failures", ""]
        for c in failed:
            first = c["errors"][0].strip().splitlines()[:3]
            lines.append(f"- {c['store']} {c['system']} {c['op']} @{c['world_size']}: "
                         + " / ".join(x.strip() for x in first))
        lines.append("")
    lines += ["## Targets", ""]
    if cfg["mode"] == "quick":
        lines += ["_Quick mode: the state is too small for these to mean anything; they are "
                  "printed so the harness is exercised end to end._", ""]
    for t in result["targets"]:
        lines.append(f"- **{t['status']}** {t['target']}: {t['detail']}")
    lines.append("")
    return "\n".join(lines)


def _store_section(store: str, info: dict[str, Any], cases: list[dict[str, Any]], n: int
                   ) -> list[str]:
    mine = [c for c in cases if c["store"] == store and c["world_size"] == n]
    if not mine:
        return []
    systems = _system_order(info, mine)
    by = {(c["system"], c["op"]): c for c in mine}
    title = f"## {store}: {format_bytes(info['state_bytes'])}, {n} ranks"
    lines = [title, ""]
    if info.get("note"):
        lines += [f"_{info['note']}_", ""]
    lines += [
        "| system | save MB/s (min-max) | save s | load MB/s (min-max) | load s | save vs limit "
        "| load vs limit "
        "| CPU s/GiB save / load | peak extra RSS/rank save / load | requests save | "
        "requests load | load verified |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|---|:-:|",
    ]
    for system in systems:
        sv = by.get((system, "save"))
        ld = by.get((system, "load"))
        s = sv["summary"] if sv else {}
        lsum = ld["summary"] if ld else {}
        name = f"**{system}**" if s.get("is_dcpstore") else system
        if s.get("is_limit"):
            name = f"_{system}_"
        verified = "—"
        if ld and lsum.get("ok"):
            verified = "yes" if lsum.get("verified") else "**NO**"
        lines.append("| " + " | ".join([
            name,
            _spread(s), _fmt(s.get("seconds"), ".2f"),
            _spread(lsum), _fmt(lsum.get("seconds"), ".2f"),
            _fmt((sv or {}).get("vs_limit", {}).get("ratio"), ".2f", "x"),
            _fmt((ld or {}).get("vs_limit", {}).get("ratio"), ".2f", "x"),
            f"{_fmt(s.get('cpu_s_per_gib'), '.2f')} / {_fmt(lsum.get('cpu_s_per_gib'), '.2f')}",
            f"{_mib(s.get('peak_extra_rss_max'))} / {_mib(lsum.get('peak_extra_rss_max'))}",
            _requests(s.get("requests")), _requests(lsum.get("requests")), verified,
        ]) + " |")
    lines.append("")
    best = [f"`{x}`: save {_options_text(st.get('save options'))}; load "
            f"{_options_text(st.get('load options'))}"
            for x, st in (info.get("settings") or {}).items() if x.endswith("[best]")]
    if best:
        lines += ["Tuned settings: " + " — ".join(best) + ".", ""]
    # ratios of dcpstore systems to every peer and to the limit
    ours = [s for s in systems if (by.get((s, "save")) or by.get((s, "load")) or {}).get(
        "summary", {}).get("is_dcpstore")]
    others = [s for s in systems if s not in ours]
    if ours and others:
        lines += ["Ratios (medians; > 1 means the dcpstore system is faster):", "",
                  "| | " + " | ".join(others) + " |",
                  "|---|" + "--:|" * len(others)]
        for mine_sys in ours:
            for op in ("save", "load"):
                found = by.get((mine_sys, op)) or {}
                cells = [_fmt(found.get("ratios", {}).get(o), ".2f", "x") for o in others]
                lines.append(f"| {mine_sys} {op} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _system_order(info: dict[str, Any], cases: list[dict[str, Any]]) -> list[str]:
    """The store's systems in plan order (not the first run's random one)."""
    seen = [c["system"] for c in cases]
    planned = [x for x in info.get("systems") or [] if x in seen]
    return planned + [x for x in dict.fromkeys(seen) if x not in planned]


def _reshard_section(cases: list[dict[str, Any]], n: int) -> list[str]:
    lines = [f"## Reshard loads (saved at {n} ranks)", "",
             "| store | system | load at | MB/s (min-max) | s | bytes read | bytes needed | "
             "read / needed | measured by | verified |",
             "|---|---|--:|--:|--:|--:|--:|--:|---|:-:|"]
    for c in sorted(cases, key=lambda c: (c["store"], c["world_size"], c["system"])):
        s = c["summary"]
        read, need = s.get("bytes_read"), s.get("bytes_needed")
        ratio = read / need if read is not None and need else None
        lines.append("| " + " | ".join([
            c["store"], c["system"], str(c["world_size"]), _spread(s),
            _fmt(s.get("seconds"), ".2f"),
            format_bytes(read) if read is not None else "—",
            format_bytes(need) if need is not None else "—",
            _fmt(ratio, ".3f"), s.get("read_measure", "—"),
            ("yes" if s.get("verified") else "**NO**") if s.get("ok") else "—",
        ]) + " |")
    lines += ["", "_bytes needed: the tensor bytes of the state. Bytes read: the counting "
              "proxy's response bytes of the counting run for every system on the servers "
              "(dcpstore included; with `.metadata` and dcpstore's manifest), the ranks' "
              "`rchar` on the local disk; all include DCP's per-item serialization headers "
              "(~1.5 KiB per tensor)._", ""]
    return lines


def _spread(summary: dict[str, Any]) -> str:
    """``"213 (205-223)"``: median MB/s and the min-max over runs."""
    if not summary.get("mbps"):
        return "—"
    lo, hi = summary.get("mbps_min"), summary.get("mbps_max")
    if lo is None or hi is None or summary.get("runs_ok", 0) < 2:
        return _fmt(summary["mbps"])
    return f"{summary['mbps']:.0f} ({lo:.0f}-{hi:.0f})"


def _options_text(opts: dict[str, Any] | None) -> str:
    if not opts:
        return "defaults"
    sizes = ("part_size", "block_size")
    return ", ".join(f"{k}={format_bytes(v).replace(' ', '') if k in sizes else v}"
                     for k, v in sorted(opts.items()))


def _settings_section(result: dict[str, Any]) -> list[str]:
    """Per store: each system's transport (TLS), request settings and the options it
    ran with (a run from before ``--tls`` existed has no TLS entry: ``—``)."""
    rows = []
    for store, info in result["stores"].items():
        for label, st in (info.get("settings") or {}).items():
            rows.append("| " + " | ".join([
                store, label, st.get("tls", "—"), st.get("payload", "—"),
                st.get("request checksums", "—"), st.get("response checksums", "—"),
                _options_text(st.get("save options")),
                _options_text(st.get("load options"))]) + " |")
    if not rows:
        return []
    return ["## Settings per system", "",
            "| store | system | TLS | payload | request checksums | response checksums "
            "| save options | load options |", "|---|---|---|---|---|---|---|---|", *rows, ""]


def _tuning_section(result: dict[str, Any]) -> list[str]:
    """The tuning phase: every grid point's MB/s and the best per operation."""
    tuned = result.get("tuning") or {}
    if not tuned:
        return []
    cfg = result["config"]
    lines = ["## Tuning (each peer's best setting)", "",
             f"Every grid point saved and loaded {cfg.get('tune_runs', 1)} time(s) on a "
             "smaller state first (a quarter of the store's, at most "
             f"{format_bytes(cfg.get('tune_size', 0))})"
             + (f", then each peer's {cfg['tune_confirm']} fastest saves and readers once "
                "more" if cfg.get("tune_confirm") else "")
             + "; per operation the point with the "
             "fastest run is the peer's best (for the load, among the options its reader "
             "uses). The main runs run each peer at its defaults and as `<peer>[best]`; "
             "targets are judged against the faster of the two.", "",
             "| store | peer | tuning state | grid point: save / load MB/s (fastest run) "
             "| best save | best load |", "|---|---|--:|---|---|---|"]
    for store, peers in tuned.items():
        for name, t in peers.items():
            points = "; ".join(
                f"{_options_text(p['options'])}: {_fmt(p.get('save_mbps'))} / "
                f"{_fmt(p.get('load_mbps'))}" for p in t.get("points", []))
            lines.append("| " + " | ".join([
                store, name, format_bytes(t.get("state_bytes", 0)), points,
                f"{_options_text(t['save']['options'])} ({_fmt(t['save']['mbps'])})",
                f"{_options_text(t['load']['options'])} ({_fmt(t['load']['mbps'])})",
            ]) + " |")
    lines.append("")
    return lines


def _mib(v: Any) -> str:
    if v is None:
        return "—"
    return f"{v / (1 << 20):.0f} MiB"


# -- chart ---------------------------------------------------------------------------------


def write_chart(result: dict[str, Any], path: Path) -> None:
    """Bar chart: one row per store, save and load side by side, one bar per system
    (dcpstore's outlined, the limit hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = result["config"]["world_size"]
    stores = [s for s in result["stores"]
              if any(c["store"] == s and c["world_size"] == n for c in result["cases"])]
    rows = max(1, len(stores))
    fig, axes = plt.subplots(rows, 2, figsize=(12, 2.9 * rows + 0.6), squeeze=False)
    colors = {"dcpstore": "#2F6DB5", "peer": "#9A9A9A", "limit": "#E3A33B"}
    for row, store in enumerate(stores):
        mine = [c for c in result["cases"] if c["store"] == store and c["world_size"] == n]
        info = result["stores"][store]
        systems = _system_order(info, mine)
        by = {(c["system"], c["op"]): c["summary"] for c in mine}
        for col, op in enumerate(("save", "load")):
            ax = axes[row][col]
            vals = [(by.get((s, op)) or {}).get("mbps") or 0.0 for s in systems]
            # error bars: the slowest and the fastest run (min-max)
            err = [[max(0.0, v - ((by.get((s, op)) or {}).get("mbps_min") or v))
                    for s, v in zip(systems, vals, strict=True)],
                   [max(0.0, ((by.get((s, op)) or {}).get("mbps_max") or v) - v)
                    for s, v in zip(systems, vals, strict=True)]]
            kinds = []
            for s in systems:
                summ = by.get((s, op)) or by.get((s, "save")) or {}
                kinds.append("limit" if summ.get("is_limit") else
                             "dcpstore" if summ.get("is_dcpstore") else "peer")
            bars = ax.barh(range(len(systems)), vals, color=[colors[k] for k in kinds],
                           xerr=err, error_kw={"elinewidth": 0.8, "capsize": 2})
            for bar, kind, v, hi in zip(bars, kinds, vals, err[1], strict=True):
                if kind == "limit":
                    bar.set_hatch("//")
                # the median, past the error bar's end
                ax.annotate(f" {v:.0f}" if v else " failed",
                            (v + hi, bar.get_y() + bar.get_height() / 2), va="center",
                            fontsize=7)
            ax.set_yticks(range(len(systems)))
            ax.set_yticklabels(systems, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel("MB/s", fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
            ax.set_xlim(0, max([*(v + e for v, e in zip(vals, err[1], strict=True)), 1.0])
                        * 1.18)
            ax.grid(axis="x", alpha=0.3)
            ax.set_title(f"{store} {op}: {format_bytes(info['state_bytes'])}, {n} ranks"
                         + (" (in-memory server)" if info.get("note") else ""), fontsize=9)
    m = result["machine"]
    fig.suptitle(f"dcpstore (blue) vs peers (grey) vs the raw limit (hatched): "
                 f"{m['cpus']} CPUs, median and min-max of {result['config']['runs']} run(s), "
                 f"{result['config']['mode']} mode", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (2.9 * rows + 0.6)))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- outputs -------------------------------------------------------------------------------


def write_outputs(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``chart.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md",
             "chart": out / "chart.png"}
    paths["json"].write_text(json.dumps(result, indent=1, sort_keys=False, default=str) + "\n")
    paths["markdown"].write_text(render_markdown(result))
    write_chart(result, paths["chart"])
    return paths
