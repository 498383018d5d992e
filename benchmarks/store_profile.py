"""Where an object-store save and load's time goes: one process, a stand-in server, CPU.

``python -m benchmarks.store_profile [--stores seaweedfs gcs] [--mib 256] [--runs 6]
[--msc] [--out DIR]``

On two cores the client and the stand-in server share the CPUs, so a save or load that
spends more CPU than the limit's client is slower by about that much (issue 33: S3 and
GCS below 0.9x their limits). For each store this benchmark saves and loads ``--mib``
MiB (the float32 layers of :mod:`benchmarks.load_profile`) in one process with
``dcpstore.save`` / ``dcpstore.load`` at their defaults, ``--runs`` times each in a
balanced random order (:func:`benchmarks.runner.balanced_order`), and reports per
operation:

- the wall time (median with min-max) and MB/s;
- the CPU it took, per GiB: this process's (``getrusage``: every thread, Python and
  native) and the server's (its processes' user + system time, from ``psutil``);
- where this process's CPU went: ``py-spy`` samples every thread (``--nonblocking``,
  on-CPU samples only) during ``--runs`` more of the same operation; the samples are put
  in buckets by the innermost frame (CRC32C, socket I/O, the event loop, botocore,
  dcpstore's own Python, ...), each bucket's share of the ``getrusage`` CPU is shown,
  and the innermost frames that took most are listed. Samples whose innermost frame is
  a wait (:data:`WAITING`) are counted apart: sampling without pausing the process can
  see a waiting thread as running. A native function (a ``memcpy``, the CRC32C
  library) shows as the Python line that called it.

With ``--msc``, each S3 store is also profiled through dcpstore's MSC backend
(``msc://<profile>/...``, the same profile as the throughput benchmark's ``dcpstore-msc``),
reported as ``<store> via msc``. moto runs in this process (threads), so its CPU is in
this process's figures, its "server CPU" is zero, and every sample taken in one of its
threads goes to its own bucket (:data:`IN_PROCESS_SERVER`), marked ``[server]`` among
the top frames.

The limits' CPU per GiB is in the throughput benchmark's results (``CPU s/GiB``), for the
same bytes on the same server. Results: ``results.json`` and ``results.md`` under
``--out``, with the commit they ran at (a dirty tree is refused for the committed results
tree unless ``--allow-dirty``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .env import (
    add_output_args,
    checkout_text,
    machine_info,
    start_results,
    write_results,
)
from .load_profile import layered_state
from .runner import balanced_order

__all__ = ["BUCKETS", "IN_PROCESS_SERVER", "SERVER_BUCKET", "bucket_of", "main"]

GiB = 1024 ** 3
OPS = ("save", "load")
#: Innermost frames of a thread that waits (a lock, a queue, a poll) but that
#: ``--nonblocking`` sampling may see as running: counted apart, not in the shares.
WAITING = r"Condition\.wait|Event\.wait|Queue\.get|_worker \(concurrent|do_poll|\.select \(|^$"
#: The bucket of an in-process server's samples (see :data:`IN_PROCESS_SERVER`).
SERVER_BUCKET = "moto server (in this process)"
#: (bucket, pattern matched against the innermost frame ``function (file:line)``), in
#: order: the first match names a sample's bucket; ``other`` takes the rest.
BUCKETS: tuple[tuple[str, str], ...] = (
    ("crc32c", r"crc32c|checksum"),
    ("tensor copy / serialization", r"torch/|serializ|codec\.py|numpy"),
    ("socket and TLS I/O", r"socket\.py|ssl\.py|recv_into|sendall|readinto|\(http/client"),
    ("event loop (asyncio, aiohttp)", r"asyncio/|aiohttp/|selectors\.py|yarl/|multidict/"),
    ("botocore (signing, parsing, requests)", r"botocore/|boto3/|urllib3/|s3transfer/"),
    ("gcsfs", r"gcsfs/"),
    (SERVER_BUCKET, r"moto/|werkzeug/|flask/|xmltodict|responses/"),
    ("multi-storage-client", r"multistorageclient/"),
    ("temporary files (the MSC backend's spool)", r"tempfile\.py|shutil\.py"),
    ("threads and queues", r"threading\.py|queue\.py|concurrent/futures"),
    ("dcpstore", r"dcpstore|dcpstore_\w+/"),
)
_FRAME = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


#: Frames of an in-process server's threads (moto's werkzeug server): a sample whose stack
#: has one is the server's CPU, whatever its innermost frame (its socket I/O, the
#: temporary files moto keeps objects in).
IN_PROCESS_SERVER = r"werkzeug/serving\.py|socketserver\.py|moto/"


def bucket_of(frame: str, stack: list[str] | None = None) -> str:
    """The bucket of one ``py-spy`` sample: its innermost frame (``function
    (file:line)``), or the in-process server's bucket when ``stack`` (every frame, outer
    first) runs in a server thread."""
    if stack is not None and any(re.search(IN_PROCESS_SERVER, f) for f in stack):
        return SERVER_BUCKET
    for name, pattern in BUCKETS:
        if re.search(pattern, frame):
            return name
    return "other"


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_servers() -> float:
    """User + system seconds of this process's children (the stand-in servers)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _sample(op: Callable[[], None], runs: int, rate: int, path: Path) -> dict[str, Any]:
    """Run ``op`` ``runs`` times under ``py-spy record`` of this process; the on-CPU
    samples by bucket and by innermost frame."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--format", "raw",
                             "--nonblocking", "--rate", str(rate), "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    for _ in range(runs):
        op()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if not path.exists():
        raise RuntimeError(f"py-spy wrote no samples: {err.decode(errors='replace')[-500:]}")
    buckets: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    waiting = 0
    for line in path.read_text().splitlines():
        m = _FRAME.match(line)
        if not m:
            continue
        frames = m["stack"].split(";")
        # the sampler's own idle loop (sleep before the first run) is not the operation
        if "_sample (" in frames[-1]:
            continue
        count = int(m["count"])
        if re.search(WAITING, frames[-1]):
            waiting += count
            continue
        bucket = bucket_of(frames[-1], frames)
        buckets[bucket] += count
        leaves[f"[server] {frames[-1]}" if bucket == SERVER_BUCKET else frames[-1]] += count
    total = sum(buckets.values())
    return {"rate": rate, "runs": runs, "samples": total, "waiting_samples": waiting,
            "buckets": dict(buckets.most_common()),
            "top": leaves.most_common(15)}


def _target(info: Any, via_msc: bool) -> tuple[str, dict[str, Any]]:
    """The URI and options a profile saves to: the store's own dcpstore backend, or
    dcpstore's MSC backend over the store's MSC profile."""
    if not via_msc:
        return info.uri("store-profile"), dict(info.options)
    return f"msc://{info.msc_profile}/store-profile", {"config": info.msc_config}


def _profile_store(info: Any, mib: int, runs: int, seed: int, rate: int,
                   workdir: Path, via_msc: bool = False) -> dict[str, Any]:
    import torch

    import dcpstore

    os.environ.update(info.env)
    uri, opts = _target(info, via_msc)
    label = f"{info.name}-msc" if via_msc else info.name
    state = layered_state(mib)
    nbytes = sum(t.nbytes for t in state.values())
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    ops: dict[str, Callable[[], None]] = {
        "save": lambda: dcpstore.save(state, uri, overwrite=True, **opts),
        "load": lambda: dcpstore.load(dest, uri, **opts),
    }
    for op in OPS:  # every code path and connection pool warm
        ops[op]()
    orders = balanced_order(list(OPS), runs, seed)
    wall: dict[str, list[float]] = {op: [] for op in OPS}
    cpu: dict[str, list[float]] = {op: [] for op in OPS}
    server: dict[str, list[float]] = {op: [] for op in OPS}
    for order in orders:
        for op in order:
            c0, s0, t0 = _cpu_self(), _cpu_servers(), time.perf_counter()
            ops[op]()
            wall[op].append(time.perf_counter() - t0)
            cpu[op].append(_cpu_self() - c0)
            server[op].append(_cpu_servers() - s0)
    if not all(torch.equal(dest[k], v) for k, v in state.items()):
        raise AssertionError(f"{label}: a load did not restore the saved state")
    out: dict[str, Any] = {"bytes": nbytes, "orders": orders, "ops": {}}
    for op in OPS:
        med = statistics.median(wall[op])
        out["ops"][op] = {
            "wall_s": wall[op], "cpu_s": cpu[op], "server_cpu_s": server[op],
            "median_s": med, "min_s": min(wall[op]), "max_s": max(wall[op]),
            "mbps": nbytes / med / 1e6,
            "cpu_s_per_gib": statistics.median(cpu[op]) / (nbytes / GiB),
            "server_cpu_s_per_gib": statistics.median(server[op]) / (nbytes / GiB),
            "profile": _sample(ops[op], runs, rate, workdir / f"{label}-{op}.txt"),
        }
    return out


def render_markdown(result: dict[str, Any]) -> str:
    """``results.md`` from ``results.json``."""
    cfg = result["config"]
    lines = [f"# Where an object-store save and load's time goes ({cfg['mib']} MiB, "
             "one process)", "",
             f"Ran at {checkout_text(result.get('checkout'))}; {cfg['runs']} runs per "
             f"operation in a balanced random order (seed {cfg['seed']}); median with "
             "min-max. MB = 10^6 bytes. CPU: this process (every thread) and the server's "
             "processes, per GiB moved, medians. `python -m benchmarks.store_profile "
             f"--stores {' '.join(cfg['stores'])} --mib {cfg['mib']} --runs {cfg['runs']}"
             f"{' --msc' if cfg.get('msc') else ''}`.",
             ""]
    for name, r in result["stores"].items():
        lines += [f"## {name}", "",
                  "| op | median s (min-max) | MB/s | client CPU s/GiB | server CPU s/GiB |",
                  "|---|--:|--:|--:|--:|"]
        for op, o in r["ops"].items():
            lines.append(f"| {op} | {o['median_s']:.3f} ({o['min_s']:.3f}-{o['max_s']:.3f})"
                         f" | {o['mbps']:.0f} | {o['cpu_s_per_gib']:.2f} | "
                         f"{o['server_cpu_s_per_gib']:.2f} |")
        for op, o in r["ops"].items():
            p = o["profile"]
            total = p["samples"] or 1
            lines += ["", f"### {name} {op}: where the client's CPU went "
                      f"({p['samples']} on-CPU samples at {p['rate']} Hz, {p['runs']} runs; "
                      f"{p['waiting_samples']} more in waits left out)", "",
                      "| bucket | share | about CPU s/GiB |", "|---|--:|--:|"]
            for bucket, n in p["buckets"].items():
                lines.append(f"| {bucket} | {100 * n / total:.0f}% | "
                             f"{o['cpu_s_per_gib'] * n / total:.2f} |")
            lines += ["", "Innermost frames that took most:", "",
                      "| frame | share |", "|---|--:|"]
            for frame, n in p["top"]:
                lines.append(f"| `{frame}` | {100 * n / total:.1f}% |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Profile each store; write ``results.json`` and ``results.md``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.store_profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", nargs="+", default=["seaweedfs", "gcs"],
                   choices=["seaweedfs", "moto", "gcs"])
    p.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    p.add_argument("--runs", type=int, default=6, help="runs per operation (default 6)")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--msc", action="store_true",
                   help="also profile each S3 store through dcpstore's MSC backend")
    add_output_args(p, "store-profile", "results.md")
    args = p.parse_args(argv)
    started = start_results(args, "python -m benchmarks.store_profile", "store-profile",
                            render_markdown)
    if isinstance(started, int):
        return started
    out, checkout = started
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    from .servers import Stores

    stores: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dcpstore-store-profile-") as tmp:
        for name in args.stores:  # one server at a time: its CPU is the server CPU
            with Stores([name], Path(tmp), count_requests=False) as running:
                info = running.info[name]
                stores[name] = _profile_store(info, args.mib, args.runs, args.seed,
                                              args.rate, Path(tmp))
                if args.msc and info.kind == "s3":
                    stores[f"{name} via msc"] = _profile_store(
                        info, args.mib, args.runs, args.seed, args.rate, Path(tmp),
                        via_msc=True)
    result = {"checkout": checkout, "machine": machine_info(), "command": sys.argv,
              "config": {"stores": args.stores, "mib": args.mib, "runs": args.runs,
                         "seed": args.seed, "rate": args.rate, "msc": args.msc},
              "stores": stores}
    text = write_results(out, result, render_markdown)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
