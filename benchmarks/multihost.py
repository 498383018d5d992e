"""``python -m benchmarks.multihost``: the node-local tier across hosts, with a lost host.

Three hosts made of network namespaces on one machine (:class:`dcpstore.testing.hosts.Hosts`,
root and iproute2 needed), 2 ranks each, ``--size`` bytes per rank in a
``Checkpointer(local_tier=<the host's own directory>, async_mode="thread")`` with one
replica per host (``local_replicas=1``). SeaweedFS runs on the machine's side of the
bridge, and what it sends to the hosts is throttled to ``--remote-mibps`` (a realistic
remote store); the hosts' traffic to each other is not.

It measures:

- **the save**: ``save()``'s blocked time, the duration of a fixed training step while
  step 2's replication and drain run in the background against the same step with
  nothing in flight, and the replication's seconds and bytes (``last_replication``);
- **the restart after losing host 1**, ``--runs`` times each way in a random order with
  equal counts: from the tier (host 1's directory is wiped first, as a replacement node's
  disk is empty: its files come from the host holding their replicas), and from the root
  (a Checkpointer without a local tier). The figure is the slowest rank's
  ``last_load["seconds"]``;
- **kill runs** (``--kills``, at ``--kill-size`` per rank): step 1 committed, then every
  process of host 1 is SIGKILLed at a random moment of step 2's save, 0 to
  ``--kill-window`` seconds in (its local write, replication or drain);
  host 1 comes back with an empty disk and the job resumes. Every rank must load the same
  step, and hold exactly that step's values: nothing torn or mixed.

Examples::

    python -m benchmarks.multihost --out benchmarks/results/multihost
    python -m benchmarks.multihost --size 32MiB --runs 2 --kills 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from dcpstore.testing.hosts import Hosts, sweep
from dcpstore.testing.servers import seaweedfs_server

from .env import DirtyTree, checkout_text, git_commit, machine_info, run_checkout, versions
from .workload import format_bytes, parse_size

__all__ = ["main"]

WORKER = str(Path(__file__).with_name("multihost_worker.py"))
BUCKET = "multihost-bench"
JOB_TIMEOUT = 600.0


class Harness:
    """The hosts, the store, and one job at a time on them."""

    def __init__(self, hosts: Hosts, endpoint: str, size: int, out: Path) -> None:
        self.hosts, self.size, self.out = hosts, size, out
        self.options = {"endpoint_url": endpoint}

    def args(self, name: str, **extra: Any) -> dict[str, Any]:
        return {"root": f"s3://{BUCKET}/{name}", "name": name, "size": self.size,
                "options": self.options, **extra}

    def start(self, op: str, args: dict[str, Any]) -> tuple[Path, list[Any]]:
        out = self.out / "jobs" / f"{op}-{uuid.uuid4().hex[:6]}"
        out.mkdir(parents=True)
        procs = self.hosts.torchrun([WORKER, op, json.dumps({**args, "out": str(out)})],
                                    nproc_per_host=2, logs=str(out / "logs"))
        return out, procs

    def run(self, op: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        out, procs = self.start(op, args)
        deadline = time.monotonic() + JOB_TIMEOUT
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            self.stop(procs)
        return records(out, op, 6)

    def stop(self, procs: list[Any]) -> None:
        for host, proc in zip(self.hosts.hosts, procs, strict=True):
            if proc.poll() is None:
                self.hosts.kill_host(host, proc)

    def wipe(self, host: int, name: str) -> None:
        shutil.rmtree(Path(self.hosts[host].tier) / name, ignore_errors=True)


def records(out: Path, op: str, world: int, *, ok: bool = True) -> list[dict[str, Any]]:
    """Every rank's record; with ``ok``, raise naming the ranks that failed."""
    found = []
    for rank in range(world):
        path = out / f"{op}-rank{rank}.json"
        if not path.exists():
            if ok:
                raise RuntimeError(f"{op}: rank {rank} reported nothing (logs: {out}/logs)")
            continue
        found.append(json.loads(path.read_text()))
    failed = [r for r in found if r["status"] != "ok"]
    if ok and failed:
        raise RuntimeError("\n".join(f"{op}: rank {r['rank']}: {r['traceback']}"
                                     for r in failed))
    return found


