"""Option declarations and resolution.

Backend options: keyword > URI query > ``DCPSTORE_<BACKEND>_<OPTION>`` env > default.
Writer and reader options: keyword > URI query > default (the environment applies to
backend options only).

Options are declared as dataclass fields (:class:`WriterOptions`, :class:`ReaderOptions`
and each backend's ``Options`` class). Values from the query string and the environment
arrive as strings and are converted to the field's declared type.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "AUTO_MAX_FILES",
    "ReaderOptions",
    "WriterOptions",
    "coerce",
    "env_prefix",
    "option_names",
    "option_values",
    "resolve_options",
]

T = TypeVar("T")

#: Most data files per rank the automatic layout (``files_per_rank=None``) makes: it
#: bounds the objects (and requests) of a save and the manifest's size for a large rank;
#: past it the files grow beyond the backend's preferred object size.
AUTO_MAX_FILES = 128

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class WriterOptions:
    """Options of :class:`~dcpstore.Writer` (backend options are separate).

    Attributes:
        overwrite: Replace an existing committed checkpoint at the URI (atomically: the
            old one stays loadable until the new ``.metadata`` lands). When false, an
            existing checkpoint is refused before any rank writes.
        files_per_rank: Data files each rank writes, concurrently. Items are spread
            over them by size; with one file they keep the save plan's order.
            ``None`` (default; also ``"auto"`` in a URI query): the backend decides. A
            backend with a preferred object size
            (:meth:`~dcpstore.Backend.preferred_object_size`: S3 and GCS, which then
            store every file with one request and read it back with one) gets files of
            at most about that size, up to :data:`AUTO_MAX_FILES` per rank, written by
            at most ``max_concurrency`` threads; one without (local disk) gets one file.
        sharding_guard: Refuse per-rank state saved as plain tensors (see
            :mod:`dcpstore.dcp.guard`).
        base: URI of an earlier committed checkpoint under the same run root (a sibling
            directory): an incremental save. Tensor payloads whose size, dtype, shape and
            XXH3-128 content hash equal the base's are not written again; ``.metadata``
            references the base's bytes (``../step-000000100/__0_0.<save>.distcp``).
        base_required: With ``base``: a base that is not a committed checkpoint when the
            save starts is an error. ``False``: save everything instead (the
            :class:`~dcpstore.Checkpointer` uses this, as retention may race it).
        frozen: Keys (flattened, as DCP names them: ``app.model.base.weight``) the
            caller promises did not change since the base: they are referenced when
            size, dtype and shape match, without hashing them. A hint for frozen
            weights; a key that did change would load stale values.
        content_hash: Record the XXH3-128 hash of every tensor payload in the manifest,
            so a later incremental save can reference it.
    """

    overwrite: bool = False
    files_per_rank: int | None = None
    sharding_guard: bool = True
    base: str | None = None
    base_required: bool = True
    frozen: tuple[str, ...] = ()
    content_hash: bool = True


@dataclass
class ReaderOptions:
    """Options of :class:`~dcpstore.Reader` (backend options are separate).

    Attributes:
        verify: Check every item read against the manifest's CRC32C (when the
            checkpoint has one; checkpoints written by torch's writers do not).
        coalesce_gap: Neighbouring ranges of one file closer than this many bytes are
            fetched as one request.
        max_range: Upper bound of a coalesced request (a single larger item is fetched
            whole).
        allow_pickle: Load non-tensor items with full pickle (can run code). By default
            they are loaded with ``weights_only`` semantics and anything else is refused.
        allow_unsafe_metadata: Unpickle ``.metadata`` without restriction (for custom
            planners that store their own classes in it).
        broadcast_reads: Read once, share: bytes that several ranks of a ``dcp.load``
            need (replicated tensors, optimizer scalars, every replica of an HSDP group)
            are fetched from the store by one of them and sent to the others over the
            process group, where each rank verifies them against the manifest; only the
            coordinator reads ``.metadata`` and the manifest. ``None`` (default): on for
            every backend but the local filesystem (where each rank reading the file is
            as fast); ``True``: on for every backend; ``False``: every rank reads what it
            needs itself. See :mod:`dcpstore.dcp.read_share`.
    """

    verify: bool = True
    coalesce_gap: int = 1024 * 1024
    max_range: int = 64 * 1024 * 1024
    allow_pickle: bool = False
    allow_unsafe_metadata: bool = False
    broadcast_reads: bool | None = None


def env_prefix(backend: str) -> str:
    """Environment variable prefix of a backend's options, e.g. ``DCPSTORE_S3_``.

    Args:
        backend: The backend's ``name``, not the URI scheme: ``gs://`` and ``gcs://``
            URIs both read ``DCPSTORE_GS_...``, the GCS backend being named ``gs``.
    """
    return "DCPSTORE_" + backend.upper().replace("-", "_") + "_"


def option_names(cls: type[Any]) -> set[str]:
    """Field names of an options dataclass."""
    return {f.name for f in dataclasses.fields(cls)}


def coerce(value: Any, annotation: Any, name: str) -> Any:
    """Convert a string from a URI or the environment to a field's declared type."""
    if not isinstance(value, str):
        return value
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value.strip().lower() in ("", "none", "null", "auto") and type(None) in args:
            return None
        last: Exception | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, name)
            except ValueError as exc:
                last = exc
        raise ValueError(f"option {name}={value!r}: {last}")
    if annotation is bool:
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"option {name}={value!r} is not a boolean (use true/false)")
    if annotation is int:
        try:
            return _parse_int(value)
        except ValueError:
            raise ValueError(f"option {name}={value!r} is not an integer") from None
    if annotation is float:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"option {name}={value!r} is not a number") from None
    return value


