"""Read-once loads: bytes and requests the store serves, and load time, with read
sharing (``broadcast_reads``) on and off.

``python -m benchmarks.read_once [--runs 6] [--mib 64] [--out benchmarks/results/read_once]``

Four gloo ranks on this machine save two checkpoints, then load each with sharing on and
off from each store, ``--runs`` times:

- ``replicated``: ``--mib`` MiB of state every rank holds whole (DDP parameters, biases,
  optimizer scalars, a ``Replicate`` DTensor, Python objects);
- ``hsdp``: ``2 * --mib`` MiB of DTensors on a 2 x 2 mesh, sharded within a replica group
  and replicated across the two groups (each byte is needed by 2 ranks).

Stores: SeaweedFS behind a :class:`dcpstore.testing.FaultProxy` with no faults, which
counts the bytes and requests it serves (rank 0 runs it and reads it between loads);
the same behind a proxy that also caps what the store serves, all clients together, at
``--egress`` MiB/s (``seaweedfs-capped``: a store whose bandwidth is the bottleneck, as
when many nodes load the same checkpoint); and a local directory (no proxy: wall time
only).

Method: every run loads all twelve cases (state x store x sharing) once, in a balanced
random order (:func:`benchmarks.runner.balanced_order`: a seeded permutation, the next run
its reverse, so with an even ``--runs`` each case runs before each other one in exactly
half the runs); every figure is reported as the median with the min-max spread over the
runs. Results go to ``results.json`` (every run, and every run's order) and
``results.md`` under ``--out``, with the commit they were measured at; results written
into ``benchmarks/results`` (its ``tmp/`` aside) refuse a tree with uncommitted changes
unless ``--allow-dirty``, and a dirty tree's diff SHA-256 is recorded.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from .env import DirtyTree, checkout_text, run_checkout

__all__ = ["STORES", "cases", "main", "render_markdown", "summarize"]

WORLD = 4
MiB = 1024 * 1024
#: Runs by default: >= 5 for a median with a spread, even for a balanced order.
RUNS = 6
SCENARIOS = ("replicated", "hsdp")
#: Stores in report order.
STORES = ("seaweedfs", "seaweedfs-capped", "local")
#: Figures of the counting proxy (not of the local store), reported with their spread.
_COUNTS = ("bytes_fetched", "fetched_over_unique", "requests", "metadata_gets")


def cases() -> list[str]:
    """The cases a run loads, ``"<state>/<store>/<sharing>"``, in report order."""
    return [f"{scenario}/{store}/{mode}" for scenario in SCENARIOS for store in STORES
            for mode in ("off", "on")]


def _replicated(mib: int, fill: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    g = torch.Generator().manual_seed(1)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) if fill else torch.zeros(*shape)

    rows = mib * MiB // 4 // 1024 // 8  # eight [rows, 1024] fp32 weights ~= mib MiB
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state: dict[str, Any] = {f"layers.{i}.w": t(rows, 1024) for i in range(7)}
    state["rep"] = distribute_tensor(t(rows, 1024), mesh, [Replicate()])
    for i in range(32):  # biases, norms and optimizer scalars: many small items
        state[f"layers.{i}.b"] = t(1024)
        state[f"optim.{i}.step"] = torch.tensor(float(i) if fill else 0.0)
    state["extra"] = {"epoch": 3 if fill else 0}
    return state


def _hsdp(mib: int, fill: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(2)
    rows = 2 * mib * MiB // 4 // 1024 // 8
    return {
        f"layers.{i}.w": distribute_tensor(
            torch.randn(rows, 1024, generator=g) if fill else torch.zeros(rows, 1024),
            mesh, [Replicate(), Shard(0)])
        for i in range(8)
    }


def _capped_proxy(upstream: str, plan: Any, mib_per_s: float) -> Any:
    """A counting proxy that serves at most ``mib_per_s`` MiB/s, all connections
    together (each response chunk waits for its turn at that rate)."""
    import threading

    from dcpstore.testing.faultproxy import FaultProxy

    class CappedProxy(FaultProxy):
        rate = mib_per_s * MiB
        _pace = threading.Lock()
        _free_at = 0.0

        def _count_down(self, n: int) -> None:
            super()._count_down(n)
            with self._pace:
                start = max(time.monotonic(), self._free_at)
                self._free_at = start + n / self.rate
                wait = self._free_at - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    return CappedProxy(upstream, plan)


def _rank(rank: int, port: int, seaweed: dict[str, Any], local_dir: str, mib: int,
          orders: list[list[str]], egress: float, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(seaweed["env"])
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import dcpstore
    from dcpstore.testing.faultproxy import FaultPlan, FaultProxy, RequestInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    gets: Counter[str] = Counter()
    proxies: dict[str, Any] = {}
    endpoints: list[Any] = [None, None]
    if rank == 0:
        def count(info: RequestInfo) -> bool:
            if info.method == "GET":
                gets[info.object_name.rsplit("/", 1)[-1]] += 1
            return False

        proxies["seaweedfs"] = FaultProxy(seaweed["endpoint"], FaultPlan(match=count)).start()
        proxies["seaweedfs-capped"] = _capped_proxy(seaweed["endpoint"],
                                                    FaultPlan(match=count), egress).start()
        endpoints = [proxies["seaweedfs"].endpoint_url,
                     proxies["seaweedfs-capped"].endpoint_url]
    dist.broadcast_object_list(endpoints, src=0)
    direct = {"endpoint_url": seaweed["endpoint"]}
    counted = {"seaweedfs": {"endpoint_url": endpoints[0]},
               "seaweedfs-capped": {"endpoint_url": endpoints[1]}}
    run_id = seaweed["run"]
    rows: list[dict[str, Any]] = []
    makers = {"replicated": _replicated, "hsdp": _hsdp}
    unique: dict[str, int] = {}
    try:
        for scenario in SCENARIOS:
            s3_uri = f"s3://bench/{run_id}/{scenario}"
            dcpstore.save(makers[scenario](mib, True), s3_uri, **direct)
            dcpstore.save(makers[scenario](mib, True), os.path.join(local_dir, scenario))
            if rank == 0:
                backend = dcpstore.open_backend(s3_uri, **direct)
                unique[scenario] = sum(o.size for o in backend.list())
                backend.close()
        # every rank follows the same order (computed by the parent)
        for run, order in enumerate(orders):
            for position, case in enumerate(order):
                scenario, store, mode = case.split("/")
                uri = (os.path.join(local_dir, scenario) if store == "local"
                       else f"s3://bench/{run_id}/{scenario}")
                proxy = proxies.get(store)
                state = makers[scenario](mib, False)
                options = dict(counted.get(store, {}))
                options["broadcast_reads"] = mode == "on"
                # the load's group (the world), as dcpstore.load passes it: without it
                # every rank reads .metadata itself, sharing on or off
                reader = dcpstore.get_reader(uri, process_group=None, **options)
                # reset before the barrier: past it the other ranks start
                # loading at once, and their first GETs must count
                if proxy is not None:
                    proxy.reset_stats()
                    gets.clear()
                dist.barrier()
                start = time.perf_counter()
                dcp.load(state, storage_reader=reader)
                seconds = time.perf_counter() - start
                reader.backend.close()
                times = [0.0] * WORLD
                dist.all_gather_object(times, seconds)
                if rank == 0:
                    row: dict[str, Any] = {
                        "scenario": scenario, "store": store, "sharing": mode,
                        "run": run, "position": position, "seconds": max(times),
                    }
                    if proxy is not None:
                        st = proxy.snapshot()
                        row.update(unique_bytes=unique[scenario],
                                   bytes_fetched=st.bytes_down,
                                   requests=st.total_requests,
                                   metadata_gets=gets[".metadata"])
                    rows.append(row)
        if rank == 0:
            queue.put(rows)
        dist.barrier()
    finally:
        for proxy in proxies.values():
            proxy.stop()
    os._exit(0)


def _stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case (state, store, sharing), in report order: the median and the min-max
    over runs of the load time and, for the counted stores, of the bytes and requests
    the store served (``{"median", "min", "max"}`` each)."""
    out = []
    for case in cases():
        scenario, store, sharing = case.split("/")
        group = [r for r in rows if (r["scenario"], r["store"], r["sharing"])
                 == (scenario, store, sharing)]
        if not group:
            continue
        entry: dict[str, Any] = {"scenario": scenario, "store": store, "sharing": sharing,
                                 "runs": len(group),
                                 "seconds": _stat([r["seconds"] for r in group])}
        if "bytes_fetched" in group[0]:
            entry["unique_bytes"] = group[0]["unique_bytes"]
            for key in _COUNTS:
                entry[key] = _stat([r["bytes_fetched"] / r["unique_bytes"]
                                    if key == "fetched_over_unique" else r[key]
                                    for r in group])
        out.append(entry)
    return out


