"""``python -m benchmarks.incremental``: what incremental checkpoints save (issue 15).

Two workloads, each saved by a :class:`~dcpstore.Checkpointer` in one process:

- **LoRA**: a model whose frozen base (``requires_grad=False``) is about 95% of the
  bytes, plus low-rank adapters and their AdamW state, which change every step (an
  optimizer step on random gradients), saved as ``{"app": AppState(model, optim)}``.
  Five steps saved in full (``incremental=False``), five saved incrementally
  (``incremental=True``; step 1 is then a full save), and five incrementally with
  ``AppState(frozen_hint=True)`` (the frozen base is referenced without hashing).
  Per save: bytes written, seconds and CPU seconds; then the load time of step 5 of each
  run (median of 3 loads).
- **full training**: every tensor changes every step, so an incremental save writes
  everything: the cost of hashing. Five steps saved three ways: ``content_hash=False``
  (no hashing: the plain writer), the default (hashes recorded, no references), and
  ``incremental=True`` (hash, compare with the base, write everything).

Method: ``--runs`` runs (6 by default) of every case in a balanced random order
(:func:`benchmarks.runner.balanced_order`: a seeded permutation of the cases, the next run
its reverse, so with an even ``--runs`` each case runs before each other one in exactly
half the runs; every run's order is recorded), medians with the min-max spread over runs;
every figure of a run is the median over its saves 2..5 (step 1 is full in every case).
The load averages of the machine are recorded before and after (the machine may be
shared). On local disk the local backend's defaults apply (data files fsynced at commit).

CPU time: ``getrusage`` user + system seconds of the saving process (all its threads;
``RUSAGE_SELF``) and of its children that ended (``RUSAGE_CHILDREN``; none in these
blocking saves) around each save, reported beside the wall time and split into user (the
hashing, the serialization) and system (the copies into the page cache, the fsyncs'
bookkeeping). It is less disturbed than wall time by other load on the machine and by the
disk's write-back. The hashing A/B (``train/hash`` and ``train/incremental`` against
``train/no-hash``) is reported both ways, each with the spread of the per-run ratios (the
cases of a run run next to each other); the cost of hashing is also measured alone, wall
and CPU: XXH3-128 over every payload of the full-training state.

Results written into ``benchmarks/results`` (its ``tmp/`` aside) refuse a tree with
uncommitted changes unless ``--allow-dirty``; the commit and, for a dirty tree, the
diff's SHA-256 are recorded (``checkout``).

Examples::

    python -m benchmarks.incremental                       # local disk, the default sizes
    python -m benchmarks.incremental --stores local seaweedfs --out benchmarks/results/incremental
    python -m benchmarks.incremental --quick               # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import torch
import xxhash
from torch import nn

import dcpstore
from dcpstore.testing import assert_state_equal
from dcpstore.tools import ops

from .env import DirtyTree, checkout_text, run_checkout

__all__ = ["cpu_times", "evaluate_targets", "hash_state_cost", "lora_state", "main",
           "render_markdown", "summarize", "training_state"]

MiB = 1 << 20
STEPS = 5
LOADS = 3  # loads of step 5 per run (the median counts)
#: Runs by default: >= 5 for a median with a spread, even for a balanced order.
RUNS = 6


def cpu_times() -> tuple[float, float]:
    """User and system CPU seconds so far of this process (all its threads) and of its
    children that ended (``getrusage``)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


class LoraModel(nn.Module):
    """A frozen base (16 matrices, ``requires_grad=False``) with a trainable low-rank
    pair (A, B) per base matrix."""

    def __init__(self, rows: int, width: int, rank: int, layers: int = 16,
                 seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = nn.ParameterList(
            nn.Parameter(torch.randn(rows, width, generator=g), requires_grad=False)
            for _ in range(layers))
        self.a = nn.ParameterList(nn.Parameter(torch.randn(rank, width, generator=g))
                                  for _ in range(layers))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(rows, rank))
                                  for _ in range(layers))


