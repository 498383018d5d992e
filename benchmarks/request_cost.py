"""``python -m benchmarks.request_cost``: what one S3 request costs the client's CPU.

On a machine where the store and the ranks share the cores (this benchmark's SeaweedFS
on 2 cores), every CPU second a client spends is a second the store does not get, so a
load's throughput follows its client CPU per byte. This measures the fixed parts of it,
one thread, against a SeaweedFS started on 127.0.0.1:

- making a botocore S3 client (what a backend paid on every ``save`` / ``load`` before
  backends shared one, :mod:`dcpstore.storage.clients`);
- one ``GET`` through dcpstore's S3 backend (``read_ranges`` of one range: its
  retries, concurrency gate and the request) and through a
  plain boto3 client with the same settings (the limit's client), for a 1-byte and a
  1 MiB object: the difference between the two sizes is the bytes, the rest is the
  request.

CPU seconds of the calling thread (``time.thread_time``), the median of ``--rounds``
rounds of ``--requests`` requests each.

Example::

    python -m benchmarks.request_cost --out benchmarks/results/request-cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

if TYPE_CHECKING:
    from dcpstore.testing.servers import S3Server

__all__ = ["main"]

_MiB = 1024 * 1024


def _cpu_ms(fn: Callable[[], Any], count: int, rounds: int) -> float:
    """Median over ``rounds`` of the CPU milliseconds per call of ``fn``."""
    fn()  # warm: connection, caches
    per = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(count):
            fn()
        per.append((time.thread_time() - start) / count * 1000)
    return statistics.median(per)


def measure(server: S3Server, bucket: str, requests: int, rounds: int) -> dict[str, Any]:
    """Measure against a running S3 server; the figures in milliseconds of CPU.

    Args:
        server: The server (its credentials are in ``os.environ`` while this runs, as a
            rank's are).
        bucket: An existing bucket on it; the objects go under ``request-cost/``.
        requests: Requests per round.
        rounds: Rounds; the median round is reported.
    """
    with mock.patch.dict(os.environ, server.env()):
        return _measure(server, bucket, requests, rounds)


def _measure(server: S3Server, bucket: str, requests: int, rounds: int) -> dict[str, Any]:
    import boto3

    import dcpstore
    from dcpstore.storage.backend import ReadRange

    from .wire import botocore_path_config

    out: dict[str, Any] = {"requests": requests, "rounds": rounds}
    backend = dcpstore.open_backend(
        f"s3://{bucket}/request-cost", endpoint_url=server.endpoint_url, addressing_style="path"
    )
    client = boto3.session.Session().client(
        "s3", endpoint_url=server.endpoint_url, region_name=server.region,
        config=botocore_path_config(),
    )
    try:
        out["make_client_ms"] = _cpu_ms(backend.store.connect, 5, rounds)
        for size, name in ((1, "1B"), (_MiB, "1MiB")):
            backend.put(f"obj{size}", b"x" * size)
            view = memoryview(bytearray(size))

            def dcpstore_get(size: int = size, view: memoryview = view) -> None:
                list(backend.read_ranges([ReadRange(f"obj{size}", 0, size)], [view]))

            def boto3_get(size: int = size, view: memoryview = view) -> None:
                body = client.get_object(
                    Bucket=bucket, Key=f"request-cost/obj{size}", Range=f"bytes=0-{size - 1}"
                )["Body"]
                body.readinto(view)
                body.close()

            out[f"get_{name}_dcpstore_ms"] = _cpu_ms(dcpstore_get, requests, rounds)
            out[f"get_{name}_boto3_ms"] = _cpu_ms(boto3_get, requests, rounds)
    finally:
        client.close()
        backend.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure and print (and write ``results.json`` under ``--out``)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.request_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--requests", type=int, default=50, help="requests per round (50)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (5)")
    p.add_argument("--out", default=None, help="directory for results.json")
    p.add_argument("--allow-dirty", action="store_true",
                   help="write results into benchmarks/results from a tree with uncommitted "
                        "changes (the results then record the diff's SHA-256)")
    args = p.parse_args(argv)
    from dcpstore.testing.servers import seaweedfs_server

    from .env import DirtyTree, machine_info, run_checkout

    try:
        checkout = run_checkout(Path(args.out) if args.out else None, args.allow_dirty)
    except DirtyTree as exc:
        print(f"python -m benchmarks.request_cost: refusing to run: {exc}", file=sys.stderr)
        return 2
    with seaweedfs_server(bucket="request-cost") as server:
        figures = measure(server, "request-cost", args.requests, args.rounds)
    result = {"machine": machine_info(), "checkout": checkout, **figures}
    for key, value in result.items():
        if key.endswith("_ms"):
            print(f"{key:28s} {value:7.2f} ms CPU")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