def restart_runs(h: Harness, name: str, runs: int, seed: int) -> dict[str, list[float]]:
    order = ["peers", "remote"] * runs
    random.Random(seed).shuffle(order)
    times: dict[str, list[float]] = {"peers": [], "remote": []}
    for way in order:
        if way == "peers":
            h.wipe(1, name)  # host 1 replaced: its files come from host 2's replicas
        got = h.run("load", h.args(name, tier=way == "peers"))
        want = "local" if way == "peers" else "remote"
        bad = [r for r in got if (r["loaded"], r["where"], r["holds"]) != (2, want, 2)]
        if bad:
            raise RuntimeError(f"restart from the {way} went wrong: {bad}")
        times[way].append(max(r["seconds"] for r in got))
        print(f"  restart from the {way}: {times[way][-1]:.2f} s", flush=True)
    return times


def kill_run(h: Harness, index: int, rng: random.Random, size: int, window: float
             ) -> dict[str, Any]:
    name = f"kill-{index}-{uuid.uuid4().hex[:6]}"
    args = {**h.args(name, pg_timeout=15), "size": size}
    out, procs = h.start("killed", args)
    delay = rng.uniform(0.0, window)
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        while not (out / "step2-started").exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"kill run {index}: the job ended before step 2 ({out})")
            time.sleep(0.02)
        time.sleep(delay)
        h.hosts.kill_host(h.hosts[1], procs[1])
        # the other hosts' ranks fail within the group's timeout; their torchrun then stops
        # its remaining workers (which may not get to report) and waits for the dead host
        survivors = [out / f"killed-rank{r}.json" for r in (0, 1, 4, 5)]
        while (time.monotonic() < deadline and not all(p.exists() for p in survivors)
               and not all(p.poll() is not None for p in (procs[0], procs[2]))):
            time.sleep(0.2)
    finally:
        h.stop(procs)
    reported = records(out, "killed", 6, ok=False)
    h.wipe(1, name)  # it comes back with an empty disk
    got = h.run("resume", {**h.args(name), "size": size})
    loaded = {r["loaded"] for r in got}
    torn = [r for r in got if r["holds"] != r["loaded"]]
    steps = {tuple(r["steps"]) for r in got}
    result = {"delay_s": delay, "loaded": sorted(loaded),
              "where": sorted({r["where"] for r in got}),
              "torn_ranks": [r["rank"] for r in torn], "steps_listed": sorted(steps),
              "save_finished_on": [r["rank"] for r in reported if r["status"] == "ok"]}
    print(f"  kill run {index}: killed {delay:.2f} s into step 2, resumed step "
          f"{result['loaded']} from {result['where']}, torn ranks {result['torn_ranks']}",
          flush=True)
    return result


def render(results: dict[str, Any]) -> str:
    r = results
    lines = ["# The node-local tier across hosts, with a lost host\n",
             f"3 hosts x 2 ranks (network namespaces on one machine, {r['machine']['cpus']} "
             f"cores), {format_bytes(r['size'])} per rank, one replica per host; SeaweedFS "
             f"on the bridge, its sends throttled to {r['remote_mibps']} MiB/s; "
             f"{checkout_text(r.get('checkout'), r['commit'])}.\n"]
    restart = r["restart"]
    if restart:
        lines += _render_restart(restart)
    if r["save"]:
        lines += _render_save(r["save"])
    if r["kills"]:
        lines += _render_kills(r)
    return "\n".join(lines)


def _render_restart(restart: dict[str, list[float]]) -> list[str]:
    med = {k: statistics.median(v) for k, v in restart.items()}
    lines = ["## Restart after losing host 1 (slowest rank's load, s)\n",
              "| from | median | min | max | runs |", "|---|--:|--:|--:|--:|"]
    for way in ("peers", "remote"):
        v = restart[way]
        lines.append(f"| {'the tier (host 1 from its replicas)' if way == 'peers' else 'the root'}"
                     f" | {med[way]:.2f} | {min(v):.2f} | {max(v):.2f} | {len(v)} |")
    lines.append(f"\nFrom the tier: **{med['remote'] / med['peers']:.1f}x** faster than from "
                 "the root (target: 3x).\n")
    return lines


