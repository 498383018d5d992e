"""What every system adapter is made of (:mod:`benchmarks.systems`,
:mod:`benchmarks.limits`, :mod:`benchmarks.stall_systems`): :class:`System`, the
:class:`OpContext` a rank runs it in, the :class:`Operation` it prepares, the
environment its clients get, and the syntax of a system's label (``name[variant]``).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .servers import StoreInfo
from .wire import BOTOCORE_SETTINGS, TLS_TRUST
from .workload import RankState, parse_size

__all__ = [
    "Grid",
    "OpContext",
    "Operation",
    "System",
    "environment",
    "options_variant",
    "parse_option_value",
    "parse_options_variant",
    "split_variant",
]

_MiB = 1 << 20
#: Options whose values are byte sizes (a label writes whole MiB as ``8MiB``).
_SIZE_KEYS = frozenset({"part_size", "block_size"})


class Grid(dict[str, tuple[Any, ...]]):
    """A peer's tuning grid: the options crossed with each other (the mapping itself),
    and the options tried one value at a time (:attr:`single`).

    The mapping compares equal to a plain dict of the crossed options, so the crossed
    grid reads as it always did. :func:`benchmarks.tuning.grid_points` adds, for every
    :attr:`single` value but its first, one point: the crossed grid's first point with
    that value. Every list of values starts with the library's default.

    Attributes:
        single: Option -> values (the default first) tried one at a time, on top of the
            crossed grid's first point (its defaults).
    """

    def __init__(self, crossed: dict[str, tuple[Any, ...]],
                 single: dict[str, tuple[Any, ...]] | None = None) -> None:
        super().__init__(crossed)
        self.single: dict[str, tuple[Any, ...]] = dict(single or {})


@dataclass
class OpContext:
    """Where and how one rank runs one operation.

    Attributes:
        store: The store (for counted runs: its proxy endpoint / MSC profile).
        path: Checkpoint prefix relative to the store root.
        rank: This rank.
        world_size: Ranks taking part.
        options: Options for the system (``--opt``).
        counted: Whether this is an untimed request-counting run.
    """

    store: StoreInfo
    path: str
    rank: int
    world_size: int
    options: dict[str, Any] = field(default_factory=dict)
    counted: bool = False


@dataclass
class Operation:
    """A prepared save or load.

    Attributes:
        run: The timed part; returns system-specific figures.
        verify: Untimed check after a load (``None``: the harness compares the
            destination state with the expected one).
        close: Untimed clean-up (thread pools, sessions).
    """

    run: Callable[[], dict[str, Any]]
    verify: Callable[[], bool] | None = None
    close: Callable[[], None] | None = None


def environment(ctx: OpContext) -> dict[str, str]:
    """Variables every client gets for this store (credentials, MSC config)."""
    env = dict(ctx.store.env)
    if ctx.store.kind == "s3" and ctx.store.endpoint_url:
        env["AWS_ENDPOINT_URL"] = ctx.store.endpoint_url  # read by s3torchconnector's CRT
    if ctx.store.msc_config:
        env["MSC_CONFIG"] = ctx.store.msc_config
    env.setdefault("NO_PROXY", "127.0.0.1,localhost")
    return env


class System:
    """A system under test. Subclasses set the class attributes and the two hooks."""

    #: Name on the command line and in the results.
    name: ClassVar[str] = ""
    #: Store kinds it runs on (``local``, ``s3``, ``gcs``).
    kinds: ClassVar[tuple[str, ...]] = ()
    #: Modules it needs (a missing one skips the system, with the reason).
    requires: ClassVar[tuple[str, ...]] = ()
    #: A raw-I/O limit rather than a DCP system.
    is_limit: ClassVar[bool] = False
    #: One of dcpstore's own.
    is_dcpstore: ClassVar[bool] = False
    #: One line for the report.
    description: ClassVar[str] = ""
    #: Tuning grid of a peer: option -> values tried (their cross product), a
    #: :class:`Grid` where some options are tried one at a time; empty for dcpstore (run
    #: at its defaults) and the limits (which have variants instead).
    grid: ClassVar[dict[str, tuple[Any, ...]]] = {}
    #: The grid options its reader uses (the others only change the save).
    reader_keys: ClassVar[frozenset[str]] = frozenset()
    #: The library's defaults of the grid options (a tuned best equal to them is not
    #: run twice).
    defaults: ClassVar[dict[str, Any]] = {}
    #: Its client stack, a key of :data:`TLS_TRUST` (``""``: no HTTP, the local store).
    client_stack: ClassVar[str] = ""

    def __init__(self, variant: str = "") -> None:
        self.variant = variant

    def settings(self) -> dict[str, str]:
        """Payload signing and checksum settings of its requests (``{}``: not HTTP)."""
        return dict(BOTOCORE_SETTINGS) if "s3" in self.kinds else {}

    def tls_trust(self) -> str | None:
        """How the ``--tls`` CA reaches its client (``None``: it makes no HTTP
        requests)."""
        return TLS_TRUST[self.client_stack] if self.client_stack else None

    def variant_options(self) -> dict[str, Any]:
        """Options its bracket names (``[thread_count=4,part_size=8MiB]``); ``{}`` for
        ``[best]`` (resolved by the runner) and for no bracket."""
        if self.variant in ("", "best"):
            return {}
        return parse_options_variant(self.variant)

    @property
    def label(self) -> str:
        """Name with variant, e.g. ``limit-s3[64MiBx8]``."""
        return f"{self.name}[{self.variant}]" if self.variant else self.name

    def unavailable(self) -> str | None:
        """Why the system cannot run here (a missing package), or ``None``."""
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return f"python module {module!r} is not installed"
        return None

    def prepare_save(self, ctx: OpContext, state: RankState) -> Operation:
        """Build what the save needs; return it ready to run."""
        raise NotImplementedError

    def prepare_load(self, ctx: OpContext, state: RankState) -> Operation:
        """Build what the load needs (the destination is zeroed); return it ready."""
        raise NotImplementedError


# -- labels ------------------------------------------------------------------------------


def parse_options_variant(variant: str) -> dict[str, Any]:
    """``"thread_count=4,part_size=8MiB"`` -> ``{"thread_count": 4, "part_size": 8 MiB}``.

    Raises:
        ValueError: Not ``KEY=VALUE`` pairs separated by commas.
    """
    out: dict[str, Any] = {}
    for item in variant.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad system variant {variant!r} (use best or "
                             "KEY=VALUE,KEY=VALUE)")
        out[key.strip()] = parse_option_value(value.strip())
    return out


def options_variant(options: dict[str, Any]) -> str:
    """The inverse of :func:`parse_options_variant` (sizes of whole MiB as ``8MiB``)."""
    def text(key: str, v: Any) -> str:
        if key in _SIZE_KEYS and isinstance(v, int) and v % _MiB == 0:
            return f"{v // _MiB}MiB"
        return str(v)

    return ",".join(f"{k}={text(k, v)}" for k, v in sorted(options.items()))


def parse_option_value(text: str) -> Any:
    """``"true"`` / ``"none"`` / ``"4"`` / ``"0.5"`` / ``"8MiB"`` / anything else as text."""
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float, parse_size):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def split_variant(label: str) -> tuple[str, str]:
    """``"limit-s3[64MiBx8]"`` -> ``("limit-s3", "64MiBx8")``; no bracket -> ``(label, "")``."""
    m = re.fullmatch(r"([^\[\]]+)(?:\[([^\[\]]*)\])?", label)
    if m is None:
        raise ValueError(f"bad system name {label!r}")
    return m.group(1), m.group(2) or ""