_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _parse_int(text: str) -> int:
    """Parse ``8``, ``8MiB``, ``8M``, ``64k`` (binary multiples)."""
    t = text.strip().lower().replace("_", "")
    for suffix in ("ib", "b"):
        if t.endswith(suffix) and t[:-len(suffix)][-1:] in _SIZE_SUFFIXES:
            t = t[: -len(suffix)]
            break
    if t and t[-1] in _SIZE_SUFFIXES:
        return int(float(t[:-1]) * _SIZE_SUFFIXES[t[-1]])
    return int(t)


def option_values(
    cls: type[Any],
    *,
    explicit: Mapping[str, Any],
    query: Mapping[str, str],
    environ: Mapping[str, str] | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """The values given for ``cls``'s fields, converted, highest precedence first.

    Keyword > query > ``environ[prefix + NAME]``; fields given nowhere are left out (the
    dataclass default applies).

    Args:
        cls: The options dataclass.
        explicit: Keyword arguments (only the names this class declares are taken).
        query: URI query parameters (only the names this class declares are taken).
        environ: Environment to read; ``None`` or empty reads none.
        prefix: Environment variable prefix (see :func:`env_prefix`).

    Raises:
        ValueError: A value cannot be converted to its option's type.
    """
    env = environ or {}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in explicit:
            raw: Any = explicit[f.name]
        elif f.name in query:
            raw = query[f.name]
        elif prefix + f.name.upper() in env:
            raw = env[prefix + f.name.upper()]
        else:
            continue
        values[f.name] = coerce(raw, hints[f.name], f.name)
    return values


def resolve_options(
    cls: type[T],
    *,
    scheme: str,
    explicit: Mapping[str, Any],
    query: Mapping[str, str],
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build an options dataclass from the four sources, highest precedence first.

    Args:
        cls: The options dataclass.
        scheme: The backend's name, used for the environment prefix
            ``DCPSTORE_<BACKEND>_``.
        explicit: Keyword arguments (only the names this class declares are taken).
        query: URI query parameters (only the names this class declares are taken).
        environ: Environment to read (defaults to ``os.environ``).

    Raises:
        ValueError: A value cannot be converted to its option's type.
    """
    env = os.environ if environ is None else environ
    values = option_values(cls, explicit=explicit, query=query, environ=env,
                           prefix=env_prefix(scheme))
    return cls(**values)