def _render_save(s: dict[str, Any]) -> list[str]:
    return ["## The save of step 2 (median over ranks)\n",
              f"- `save()` blocked: {s['blocked_s']:.3f} s; durable (local commit, "
              f"replication and drain): {s['durable_s']:.2f} s",
              f"- a training step: {s['quiet_step_s'] * 1e3:.1f} ms with nothing in flight, "
              f"{s['busy_step_s'] * 1e3:.1f} ms while replication and drain ran "
              f"({s['busy_steps']} steps)",
              f"- replication: {s['replication_s']:.2f} s; {format_bytes(s['bytes_sent'])} "
              f"sent over the hosts' network in all ({format_bytes(s['bytes_per_rank'])} per "
              f"rank: each rank's files once to one other host); errors: {s['errors']}\n"]


def _render_kills(r: dict[str, Any]) -> list[str]:
    kills = r["kills"]
    torn = sum(bool(k["torn_ranks"]) for k in kills)
    resumed = [k["loaded"] for k in kills]
    lines = [f"## Kill runs: {len(kills)}\n",
              f"{format_bytes(r['kill_size'])} per rank; host 1 killed 0-{r['kill_window']:g} s "
              "into step 2's save (its local write, replication or drain), then resumed with "
              f"an empty disk: torn or mixed: **{torn}**; every rank loaded the same step in "
              f"{sum(len(x) == 1 for x in resumed)} of {len(kills)}; resumed step 1 in "
              f"{sum(x == [1] for x in resumed)}, step 2 in {sum(x == [2] for x in resumed)} "
              f"(from the tier in {sum(k['where'] == ['local'] for k in kills)}).\n",
              "| run | killed after, s | resumed step | from | save finished on ranks |",
              "|--:|--:|--:|---|---|"]
    lines += [f"| {i} | {k['delay_s']:.2f} | {k['loaded']} | {', '.join(k['where'])} | "
              f"{k['save_finished_on']} |" for i, k in enumerate(kills)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multihost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="state per rank (256MiB)")
    parser.add_argument("--runs", type=int, default=5, help="restarts each way (5)")
    parser.add_argument("--kills", type=int, default=20, help="kill runs (20)")
    parser.add_argument("--kill-size", default="64MiB",
                        help="state per rank of the kill runs (64MiB: each run is a save, "
                             "a kill and a resume)")
    parser.add_argument("--kill-window", type=float, default=12.0,
                        help="host 1 is killed 0 to this many seconds into step 2's save "
                             "(12: past the local write, replication and drain at 64MiB)")
    parser.add_argument("--remote-mibps", type=float, default=200.0,
                        help="the store's send rate to the hosts, MiB/s (200)")
    parser.add_argument("--phases", nargs="+", default=["save", "restart", "kills"],
                        choices=["save", "restart", "kills"],
                        help="what to run (restart needs save)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-jobs", default=None,
                        help="write the save and restart figures of a stopped run from "
                             "its jobs folder instead of running (with --commit)")
    parser.add_argument("--commit", default=None, help="the stopped run's commit")
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results from a tree with uncommitted changes (the "
                             "results then record the diff's SHA-256)")
    a = parser.parse_args(argv)
    out = Path(a.out)
    size = parse_size(a.size)
    checkout: dict[str, Any] | None = None
    if not a.from_jobs:  # --from-jobs measures nothing: it names the stopped run's commit
        try:
            checkout = run_checkout(out, a.allow_dirty)
        except DirtyTree as exc:
            print(f"python -m benchmarks.multihost: refusing to run: {exc}", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    if a.from_jobs:
        save, restart = from_jobs(Path(a.from_jobs))
        results = {"commit": a.commit, "assembled_from": a.from_jobs, "size": size,
                   "remote_mibps": a.remote_mibps, "machine": machine_info(),
                   "versions": versions(), "phases": ["save", "restart"], "save": save,
                   "restart": restart, "kills": []}
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "results.md").write_text(render(results))
        print(render(results))
        return 0
    commit = git_commit(dirty=True)  # kept for the readers of older results
    started = time.time()
    sweep()
    with Hosts(3) as hosts, seaweedfs_server(bucket=BUCKET, address=hosts.gateway) as store:
        os.environ.update(store.env())
        hosts.throttle_gateway(a.remote_mibps * 8 * 1.048576)  # MiB/s -> Mbit/s
        try:
            h = Harness(hosts, store.endpoint_url, size, out)
            name = f"run-{uuid.uuid4().hex[:6]}"
            save: dict[str, Any] | None = None
            restart: dict[str, list[float]] | None = None
            if "save" in a.phases:
                print(f"saving 3 x 2 x {format_bytes(size)} with replicas", flush=True)
                save = summarize_save(h.run("save", h.args(name, replicas=1, steps=5)))
            if "restart" in a.phases and save is not None:
                print("restarts after losing host 1", flush=True)
                restart = restart_runs(h, name, a.runs, a.seed)
            rng = random.Random(a.seed + 1)
            kill_size = parse_size(a.kill_size)
            kills = ([kill_run(h, i, rng, kill_size, a.kill_window) for i in range(a.kills)]
                     if "kills" in a.phases else [])
        finally:
            hosts.unthrottle_gateway()
    results = {"commit": commit, "checkout": checkout, "size": size,
               "remote_mibps": a.remote_mibps,
               "machine": machine_info(), "versions": versions(),
               "seconds": time.time() - started, "phases": a.phases, "save": save,
               "restart": restart, "kill_size": kill_size, "kill_window": a.kill_window,
               "kills": kills}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(render(results))
    shutil.rmtree(out / "jobs", ignore_errors=True)
    print(render(results))
    torn = sum(bool(k["torn_ranks"]) or len(k["loaded"]) != 1 for k in kills)
    return 1 if torn else 0


