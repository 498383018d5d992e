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

``--profile`` adds a ``cProfile`` of the ``dcpstore`` variant (``profile.txt``: the main
thread; the reads run on the backend's worker threads). Results: ``results.json`` and
``results.md`` under ``--out``, with the commit they ran at (a dirty tree is refused for
the committed results tree unless ``--allow-dirty``).
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .env import (
    DirtyTree,
    add_output_args,
    checkout_text,
    default_out,
    machine_info,
    run_checkout,
)
from .runner import balanced_order

__all__ = ["VARIANTS", "main"]

MiB = 1024 * 1024
VARIANTS = ("dcpstore", "dcpstore-crc-after", "dcpstore-unverified", "raw-preadv",
            "crc-pass")


def _state(mib: int) -> dict[str, Any]:
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
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the variants; write ``results.json`` and ``results.md``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    p.add_argument("--runs", type=int, default=6, help="runs per variant (default 6)")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--profile", action="store_true", help="also cProfile the dcpstore load")
    add_output_args(p, "load-profile", "results.md")
    args = p.parse_args(argv)
    if args.render:
        result = json.loads((args.render / "results.json").read_text())
        (args.render / "results.md").write_text(render_markdown(result))
        return 0
    out: Path = args.out or default_out("load-profile")
    try:
        checkout = run_checkout(out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"python -m benchmarks.load_profile: refusing to run: {exc}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    import torch

    import dcpstore

    with tempfile.TemporaryDirectory(prefix="dcpstore-load-profile-") as tmp:
        state = _state(args.mib)
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
    result = {"checkout": checkout, "machine": machine_info(), "command": sys.argv,
              "config": {"mib": args.mib, "runs": args.runs, "seed": args.seed,
                         "bytes": nbytes},
              "orders": orders, "seconds": seconds,
              "summary": {name: _summary(s, nbytes) for name, s in seconds.items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(render_markdown(result))
    if profile is not None:
        (out / "profile.txt").write_text(profile)
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
