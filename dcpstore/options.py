"""Option resolution: keyword > URI query > ``DCPSTORE_<SCHEME>_<OPTION>`` env > default.

Options are declared as dataclass fields (the writer's, the reader's and each backend's
``Options`` class). Values from the query string and the environment arrive as strings
and are converted to the field's declared type.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["coerce", "env_prefix", "option_names", "resolve_options"]

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_prefix(scheme: str) -> str:
    """Environment variable prefix for a scheme's options, e.g. ``DCPSTORE_S3_``."""
    return "DCPSTORE_" + scheme.upper().replace("-", "_") + "_"


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
        if value.lower() in ("", "none", "null") and type(None) in args:
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
        scheme: Used for the environment prefix ``DCPSTORE_<SCHEME>_``.
        explicit: Keyword arguments (only the names this class declares are taken).
        query: URI query parameters (only the names this class declares are taken).
        environ: Environment to read (defaults to ``os.environ``).

    Raises:
        ValueError: A value cannot be converted to its option's type.
    """
    env = os.environ if environ is None else environ
    prefix = env_prefix(scheme)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
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
    return cls(**values)