def _lora_shape(total: int, layers: int = 16, width: int = 1024) -> tuple[int, int, int]:
    """Rows, width, rank so that the base is ~95% of ``total`` bytes and the adapters
    with their two AdamW moments the other ~5%."""
    rows = max(1, int(total * 0.95) // layers // (width * 4))
    # adapter params per layer: rank * (width + rows); x3 with exp_avg and exp_avg_sq
    rank = max(1, int(total * 0.05) // layers // 3 // ((width + rows) * 4))
    return rows, width, rank


def lora_state(total: int, seed: int = 0, frozen_hint: bool = False
               ) -> tuple[dict[str, Any], Callable[[], int]]:
    """``{"app": AppState}`` of a :class:`LoraModel` of about ``total`` bytes (with
    AdamW state) and a function that runs one optimizer step on random gradients and
    returns the bytes it changed (adapters and their moments)."""
    model = LoraModel(*_lora_shape(total), seed=seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)

    def step() -> int:
        for p in trainable:
            p.grad = torch.randn(p.shape, generator=g)
        optim.step()
        return 3 * sum(p.nbytes for p in trainable)

    return {"app": dcpstore.AppState(model, optim, frozen_hint=frozen_hint)}, step


def lora_hinted_state(total: int, seed: int = 0) -> tuple[dict[str, Any], Callable[[], int]]:
    """:func:`lora_state` with ``AppState(frozen_hint=True)``: the base is not hashed."""
    return lora_state(total, seed, frozen_hint=True)


def training_state(total: int, seed: int = 0) -> tuple[dict[str, Any], Callable[[], int]]:
    """A state of about ``total`` bytes in which every tensor changes every step."""
    g = torch.Generator().manual_seed(seed)
    width = 1024
    n = 16
    rows = max(1, total // n // (width * 4))
    state: dict[str, Any] = {f"p{i}": torch.randn(rows, width, generator=g) for i in range(n)}

    def step() -> int:
        for t in state.values():
            t.add_(0.01)
        return sum(t.nbytes for t in state.values())

    return state, step


def _run_case(root: str, make: Callable[..., tuple[dict[str, Any], Callable[[], int]]],
              size: int, options: dict[str, Any], backend_options: dict[str, Any],
              load: bool) -> dict[str, Any]:
    """Five saves of one case under ``root``; per save bytes written (data files of the
    step, from its manifest) and referenced, seconds, CPU seconds (user + system, and
    each; see :func:`cpu_times`), the changed bytes, and the load time of the last
    step."""
    state, step = make(size)
    saves = []
    with dcpstore.Checkpointer(root, **options) as ckpt:
        for s in range(1, STEPS + 1):
            changed = step()
            user, system = cpu_times()
            started = time.perf_counter()
            ckpt.save(s, state)
            seconds = time.perf_counter() - started
            user_after, system_after = cpu_times()
            user_s, sys_s = user_after - user, system_after - system
            info = ops.inspect_checkpoint(ckpt.step_uri(s), **backend_options)
            saves.append({"step": s, "seconds": seconds, "cpu_s": user_s + sys_s,
                          "user_s": user_s, "sys_s": sys_s, "changed": changed,
                          "written": info["stored_bytes"],
                          "referenced": info["referenced_bytes"]})
        load_s = None
        if load:
            fresh, fresh_step = make(size, seed=1)
            fresh_step()  # optimizer state to load into
            loads = []
            for _ in range(LOADS):
                started = time.perf_counter()
                ckpt.load(fresh, step=STEPS)
                loads.append(time.perf_counter() - started)
            load_s = statistics.median(loads)
            # a wrong load is no figure
            assert_state_equal(fresh["app"].state_dict(), state["app"].state_dict())
    return {"saves": saves, "load_s": load_s}


CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # name: (workload, Checkpointer options, load step 5)
    "lora/full": ("lora", {}, True),
    "lora/incremental": ("lora", {"incremental": True}, True),
    "lora/incremental+hint": ("lora-hint", {"incremental": True}, True),
    "train/no-hash": ("train", {"content_hash": False}, False),
    "train/hash": ("train", {}, False),
    "train/incremental": ("train", {"incremental": True}, False),
}
WORKLOADS = {"lora": lora_state, "lora-hint": lora_hinted_state, "train": training_state}


def _stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


#: Per-save figures summarized (``user_s``/``sys_s``: absent from results written before
#: they were measured).
_FIGURES = ("seconds", "cpu_s", "user_s", "sys_s", "written", "referenced", "changed")
#: Figures whose per-run values are kept in the summary, for the paired A/B ratios.
_PAIRED = ("seconds", "cpu_s", "user_s", "sys_s")


def summarize(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per case: median (min-max over runs) of the per-run medians over saves 2..N, and
    (``per_run``) the per-run medians of the time figures, in run order."""
    out: dict[str, Any] = {}
    for case, runs in raw.items():
        per_run = []
        for run in runs:
            later = run["saves"][1:]
            row = {k: statistics.median(s[k] for s in later) for k in _FIGURES
                   if all(k in s for s in later)}
            row.update(first_seconds=run["saves"][0]["seconds"], load_s=run["load_s"])
            per_run.append(row)
        out[case] = {k: _stat([r[k] for r in per_run]) if k in per_run[0] else None
                     for k in (*_FIGURES, "first_seconds")}
        loads = [r["load_s"] for r in per_run if r["load_s"] is not None]
        out[case]["load_s"] = _stat(loads) if loads else None
        out[case]["per_run"] = {k: [r[k] for r in per_run] for k in _PAIRED
                                if k in per_run[0]}
    return out


def _paired(summary: dict[str, Any], case: str, base: str, key: str
            ) -> dict[str, float] | None:
    """``case`` over ``base`` - 1 per run (same run, next to each other), median and
    min-max; ``None`` without per-run figures."""
    a = (summary[case].get("per_run") or {}).get(key)
    b = (summary[base].get("per_run") or {}).get(key)
    if not a or not b or len(a) != len(b) or not all(b):
        return None
    return _stat([x / y - 1 for x, y in zip(a, b, strict=True)])


def _pct(over: float, paired: dict[str, float] | None) -> str:
    """``+8.1%``, then ``[per run -3.0% to +20.0%]`` when there are per-run figures."""
    text = f"{100 * over:+.1f}%"
    if paired is not None:
        text += f" [per run {100 * paired['min']:+.1f}% to {100 * paired['max']:+.1f}%]"
    return text


def evaluate_targets(summary: dict[str, Any], hash_s: float | None = None,
                     hash_cpu_s: float | None = None) -> list[dict[str, Any]]:
    """The issue's targets, met or not, from one store's summary.

    The hashing overhead is judged twice: by wall time and by CPU time (``getrusage``
    user + system of the saves), each against ``train/no-hash``.

    Args:
        summary: One store's :func:`summarize`.
        hash_s: Wall seconds to hash every payload of the full-training state alone
            (:func:`hash_state_cost`).
        hash_cpu_s: CPU seconds of the same.
    """
    targets = []
    full = summary.get("lora/full")
    for case in ("lora/incremental", "lora/incremental+hint"):
        inc = summary.get(case)
        if not full or not inc:
            continue
        changed = inc["changed"]["median"]
        written = inc["written"]["median"]
        targets.append({
            "target": f"{case}: bytes written per save <= 1.1 x changed bytes + metadata",
            "value": f"{written / changed:.3f} x changed bytes (metadata included)",
            "met": written <= 1.1 * changed + 256 * 1024,
        })
        ratio_bytes = written / full["written"]["median"]
        ratio_time = inc["seconds"]["median"] / full["seconds"]["median"]
        targets.append({
            "target": f"{case}: save time falls in proportion to the bytes written "
                      "(within 2x, or +0.1 of the full save's time)",
            "value": f"time {ratio_time:.3f} x full for {ratio_bytes:.3f} x the bytes",
            "met": ratio_time <= max(2 * ratio_bytes, ratio_bytes + 0.1),
        })
        if full["load_s"] and inc["load_s"]:
            ratio = inc["load_s"]["median"] / full["load_s"]["median"]
            targets.append({
                "target": f"{case}: loading step 5 is as fast as a full step 5 (<= 1.1x)",
                "value": f"{ratio:.3f} x the load time of the full step",
                "met": ratio <= 1.1,
            })
    plain = summary.get("train/no-hash")
    if plain:
        for case in ("train/hash", "train/incremental"):
            if case not in summary:
                continue
            s = summary[case]
            over = s["seconds"]["median"] / plain["seconds"]["median"] - 1
            cpu = s["cpu_s"]["median"] / plain["cpu_s"]["median"] - 1
            wall_text = _pct(over, _paired(summary, case, "train/no-hash", "seconds"))
            cpu_text = _pct(cpu, _paired(summary, case, "train/no-hash", "cpu_s"))
            targets.append({
                "target": f"hashing overhead <= 5% of a full save, wall time ({case} vs "
                          "train/no-hash)",
                "value": f"wall {wall_text}; CPU {cpu_text}",
                "met": over <= 0.05,
            })
            split = ""
            if s.get("user_s") and plain.get("user_s") and plain["user_s"]["median"]:
                user = s["user_s"]["median"] / plain["user_s"]["median"] - 1
                split = (f" (user {s['user_s']['median']:.3f} vs "
                         f"{plain['user_s']['median']:.3f} s: "
                         f"{_pct(user, _paired(summary, case, 'train/no-hash', 'user_s'))}; "
                         f"system {s['sys_s']['median']:.3f} vs "
                         f"{plain['sys_s']['median']:.3f} s)")
            targets.append({
                "target": f"hashing overhead <= 5% of a full save, CPU time (getrusage user "
                          f"+ system; {case} vs train/no-hash)",
                "value": f"CPU {s['cpu_s']['median']:.3f} vs {plain['cpu_s']['median']:.3f} "
                         f"s: {cpu_text}{split}",
                "met": cpu <= 0.05,
            })
        if hash_s is not None:
            share = hash_s / plain["seconds"]["median"]
            cpu_text = ""
            if hash_cpu_s is not None:
                cpu_text = (f"; CPU {1000 * hash_cpu_s:.1f} ms = "
                            f"{100 * hash_cpu_s / plain['seconds']['median']:.1f}% of its "
                            f"wall time, {100 * hash_cpu_s / plain['cpu_s']['median']:.1f}% "
                            f"of its CPU {plain['cpu_s']['median']:.3f} s")
            targets.append({
                "target": "hashing overhead <= 5% of a full save (hashing the whole state, "
                          "measured alone, vs a full save without hashing)",
                "value": f"wall {1000 * hash_s:.1f} ms = {100 * share:.1f}% of "
                         f"{plain['seconds']['median']:.3f} s{cpu_text}",
                "met": share <= 0.05,
            })
    return targets


def hash_state_cost(size: int, repeats: int = 5) -> dict[str, float]:
    """Seconds to XXH3-128 every payload of the full-training state, as the writer does:
    ``{"wall_s", "cpu_s"}`` (CPU: user + system, :func:`cpu_times`), medians of
    ``repeats``. The work a save spends on hashing."""
    from dcpstore.dcp.writer import payload_digest

    state, _ = training_state(size)
    walls, cpus = [], []
    for _ in range(repeats):
        before = sum(cpu_times())
        started = time.perf_counter()
        for t in state.values():
            payload_digest(t)
        walls.append(time.perf_counter() - started)
        cpus.append(sum(cpu_times()) - before)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def hash_speed(nbytes: int = 256 * MiB) -> dict[str, float]:
    """GB/s of XXH3-128 and CRC32C over one buffer on this machine (best of 3)."""
    buf = os.urandom(nbytes)
    out = {}
    for name, fn in (("xxh3_128", xxhash.xxh3_128_digest), ("crc32c", crc32c.crc32c)):
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            fn(buf)
            best = min(best, time.perf_counter() - started)
        out[name] = nbytes / best / 1e9
    return out


def _fmt(stat: dict[str, float] | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    if stat is None:
        return "-"
    return (f"{fmt.format(stat['median'] / scale)} "
            f"({fmt.format(stat['min'] / scale)}-{fmt.format(stat['max'] / scale)})")


def render_markdown(results: dict[str, Any]) -> str:
    """The tables of ``docs/performance.md`` from a results document."""
    lines = []
    if "checkout" in results or "commit" in results:
        lines += [f"Measured at {checkout_text(results.get('checkout'), results.get('commit'))}"
                  f"; `{results.get('command', 'python -m benchmarks.incremental')}`.", ""]
    for store, summary in results["summary"].items():
        runs = results["runs"]
        lines += [f"**{store}**, state {results['size_mib']} MiB, {runs} "
                  f"run{'s' * (runs != 1)} in a balanced random order (median, min-max "
                  "over runs; per run the median of saves 2-5; CPU: getrusage user + "
                  "system of the saving process):", "",
                  "| case | MiB written / save | MiB referenced / save | MiB changed / step "
                  "| save s | save CPU s | CPU user s | CPU system s | load step 5 s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for case, s in summary.items():
            lines.append(f"| {case} | {_fmt(s['written'], MiB, '{:.1f}')} | "
                         f"{_fmt(s['referenced'], MiB, '{:.1f}')} | "
                         f"{_fmt(s['changed'], MiB, '{:.1f}')} | {_fmt(s['seconds'])} | "
                         f"{_fmt(s['cpu_s'])} | {_fmt(s.get('user_s'))} | "
                         f"{_fmt(s.get('sys_s'))} | {_fmt(s['load_s'])} |")
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        for t in results["targets"][store]:
            lines.append(f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


@contextlib.contextmanager
def _store(name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh root on ``name`` and the options to reach it."""
    if name == "local":
        with tempfile.TemporaryDirectory(prefix="dcpstore-bench-inc-") as tmp:
            yield tmp, {}
        return
    if name == "seaweedfs":
        from dcpstore.testing.servers import seaweedfs_server

        with seaweedfs_server(bucket="bench") as server:
            saved = dict(os.environ)
            os.environ.update(server.env())
            try:
                yield "s3://bench", {"endpoint_url": server.endpoint_url}
            finally:
                os.environ.clear()
                os.environ.update(saved)
        return
    raise ValueError(f"unknown store {name!r}: local or seaweedfs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.incremental",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512, help="bytes of each state")
    parser.add_argument("--runs", type=int, default=RUNS,
                        help=f"runs of every case (default {RUNS}; median, min-max)")
    parser.add_argument("--stores", nargs="+", default=["local"],
                        choices=["local", "seaweedfs"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="32 MiB, 1 run")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json and results.md")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results into benchmarks/results from a tree with "
                        "uncommitted changes (the results then record the diff's SHA-256)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.runs = 32, 1
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    try:  # before anything is measured
        tree = run_checkout(args.out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    from .runner import balanced_order

    size = args.size_mib * MiB
    started_at = time.time()
    load_before = os.getloadavg()
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    orders: dict[str, list[list[str]]] = {}
    for i, store in enumerate(args.stores):
        raw[store] = {c: [] for c in args.cases}
        orders[store] = balanced_order(list(args.cases), args.runs, args.seed + i)
        with _store(store) as (base, options):
            for run, order in enumerate(orders[store]):
                for case in order:
                    workload, extra, load = CASES[case]
                    root = f"{base.rstrip('/')}/{case.replace('/', '-')}-{uuid.uuid4().hex[:6]}"
                    result = _run_case(root, WORKLOADS[workload], size, {**options, **extra},
                                       options, load)
                    raw[store][case].append(result)
                    print(f"{store} run {run + 1} {case}: "
                          + ", ".join(f"{s['seconds']:.3f}s/{s['cpu_s']:.3f}s CPU/"
                                      f"{s['written'] / MiB:.1f}MiB"
                                      for s in result["saves"])
                          + (f"; load {result['load_s']:.3f}s" if load else ""), flush=True)
                    if store == "local":
                        shutil.rmtree(root, ignore_errors=True)
    summary = {store: summarize(cases) for store, cases in raw.items()}
    hashing = hash_state_cost(size)
    results = {
        "command": " ".join(["python -m benchmarks.incremental",
                             *(sys.argv[1:] if argv is None else argv)]),
        "commit": tree["commit"] or "",
        "checkout": tree,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "duration_s": time.time() - started_at,
        "size_mib": args.size_mib,
        "runs": args.runs,
        "seed": args.seed,
        "orders": orders,
        "steps": STEPS,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "xxhash": xxhash.VERSION,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "hash_gbps": hash_speed(),
        "hash_state_s": hashing["wall_s"],
        "hash_state_cpu_s": hashing["cpu_s"],
        "summary": summary,
        "targets": {store: evaluate_targets(s, hashing["wall_s"], hashing["cpu_s"])
                    for store, s in summary.items()},
        "raw": raw,
    }
    markdown = render_markdown(results)
    print(markdown)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.md").write_text(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
