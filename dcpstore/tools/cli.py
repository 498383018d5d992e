"""The ``dcpstore`` command line (also ``python -m dcpstore``).

Errors print one line on stderr and exit non-zero; ``--debug`` shows the traceback.
Output into a pipe that closes early (``dcpstore inspect URI | head``) ends the command
quietly with status 141, as SIGPIPE ends a Unix tool. Progress bars need ``tqdm``
(``pip install 'dcpstore[cli]'``).

This module imports the standard library only; each command imports what it needs when
it runs, so ``dcpstore --help`` does not import torch (``tests/test_cli_startup.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

__all__ = ["main"]

logger = logging.getLogger(__name__)

#: Exit status of a command whose stdout pipe closed early (128 + SIGPIPE), like a
#: Unix tool killed by SIGPIPE.
EXIT_BROKEN_PIPE = 141


class _StdoutClosed(Exception):
    """Whoever read our stdout has gone (``| head``)."""


def _out(text: str) -> None:
    """Print ``text`` to stdout; a closed pipe becomes :class:`_StdoutClosed`."""
    try:
        print(text, flush=True)
    except BrokenPipeError as exc:
        raise _StdoutClosed from exc


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``1.5 KiB``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return "\n".join(lines)


def _wants_progress(args: argparse.Namespace) -> bool:
    """``--progress`` / ``--no-progress`` if given; otherwise not with ``--json``/``-q``."""
    asked = getattr(args, "progress", None)
    if asked is not None:
        return bool(asked)
    return not (args.quiet or args.json)


@contextlib.contextmanager
def _progress(args: argparse.Namespace, total: int | None, desc: str) -> Iterator[Any]:
    if not _wants_progress(args):
        yield lambda n: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        if getattr(args, "progress", None):
            raise ImportError(
                "--progress needs tqdm: pip install 'dcpstore[cli]' (or pip install tqdm)"
            ) from None
        logger.debug("tqdm is not installed: no progress bar")
        yield lambda n: None
        return

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
               file=sys.stderr, dynamic_ncols=True, leave=True)
    lock = threading.Lock()

    def update(n: int) -> None:
        with lock:
            bar.update(n)

    try:
        yield update
    finally:
        bar.close()


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        _out(json.dumps(data, indent=2, default=str))
    elif not args.quiet and text:
        _out(text)


def _cmd_ls(args: argparse.Namespace) -> int:
    from dcpstore.tools.ops import list_checkpoints, list_checkpoints_tiered

    tiered = args.local_tier is not None
    found = (list_checkpoints_tiered(args.uri, args.local_tier, **dict(args.option)) if tiered
             else list_checkpoints(args.uri, **dict(args.option)))
    rows = [[c.path, "committed" if c.committed else "retired" if c.retired else "INCOMPLETE",
             "-" if c.step is None else str(c.step), human_bytes(c.size), str(c.files),
             "-" if c.world_size is None else str(c.world_size), _when(c.mtime)]
            + ([c.where or "-"] if tiered else []) for c in found]
    headers = ["CHECKPOINT", "STATE", "STEP", "SIZE", "FILES", "RANKS", "DATE"]
    text = (_table(rows, headers + (["WHERE"] if tiered else []))
            if rows else f"no checkpoints under {args.uri}")
    _emit(args, [c.__dict__ for c in found], text)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from dcpstore.tools.ops import inspect_checkpoint

    info = inspect_checkpoint(args.uri, **dict(args.option))
    rows = [[k["key"], k["kind"] if k["dtype"] is None else k["dtype"],
             "-" if k["shape"] is None else "x".join(map(str, k["shape"])) or "scalar",
             human_bytes(k["bytes"]), str(k["chunks"]), str(k["ranks"])] for k in info["keys"]]
    files = [[name, human_bytes(size)] for name, size in info["files"].items()]
    text = "\n".join([
        f"checkpoint  {info['uri']}",
        f"save id     {info['save_id']}",
        f"world size  {info['world_size']}",
        f"written by  dcpstore {info['dcpstore_version'] or '-'}, torch "
        f"{info['torch_version'] or '-'}  {_when(info['created'])}",
        f"tensors     {human_bytes(info['tensor_bytes'])} in {len(info['keys'])} keys; "
        f"{human_bytes(info['stored_bytes'])} stored in {len(files)} files",
        f"written     {human_bytes(info['stored_bytes'])} by this save; "
        f"{human_bytes(info['referenced_bytes'])} referenced in "
        f"{len(info['referenced_files'])} files of earlier steps",
        "",
        _table(rows, ["KEY", "DTYPE", "SHAPE", "BYTES", "CHUNKS", "RANKS"]),
        "",
        _table(files, ["FILE", "SIZE"]),
    ])
    _emit(args, info, text)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from dcpstore.tools.ops import inspect_checkpoint, verify_checkpoint

    info = inspect_checkpoint(args.uri, **dict(args.option))
    total = info["stored_bytes"] + sum(info["referenced_files"].values())
    with _progress(args, total, "verify") as update:
        report = verify_checkpoint(args.uri, progress=update, concurrency=args.concurrency,
                                   **dict(args.option))
    rate = report.bytes / report.seconds if report.seconds else 0.0
    lines = [f"{'OK' if report.ok else 'FAILED'}: {report.files} files, {report.items} items, "
             f"{human_bytes(report.bytes)} in {report.seconds:.2f} s ({human_bytes(rate)}/s)"]
    if not report.has_manifest:
        lines.append("note: no dcpstore manifest (written by another writer): sizes and "
                     "readability checked, not CRC32C")
    for err in report.errors:
        print(f"dcpstore: mismatch: {err}", file=sys.stderr)
    _emit(args, {**report.__dict__, "ok": report.ok}, "\n".join(lines))
    return 0 if report.ok else 2


def _cmd_cp(args: argparse.Namespace) -> int:
    from dcpstore.tools.ops import copy_checkpoint, inspect_checkpoint

    info = inspect_checkpoint(args.src)
    total = info["stored_bytes"] + (0 if args.keep_references
                                    else sum(info["referenced_files"].values()))
    started = time.perf_counter()
    with _progress(args, total, "copy") as update:
        copied = copy_checkpoint(args.src, args.dst, progress=update,
                                 concurrency=args.concurrency, overwrite=args.overwrite,
                                 keep_references=args.keep_references)
    secs = time.perf_counter() - started
    _emit(args, {"src": args.src, "dst": args.dst, "bytes": copied, "seconds": secs},
          f"copied {human_bytes(copied)} from {args.src} to {args.dst} in {secs:.2f} s "
          f"({human_bytes(copied / secs if secs else 0)}/s); .metadata committed last")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from dcpstore.tools.ops import remove_checkpoint

    keys = remove_checkpoint(args.uri, dry_run=args.dry_run, **dict(args.option))
    verb = "would delete" if args.dry_run else "deleted"
    _emit(args, {"uri": args.uri, "dry_run": args.dry_run, "deleted": keys},
          f"{verb} {len(keys)} objects of {args.uri} (.metadata first)")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from dcpstore.tools.ops import gc

    report = gc(args.root, dry_run=args.dry_run, min_age=args.min_age, **dict(args.option))
    verb, abort = ("would remove", "abort") if args.dry_run else ("removed", "aborted")
    lines = [f"{verb} {len(report.objects)} objects ({human_bytes(report.bytes)}) and {abort} "
             f"{len(report.uploads)} dangling multipart uploads under {args.root}"]
    lines += [f"  {k}" for k in report.objects[:50]]
    _emit(args, {"dry_run": args.dry_run, "objects": report.objects, "bytes": report.bytes,
                 "uploads": [list(u) for u in report.uploads]}, "\n".join(lines))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dcpstore.training.weights import export

    started = time.perf_counter()
    n = export(args.uri, args.dest, args.format, **dict(args.option))
    secs = time.perf_counter() - started
    _emit(args, {"uri": args.uri, "dest": args.dest, "format": args.format, "bytes": n},
          f"exported {human_bytes(n)} to {args.dest} ({args.format}) in {secs:.2f} s")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from dcpstore.dcp.api import load, save

    count = max(1, args.tensors)
    per = max(1, args.size_mb * 1024 * 1024 // 4 // count)
    state = {f"t{i}": torch.randn(per) for i in range(count)}
    nbytes = per * 4 * count
    uri = args.uri.rstrip("/") + f"/dcpstore-bench-{int(time.time())}"
    t0 = time.perf_counter()
    save(state, uri, **dict(args.option))
    t1 = time.perf_counter()
    out = {k: torch.empty_like(v) for k, v in state.items()}
    load(out, uri, **dict(args.option))
    t2 = time.perf_counter()
    ok = all(torch.equal(out[k], state[k]) for k in state)
    from dcpstore.tools.ops import remove_checkpoint

    remove_checkpoint(uri, **dict(args.option))
    result = {"uri": uri, "bytes": nbytes, "save_s": t1 - t0, "load_s": t2 - t1,
              "save_mb_s": nbytes / 1e6 / (t1 - t0), "load_mb_s": nbytes / 1e6 / (t2 - t1),
              "bit_exact": ok}
    _emit(args, result, f"{human_bytes(nbytes)} in {count} tensors at {args.uri}: save "
          f"{result['save_mb_s']:.0f} MB/s, load {result['load_mb_s']:.0f} MB/s, "
          f"{'bit-exact' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from dcpstore.tools.demo import run_demo

    def echo(*parts: Any, **_kwargs: Any) -> None:
        if not (args.quiet or args.json):
            _out(" ".join(str(p) for p in parts))

    result = run_demo(args.uri, world_size=args.ranks, width=args.width, echo=echo,
                      **dict(args.option))
    if args.json:
        _out(json.dumps(result.__dict__))
    return 0 if result.bit_exact else 1


def _global_flags(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show tracebacks and debug logs")
    parser.add_argument("--quiet", "-q", action="store_true", default=default,
                        help="print only errors")
    parser.add_argument("--json", action="store_true", default=default,
                        help="machine-readable output (no progress bar unless --progress)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction,
                        default=None if default is False else default,
                        help="show (or hide) the progress bar on stderr (default: shown "
                        "unless --json or --quiet; needs tqdm)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dcpstore`` command."""
    parser = argparse.ArgumentParser(
        prog="dcpstore",
        description="Inspect, verify, copy and clean PyTorch DCP checkpoints on any store.",
    )
    _global_flags(parser, default=False)
    # the same flags after the command name (dcpstore verify URI --json)
    common = argparse.ArgumentParser(add_help=False)
    _global_flags(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", parents=[common],
                          help="train on 2 CPU ranks, save, reload at 1 rank, verify")
    demo.add_argument("--uri", help="where to save (default: a temporary directory)")
    demo.add_argument("--ranks", type=int, default=2, help="ranks that train and save")
    demo.add_argument("--width", type=int, default=512, help="hidden size of the model")
    demo.add_argument("-o", "--option", type=_parse_option, action="append", default=[],
                      metavar="KEY=VALUE", help="writer/reader/backend option (repeatable)")
    demo.set_defaults(func=_cmd_demo)

    def add(name: str, help_: str, func: Any, *positionals: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, parents=[common])
        for pos in positionals:
            p.add_argument(pos)
        p.add_argument("-o", "--option", type=_parse_option, action="append", default=[],
                       metavar="KEY=VALUE", help="backend option (repeatable)")
        p.set_defaults(func=func)
        return p

    p = add("ls", "list checkpoints (committed or incomplete) under a root", _cmd_ls, "uri")
    p.add_argument("--local-tier", metavar="DIR", default=None,
                   help="a Checkpointer's local tier: also list it and show WHERE each step "
                        "is committed (local, remote, both)")
    add("inspect", "keys, dtypes, shapes, sharding and files of a checkpoint", _cmd_inspect,
        "uri")
    p = add("verify", "re-read every data file and check CRC32C", _cmd_verify, "uri")
    p.add_argument("--concurrency", type=int, default=4, help="files checked at once")
    p = add("cp", "copy a checkpoint between any two backends", _cmd_cp, "src", "dst")
    p.add_argument("--concurrency", type=int, default=4, help="files copied at once")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    p.add_argument("--keep-references", action="store_true",
                   help="copy only the files this step wrote and keep its references into "
                        "earlier steps (they must exist next to DST); default: a "
                        "self-contained copy")
    p = add("rm", "delete a checkpoint (.metadata first)", _cmd_rm, "uri")
    p.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    p = add("gc", "remove incomplete saves, unreferenced files, dangling uploads", _cmd_gc,
            "root")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--min-age", type=float, default=3600.0,
                   help="leave files younger than this many seconds (saves in progress)")
    p = add("export", "consolidate a checkpoint into one file", _cmd_export, "uri", "dest")
    p.add_argument("--format", choices=["torch", "safetensors"], default="torch")
    p = add("bench", "quick save/load throughput check against a URI", _cmd_bench, "uri")
    p.add_argument("--size-mb", type=int, default=256, help="total size of the state")
    p.add_argument("--tensors", type=int, default=16, help="number of tensors")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except _StdoutClosed:
        # what is still buffered for stdout goes nowhere instead of failing at exit
        with contextlib.suppress(OSError, ValueError):  # no real file: nothing to redirect
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("dcpstore: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"dcpstore: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