def from_jobs(jobs: Path) -> tuple[dict[str, Any] | None, dict[str, list[float]]]:
    """The save and restart figures of a stopped run, from its job records
    (``<out>/jobs/<op>-<id>/``, kept until a run ends): what it would have written."""
    save = None
    restart: dict[str, list[float]] = {"peers": [], "remote": []}
    for job in sorted(jobs.iterdir()):
        op = job.name.split("-")[0]
        if op == "save":
            save = summarize_save(records(job, "save", 6))
        elif op == "load":
            got = records(job, "load", 6)
            ways = {r["where"] for r in got}
            if len(ways) != 1 or any((r["loaded"], r["holds"]) != (2, 2) for r in got):
                raise RuntimeError(f"{job}: a restart that went wrong: {got}")
            restart["peers" if ways == {"local"} else "remote"].append(
                max(r["seconds"] for r in got))
    return save, restart


def summarize_save(saved: list[dict[str, Any]]) -> dict[str, Any]:
    """The save job's figures: medians over ranks, the replication's bytes in all."""
    reps = [r["replication"] for r in saved]
    return {
        "blocked_s": statistics.median(r["blocked_s"] for r in saved),
        "durable_s": statistics.median(r["durable_s"] for r in saved),
        "quiet_step_s": statistics.median(r["quiet_step_s"] for r in saved),
        "busy_step_s": statistics.median(r["busy_step_s"] or 0 for r in saved),
        "busy_steps": int(statistics.median(r["busy_steps"] for r in saved)),
        "replication_s": statistics.median(x["seconds"] for x in reps),
        "bytes_sent": sum(x["bytes_sent"] for x in reps),
        "bytes_per_rank": statistics.median(x["bytes_sent"] for x in reps),
        "errors": sorted({e for x in reps for e in x["errors"]}),
        "per_rank": saved,
    }


if __name__ == "__main__":
    sys.exit(main())
