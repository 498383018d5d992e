"""Process-mode overhead, A/B: durable seconds of ``Checkpointer(async_mode="process")``
(and ``"thread"``) against a blocking save of the same state to the same store.

The stall suite measures the same ratio inside a training loop, where on a shared
2-core machine the background write also competes with other jobs whose load changes
from one case to the next. Here the three modes alternate save by save in one process
(orders rotated every round), so a change of load hits all of them alike, and there
is no compute step: what is left is what process mode itself costs (the snapshot copy,
the hand-over to the background process, the commit in the parent).

One process, no ``torch.distributed`` (process mode does not need it)::

    python -m benchmarks.process_ab --store local --mib 512 --rounds 8
    python -m benchmarks.process_ab --store seaweedfs --mib 512 --rounds 6 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["main"]

MODES = ("blocking", "thread", "process")


@contextlib.contextmanager
def _root(store: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if store == "local":
        base = tempfile.mkdtemp(prefix="dcpstore-ab-")
        try:
            yield base, {}
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    from dcpstore.testing.servers import seaweedfs_server

    with seaweedfs_server(bucket="dcpstore-ab") as server:
        os.environ.update(server.env())
        os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
        yield "s3://dcpstore-ab", {"endpoint_url": server.endpoint_url,
                                   "unsigned_payload": True}


def main(argv: list[str] | None = None) -> int:
    """Run the A/B rounds; print and (with ``--out``) write the figures."""
    import dcpstore

    p = argparse.ArgumentParser(prog="python -m benchmarks.process_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", choices=("local", "seaweedfs"), default="local")
    p.add_argument("--mib", type=int, default=512, help="state size (MiB, 16 tensors)")
    p.add_argument("--rounds", type=int, default=8, help="saves per mode (after 1 warm-up)")
    p.add_argument("--out", type=Path, help="write results.json here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    numel = args.mib * (1 << 20) // 4 // 16
    state = {f"w{i}": torch.randn(numel) for i in range(16)}
    load_start = os.getloadavg()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    with _root(args.store) as (root, options):
        ckpts = {m: dcpstore.Checkpointer(f"{root}/{m}", keep_last=1,
                                          async_mode=None if m == "blocking" else m,  # type: ignore[arg-type]
                                          **options) for m in MODES}
        try:
            for rnd in range(args.rounds + 1):
                order = MODES[rnd % 3:] + MODES[:rnd % 3]
                for mode in order:
                    ckpt = ckpts[mode]
                    for t in state.values():  # a new value per save, as after a step
                        t.add_(1.0)
                    t0 = time.perf_counter()
                    ckpt.save(rnd, state)
                    ckpt.wait()
                    if rnd:  # round 0 warms up (process start, client, arena)
                        times[mode].append(time.perf_counter() - t0)
        finally:
            for ckpt in ckpts.values():
                ckpt.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    ratios = {m: statistics.median(a / b for a, b in zip(times[m], times["blocking"],
                                                          strict=True))
              for m in ("thread", "process")}
    result = {"store": args.store, "mib": args.mib, "rounds": args.rounds,
              "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "seconds": times, "median_s": med, "median_ratio_to_blocking": ratios}
    print(f"{args.store}, {args.mib} MiB, {args.rounds} rounds (load average "
          f"{load_start[0]:.1f} -> {os.getloadavg()[0]:.1f})")
    for m in MODES:
        extra = f"  {ratios[m]:.2f}x blocking (median of per-round ratios)" \
            if m in ratios else ""
        print(f"  {m:<8} durable median {med[m]:.3f} s  [{min(times[m]):.3f}-"
              f"{max(times[m]):.3f}]{extra}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"process_ab-{args.store}.json").write_text(
            json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
