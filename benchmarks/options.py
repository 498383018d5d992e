"""The ``--opt`` options of the throughput run and the curves: ``[SCOPE.]KEY=VALUE``
scoped by system (:func:`parse_opts`), what a system's operation gets of them
(:func:`options_for`), and the ``(full, quick)`` defaults of a suite's options
(:func:`fill_defaults`).
"""

from __future__ import annotations

import argparse
from typing import Any

from . import systems

__all__ = ["ALL_LIMITS", "fill_defaults", "options_for", "parse_opts"]

#: Every limit variant (``--all-limits``): the defaults plus those that never led.
ALL_LIMITS = {
    "limit_s3": ["64MiBx8", "32MiBx8", "16MiBx16", "objects-16MiBx8", "objects-32MiBx8",
                 "objects-8MiBx16", "transfer-32MiBx8", "crt-32MiBx8"],
    "limit_gcs": ["32MiBx8", "16MiBx16"],
    "limit_local": ["dd", "wb16MiBx2", "direct16MiBx4"],
}
_BACKEND_SCOPES = {"file": "dcpstore-local", "local": "dcpstore-local", "s3": "dcpstore-s3",
                   "gs": "dcpstore-gcs", "gcs": "dcpstore-gcs", "msc": "dcpstore-msc"}
#: Scopes naming a peer whose own name is taken by a dcpstore backend scope ("msc").
_PEER_SCOPES = {"multistorageclient": "msc"}


def fill_defaults(args: argparse.Namespace, defaults: dict[str, tuple[Any, Any]]) -> None:
    """Set each option left unset to its ``(full, quick)`` default, and ``args.mode``
    (``--all-limits``: every limit variant not given explicitly)."""
    if getattr(args, "all_limits", False):
        for name, variants in ALL_LIMITS.items():
            if getattr(args, name) is None:
                setattr(args, name, list(variants))
    for name, pair in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, pair[1 if args.quick else 0])
    args.mode = "quick" if args.quick else "full"


def parse_opts(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["s3.part_size=64MiB", "x=1"]`` -> ``{"dcpstore-s3": {...}, "dcpstore": {...}}``."""
    scoped: dict[str, dict[str, Any]] = {}
    known = set(systems.names())
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--opt {item!r}: use [SCOPE.]KEY=VALUE")
        scope, dot, name = key.rpartition(".")
        scope = scope if dot else "dcpstore"
        scope = _PEER_SCOPES.get(scope, _BACKEND_SCOPES.get(scope, scope))
        if scope != "dcpstore" and scope not in known:
            raise ValueError(f"--opt {item!r}: unknown scope {scope!r} (a system name, a "
                             f"dcpstore backend {sorted(_BACKEND_SCOPES)} or 'dcpstore')")
        scoped.setdefault(scope, {})[name] = systems.parse_option_value(value)
    return scoped


def options_for(scoped: dict[str, dict[str, Any]], label: str, op: str = "save",
                tuned: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Options for a system's ``op``: the ``dcpstore`` scope (dcpstore systems), then its
    own scope, then its bracket (``[thread_count=4]``, or for ``[best]`` the options the
    tuning picked for ``op``: ``tuned[name][op]["options"]``)."""
    name, variant = systems.split_variant(label)
    system = systems.get(label)
    opts: dict[str, Any] = {}
    if system.is_dcpstore:
        opts.update(scoped.get("dcpstore", {}))
    opts.update(scoped.get(name, {}))
    if variant == "best":
        opts.update(((tuned or {}).get(name, {}).get(op) or {}).get("options") or {})
    elif not system.is_limit:
        opts.update(system.variant_options())
    return opts
