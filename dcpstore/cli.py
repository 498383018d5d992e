"""The ``dcpstore`` command line (also ``python -m dcpstore``).

Errors print one line on stderr and exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    echo = (lambda *_a, **_k: None) if args.quiet or args.json else print
    result = run_demo(args.uri, world_size=args.ranks, width=args.width, echo=echo,
                      **dict(args.option))
    if args.json:
        print(json.dumps(result.__dict__))
    return 0 if result.bit_exact else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dcpstore`` command."""
    parser = argparse.ArgumentParser(
        prog="dcpstore",
        description="Inspect, verify, copy and clean PyTorch DCP checkpoints on any store.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--quiet", "-q", action="store_true", help="print only errors")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train on 2 CPU ranks, save, reload at 1 rank, verify")
    demo.add_argument("--uri", help="where to save (default: a temporary directory)")
    demo.add_argument("--ranks", type=int, default=2, help="ranks that train and save")
    demo.add_argument("--width", type=int, default=512, help="hidden size of the model")
    demo.add_argument("-o", "--option", type=_parse_option, action="append", default=[],
                      metavar="KEY=VALUE", help="writer/reader/backend option (repeatable)")
    demo.set_defaults(func=_cmd_demo)
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
