"""Where a warm local load's time goes: one process, the page cache warm, A/B variants.

``python -m benchmarks.load_profile [--mib 512] [--runs 6] [--out DIR] [--profile]``

The throughput benchmark's local load is far below its page-cache limit (issue 33: 0.39x
at ``6f53242``). This benchmark takes one load apart. It saves ``--mib`` MiB (float32
tensors of 8 MiB, and a few small ones, as layers and norms) to a local directory, warms
the page cache, then times these variants, each ``--runs`` times in a balanced random
order (:func:`benchmarks.runner.balanced_order`), reporting the median with its min-max:

- ``dcpstore``: ``dcp.load`` through dcpstore's reader, as shipped: every item verified
  against the manifest's CRC32C, a large payload's checksum computed by the read itself
  in 512 KiB steps while the bytes are in the CPU's cache;
- ``dcpstore-crc-after``: the same, with the payloads checksummed after their read (the
  delivery's second pass over them from memory: the reader before ``read_checksummed``);
- ``dcpstore-unverified``: the same with no CRC32C at all (what verification costs);
- ``raw-preadv``: the data files read into one buffer with ``preadv`` in 16 MiB steps, no
  DCP (the copy out of the page cache alone: this process's limit);
- ``crc-pass``: CRC32C over the loaded tensors, from memory (one second pass).

Then, with ``--ranks 2`` (the default), the same two-rank load as the throughput
benchmark's: two gloo processes each load their half of ``--mib`` MiB, and of ``--small``
MiB (a small state), ``--runs`` times; reported: rank 0's ``dcpstore.load`` time and,
per run, the slowest rank's time in the reader's ``read_data`` (the bytes: fetch,
checksum, decode, deliver). The rest is the load's fixed cost: DCP's planning and its
collectives, ``.metadata`` and the manifest.

``--profile`` adds a ``cProfile`` of the ``dcpstore`` variant (``profile.txt``: the main
thread; the reads run on the backend's worker threads) and of rank 0's small-state loads
(``profile-ranks.txt``, by cumulative time). Results: ``results.json`` and
``results.md`` under ``--out``, with the commit they ran at (a dirty tree is refused for
the committed results tree unless ``--allow-dirty``).
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

from .env import (
    add_output_args,
    checkout_text,
    machine_info,
    start_results,
    write_results,
)
from .runner import balanced_order

__all__ = ["VARIANTS", "layered_state", "main"]

MiB = 1024 * 1024
VARIANTS = ("dcpstore", "dcpstore-crc-after", "dcpstore-unverified", "raw-preadv",
            "crc-pass")


def layered_state(mib: int) -> dict[str, Any]:
    """About ``mib`` MiB of seeded float32 tensors: one 8 MiB weight and one 16 KiB norm
    per layer, the layers of a model."""
    import torch

    g = torch.Generator().manual_seed(33)
    layers = max(1, mib // 8)
    state: dict[str, Any] = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = torch.randn(2 * MiB, generator=g)  # 8 MiB
        state[f"layers.{i}.norm"] = torch.randn(4096, generator=g)
    return state


def _variants(root: str, dest: dict[str, Any]) -> dict[str, Callable[[], None]]:
    import torch.distributed.checkpoint as dcp

    import dcpstore
    from dcpstore.dcp import delivery
    from dcpstore.dcp.checksum import crc32c

    verify, threshold = delivery.Delivery._verify, delivery._CHECKSUM_WHILE_READING
    files = sorted(glob.glob(os.path.join(root, "__*")))
    total = sum(os.path.getsize(f) for f in files)
    buf = memoryview(bytearray(total))

    def load(*, verified: bool = True, while_reading: bool = True) -> Callable[[], None]:
        def run() -> None:
            delivery.Delivery._verify = verify if verified else (  # type: ignore[method-assign]
                lambda *a, **k: None)
            delivery._CHECKSUM_WHILE_READING = threshold if while_reading else 1 << 62
            try:
                dcp.load(dest, storage_reader=dcpstore.get_reader(root), no_dist=True)
            finally:
                delivery.Delivery._verify = verify  # type: ignore[method-assign]
                delivery._CHECKSUM_WHILE_READING = threshold
        return run

    def raw() -> None:
        at = 0
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                size, pos = os.fstat(fd).st_size, 0
                while pos < size:
                    pos += os.preadv(fd, [buf[at + pos: at + min(size, pos + 16 * MiB)]], pos)
            finally:
                os.close(fd)
            at += size

    def crc_pass() -> None:
        for t in dest.values():
            crc32c(t.numpy().data.cast("B"))

    return {"dcpstore": load(), "dcpstore-crc-after": load(while_reading=False),
            "dcpstore-unverified": load(verified=False), "raw-preadv": raw,
            "crc-pass": crc_pass}


def _rank(rank: int, world: int, port: int, root: str, mib: list[int], runs: int,
          profile: bool, results: Any) -> None:
    """One rank of the multi-rank part: its figures go to ``results`` (rank 0's)."""
    import torch
    import torch.distributed as dist

    import dcpstore
    from dcpstore.dcp import reader as reader_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spent: list[float] = []
    read_data = reader_module.Reader.read_data

    def timed(self: Any, plan: Any, planner: Any) -> Any:
        started = time.perf_counter()
        try:
            return read_data(self, plan, planner)
        finally:
            spent.append(time.perf_counter() - started)

    reader_module.Reader.read_data = timed  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for size in mib:
        state = {f"r{rank}.{k}": v for k, v in layered_state(max(1, size // world)).items()}
        if size // world < 8:  # a small state: 16 tensors of its size
            g = torch.Generator().manual_seed(rank)
            n = max(1, size * MiB // world // 4 // 16)
            state = {f"r{rank}.layers.{i}.weight": torch.randn(n, generator=g)
                     for i in range(16)}
        where = os.path.join(root, f"{size}MiB")
        dcpstore.save(state, where, overwrite=True)
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        for _ in range(2):
            dcpstore.load(dest, where)
        spent.clear()
        total: list[float] = []
        for _ in range(runs):
            dist.barrier()
            started = time.perf_counter()
            dcpstore.load(dest, where)
            total.append(time.perf_counter() - started)
        if not all(torch.equal(dest[k], v) for k, v in state.items()):
            raise AssertionError(f"rank {rank}: a load did not restore the saved state")
        text = None
        if profile and size == min(mib) and rank == 0:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(runs):
                dcpstore.load(dest, where)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(40)
            text = buf.getvalue()
        elif profile and size == min(mib):
            for _ in range(runs):
                dcpstore.load(dest, where)
        out[str(size)] = {"bytes_per_rank": sum(t.nbytes for t in state.values()),
                          "load_s": total, "read_data_s": list(spent), "profile": text}
    results.put((rank, out))
    dist.barrier()
    os._exit(0)  # gloo may abort a rank at interpreter exit after a save


def _ranks(world: int, mib: list[int], runs: int, profile: bool) -> dict[str, Any]:
    import torch.multiprocessing as tmp_mp

    from dcpstore.testing.servers import free_port

    # spawn: this process already ran thread pools, and a fork could inherit a held lock
    ctx = tmp_mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dcpstore-load-profile-ranks-") as root:
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, root, mib, runs, profile,
                                                 results)) for r in range(world)]
        for proc in procs:
            proc.start()
        per_rank = dict(results.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    # runs are aligned (a barrier before each): a load lasts until its slowest rank's
    # read_data is done, so the fixed cost is the load's time less the slowest one's
    out: dict[str, Any] = per_rank[0]
    for size, r in out.items():
        r["read_data_s"] = [max(per_rank[k][size]["read_data_s"][i] for k in per_rank)
                            for i in range(len(r["read_data_s"]))]
    return out


def _summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds),
            "max_s": max(seconds), "mbps": nbytes / statistics.median(seconds) / 1e6}


def render_markdown(result: dict[str, Any]) -> str:
    """``results.md`` from ``results.json``."""
    cfg, rows = result["config"], result["summary"]
    limit = rows["raw-preadv"]["median_s"]
    lines = [f"# Where a warm local load's time goes ({cfg['mib']} MiB, one process)", "",
             f"Ran at {checkout_text(result.get('checkout'))}; {cfg['runs']} runs per "
             f"variant in a balanced random order (seed {cfg['seed']}); median with "
             "min-max. MB = 10^6 bytes.", "",
             "| variant | median ms | min-max ms | MB/s | x raw-preadv |",
             "|---|--:|--:|--:|--:|"]
    for name in VARIANTS:
        r = rows[name]
        lines.append(f"| {name} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f}-"
                     f"{r['max_s'] * 1e3:.1f} | {r['mbps']:.0f} | "
                     f"{limit / r['median_s']:.2f}x |")
    lines += ["", "`x raw-preadv` is the speed against reading the same bytes out of the "
              "page cache with no DCP (for `crc-pass`, which moves no bytes from the "
              "files, it says how its cost compares)."]
    ranks = result.get("ranks")
    if ranks:
        lines += ["", f"## {cfg['ranks']} ranks (gloo)", "",
                  "| state | per rank | load ms | read_data ms | fixed ms (the rest) |",
                  "|---|--:|--:|--:|--:|"]
        for size, r in sorted(ranks.items(), key=lambda kv: int(kv[0])):
            load, read = r["load"], r["read_data"]
            lines.append(
                f"| {size} MiB | {r['bytes_per_rank'] / MiB:.0f} MiB | "
                f"{load['median_s'] * 1e3:.1f} ({load['min_s'] * 1e3:.1f}-"
                f"{load['max_s'] * 1e3:.1f}) | {read['median_s'] * 1e3:.1f} "
                f"({read['min_s'] * 1e3:.1f}-{read['max_s'] * 1e3:.1f}) | "
                f"{(load['median_s'] - read['median_s']) * 1e3:.1f} |")
        lines += ["", "`load`: rank 0's `dcpstore.load`; `read_data`: per run, the slowest "
                  "rank's time in the reader's part (fetch, checksum, decode, deliver). "
                  "The rest of the load is DCP's planning and its collectives, "
                  "`.metadata` and the manifest."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the variants; write ``results.json`` and ``results.md``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    p.add_argument("--runs", type=int, default=6, help="runs per variant (default 6)")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--ranks", type=int, default=2,
                   help="ranks of the multi-rank part (0: leave it out; default 2)")
    p.add_argument("--small", type=int, default=8,
                   help="the small state of the multi-rank part, MiB (default 8)")
    p.add_argument("--profile", action="store_true", help="also cProfile the dcpstore load")
    add_output_args(p, "load-profile", "results.md")
    args = p.parse_args(argv)
    started = start_results(args, "python -m benchmarks.load_profile", "load-profile",
                            render_markdown)
    if isinstance(started, int):
        return started
    out, checkout = started
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    import torch

    import dcpstore

    with tempfile.TemporaryDirectory(prefix="dcpstore-load-profile-") as tmp:
        state = layered_state(args.mib)
        nbytes = sum(t.nbytes for t in state.values())
        dcpstore.save(state, tmp)
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        variants = _variants(tmp, dest)
        for run in variants.values():  # warm the page cache and every code path
            run()
        orders = balanced_order(list(VARIANTS), args.runs, args.seed)
        seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for order in orders:
            for name in order:
                started = time.perf_counter()
                variants[name]()
                seconds[name].append(time.perf_counter() - started)
        if not all(torch.equal(dest[k], v) for k, v in state.items()):
            raise AssertionError("a load did not restore the saved state")
        profile = None
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(variants["dcpstore"])
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            profile = text.getvalue()
    ranks: dict[str, Any] = {}
    rank_profile = None
    if args.ranks > 1:
        for size, r in _ranks(args.ranks, [args.mib, args.small], args.runs,
                              args.profile).items():
            rank_profile = r.pop("profile") or rank_profile
            ranks[size] = {**r, "load": _summary(r["load_s"], r["bytes_per_rank"]),
                           "read_data": _summary(r["read_data_s"], r["bytes_per_rank"])}
    result = {"checkout": checkout, "machine": machine_info(), "command": sys.argv,
              "config": {"mib": args.mib, "runs": args.runs, "seed": args.seed,
                         "bytes": nbytes, "ranks": args.ranks, "small": args.small},
              "orders": orders, "seconds": seconds,
              "summary": {name: _summary(s, nbytes) for name, s in seconds.items()},
              "ranks": ranks}
    text = write_results(out, result, render_markdown)
    if profile is not None:
        (out / "profile.txt").write_text(profile)
    if rank_profile is not None:
        (out / "profile-ranks.txt").write_text(rank_profile)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
