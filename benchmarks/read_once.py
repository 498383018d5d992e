"""Read-once loads: bytes and requests the store serves, and load time, with read
sharing (``broadcast_reads``) on and off.

``python -m benchmarks.read_once [--runs 3] [--mib 64] [--out benchmarks/results/read_once]``

Four gloo ranks on this machine save two checkpoints, then load each with sharing on and
off, ``--runs`` times:

- ``replicated``: ``--mib`` MiB of state every rank holds whole (DDP parameters, biases,
  optimizer scalars, a ``Replicate`` DTensor, Python objects);
- ``hsdp``: ``2 * --mib`` MiB of DTensors on a 2 x 2 mesh, sharded within a replica group
  and replicated across the two groups (each byte is needed by 2 ranks).

Stores: SeaweedFS behind a :class:`dcpstore.testing.FaultProxy` with no faults, which
counts the bytes and requests it serves (rank 0 runs it and reads it between loads);
the same behind a proxy that also caps what the store serves, all clients together, at
``--egress`` MiB/s (``seaweedfs-capped``: a store whose bandwidth is the bottleneck, as
when many nodes load the same checkpoint); and a local directory (no proxy: wall time
only). Results go to ``results.json`` and
``results.md`` under ``--out``, with the commit they were measured at.
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

from .env import git_commit

__all__ = ["main"]

WORLD = 4
MiB = 1024 * 1024


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
          runs: int, egress: float, queue: Any) -> None:
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
    try:
        for scenario, make in (("replicated", _replicated), ("hsdp", _hsdp)):
            s3_uri = f"s3://bench/{run_id}/{scenario}"
            dcpstore.save(make(mib, True), s3_uri, **direct)
            dcpstore.save(make(mib, True), os.path.join(local_dir, scenario))
            unique = 0
            if rank == 0:
                backend = dcpstore.open_backend(s3_uri, **direct)
                unique = sum(o.size for o in backend.list())
                backend.close()
            for store in ("seaweedfs", "seaweedfs-capped", "local"):
                uri = os.path.join(local_dir, scenario) if store == "local" else s3_uri
                proxy = proxies.get(store)
                for mode in ("off", "on"):
                    for run in range(runs):
                        state = make(mib, False)
                        options = dict(counted.get(store, {}))
                        options["broadcast_reads"] = mode == "on"
                        reader = dcpstore.get_reader(uri, **options)
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
                                "run": run, "seconds": max(times),
                            }
                            if proxy is not None:
                                st = proxy.snapshot()
                                row.update(unique_bytes=unique, bytes_fetched=st.bytes_down,
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


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    stores = ["seaweedfs", "seaweedfs-capped", "local"]
    keys = sorted({(r["scenario"], r["store"], r["sharing"]) for r in rows},
                  key=lambda k: (k[0] != "replicated", stores.index(k[1]), k[2]))
    for scenario, store, sharing in keys:
        group = [r for r in rows if (r["scenario"], r["store"], r["sharing"])
                 == (scenario, store, sharing)]
        entry: dict[str, Any] = {"scenario": scenario, "store": store, "sharing": sharing,
                                 "median_seconds": statistics.median(r["seconds"]
                                                                     for r in group)}
        if "bytes_fetched" in group[0]:
            entry.update(unique_bytes=group[0]["unique_bytes"],
                         bytes_fetched=group[0]["bytes_fetched"],
                         fetched_over_unique=group[0]["bytes_fetched"]
                         / group[0]["unique_bytes"],
                         requests=group[0]["requests"],
                         metadata_gets=group[0]["metadata_gets"])
        out.append(entry)
    return out


def _markdown(summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Read-once loads",
        "",
        f"`python -m benchmarks.read_once --mib {meta['mib']} --runs {meta['runs']} "
        f"--egress {meta['egress']:g}` at commit `{meta['commit']}`, {meta['world']} gloo "
        f"ranks on {meta['machine']}. seaweedfs-capped: the store serves at most "
        f"{meta['egress']:g} MiB/s.",
        "",
        "| state | store | sharing | store bytes | x unique | requests | `.metadata` GETs "
        "| load s (median) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for e in summary:
        if "bytes_fetched" in e:
            counts = (f"{e['bytes_fetched'] / MiB:.1f} MiB | {e['fetched_over_unique']:.2f} | "
                      f"{e['requests']} | {e['metadata_gets']}")
        else:
            counts = "n/a | n/a | n/a | n/a"
        lines.append(f"| {e['scenario']} | {e['store']} | {e['sharing']} | {counts} | "
                     f"{e['median_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and write ``results.json`` / ``results.md``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.read_once",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="replicated state per rank")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--egress", type=float, default=256.0,
                        help="MiB/s the capped store serves, all clients together")
    parser.add_argument("--out", default="benchmarks/results/read_once")
    args = parser.parse_args(argv)

    from dcpstore.testing.servers import free_port, seaweedfs_server

    ctx = mp.get_context("spawn")
    with seaweedfs_server(bucket="bench") as server, \
            tempfile.TemporaryDirectory(prefix="read-once-") as local_dir:
        seaweed = {"endpoint": server.endpoint_url, "env": server.env(),
                   "run": f"read-once-{int(time.time())}"}
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank,
                             args=(r, port, seaweed, local_dir, args.mib, args.runs,
                                   args.egress, queue))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=1800)
        for p in procs:
            p.join(60)
    commit = git_commit() or ""
    meta = {"commit": commit, "world": WORLD, "mib": args.mib, "runs": args.runs,
            "egress": args.egress,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                       f"Python {platform.python_version()}"}
    summary = _summary(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                  "runs": rows}, indent=1) + "\n")
    (out / "results.md").write_text(_markdown(summary, meta))
    sys.stdout.write(_markdown(summary, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