def _spread(stat: dict[str, float], fmt: str, scale: float = 1.0) -> str:
    """``median [min-max]``, or the median alone when every run agreed."""
    med = format(stat["median"] / scale, fmt)
    lo, hi = format(stat["min"] / scale, fmt), format(stat["max"] / scale, fmt)
    return med if lo == hi == med else f"{med} [{lo}-{hi}]"


def render_markdown(summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``results.md``: one row per case, every figure the median [min-max] over runs."""
    lines = [
        "# Read-once loads",
        "",
        f"`python -m benchmarks.read_once --mib {meta['mib']} --runs {meta['runs']} "
        f"--egress {meta['egress']:g} --seed {meta.get('seed', 0)}` at "
        f"{checkout_text(meta.get('checkout'), meta['commit'])}, {meta['world']} gloo "
        f"ranks on {meta['machine']}. seaweedfs-capped: the store serves at most "
        f"{meta['egress']:g} MiB/s. {meta['runs']} run(s), each loading every case once in "
        "a balanced random order (a seeded permutation, then its reverse; every run's order "
        "is in results.json); every figure is the **median [min-max]** over the runs (one "
        "value: every run agreed).",
        "",
        "| state | store | sharing | store MiB | x unique | requests | `.metadata` GETs "
        "| load s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for e in summary:
        if "bytes_fetched" in e:
            counts = (f"{_spread(e['bytes_fetched'], '.1f', MiB)} | "
                      f"{_spread(e['fetched_over_unique'], '.2f')} | "
                      f"{_spread(e['requests'], '.0f')} | "
                      f"{_spread(e['metadata_gets'], '.0f')}")
        else:
            counts = "n/a | n/a | n/a | n/a"
        lines.append(f"| {e['scenario']} | {e['store']} | {e['sharing']} | {counts} | "
                     f"{_spread(e['seconds'], '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and write ``results.json`` / ``results.md``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.read_once",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="replicated state per rank")
    parser.add_argument("--runs", type=int, default=RUNS,
                        help=f"loads of every case (default {RUNS}; median, min-max)")
    parser.add_argument("--egress", type=float, default=256.0,
                        help="MiB/s the capped store serves, all clients together")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run order")
    parser.add_argument("--out", default="benchmarks/results/read_once")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results into benchmarks/results from a tree with "
                        "uncommitted changes (the results then record the diff's SHA-256)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    out = Path(args.out)
    try:  # before anything is measured
        tree = run_checkout(out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2

    from dcpstore.testing.servers import free_port, seaweedfs_server

    from .runner import balanced_order

    orders = balanced_order(cases(), args.runs, args.seed)
    started = time.time()

    ctx = mp.get_context("spawn")
    with seaweedfs_server(bucket="bench") as server, \
            tempfile.TemporaryDirectory(prefix="read-once-") as local_dir:
        seaweed = {"endpoint": server.endpoint_url, "env": server.env(),
                   "run": f"read-once-{int(time.time())}"}
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank,
                             args=(r, port, seaweed, local_dir, args.mib, orders,
                                   args.egress, queue))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=1800)
        for p in procs:
            p.join(60)
    meta = {"commit": tree["commit"] or "", "checkout": tree, "world": WORLD,
            "mib": args.mib, "runs": args.runs, "egress": args.egress, "seed": args.seed,
            "duration_s": time.time() - started,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                       f"Python {platform.python_version()}"}
    summary = summarize(rows)
    markdown = render_markdown(summary, meta)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "orders": orders,
                                                  "summary": summary, "runs": rows},
                                                 indent=1) + "\n")
    (out / "results.md").write_text(markdown)
    sys.stdout.write(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
