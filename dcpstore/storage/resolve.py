"""Resolve a checkpoint URI once: its backend class and its backend, writer and reader options.

Every caller (:func:`dcpstore.get_writer`, :func:`dcpstore.get_reader`, ``Writer`` /
``Reader`` ``reset``, :class:`dcpstore.Checkpointer`, the CLI and ``dcpstore.tools.ops``) goes
through :func:`resolve`, so one rule decides everywhere:

- **Backend:** the ``backend=`` argument > ``$DCPSTORE_BACKEND`` > the URI's scheme.
- **Backend options:** keyword > URI query > ``DCPSTORE_<BACKEND>_<OPTION>`` environment
  variable (``<BACKEND>`` is the backend's ``name``) > the backend's default.
- **Writer and reader options:** keyword > URI query > default. The environment applies
  to backend options only.

This module imports nothing above it (no ``api``, ``writer`` or ``reader``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dcpstore.errors import DcpstoreError
from dcpstore.storage.backend import Backend, BackendOptions
from dcpstore.storage.options import (
    ReaderOptions,
    WriterOptions,
    env_prefix,
    option_names,
    option_values,
    resolve_options,
)
from dcpstore.storage.registry import backend_class, selected_backend_name
from dcpstore.storage.uri import ParsedURI, parse_uri

__all__ = [
    "Resolved",
    "Role",
    "env_variable",
    "open_backend",
    "reader_option_values",
    "resolve",
    "serves",
]

#: What the options of a :func:`resolve` call are for. ``None``: a bare backend
#: (keyword options must be backend options; other query options are ignored).
Role = Literal["writer", "reader", "checkpointer"] | None

_WRITER = frozenset(option_names(WriterOptions))
_READER = frozenset(option_names(ReaderOptions))


@dataclass(frozen=True)
class Resolved:
    """A URI resolved once: what serves it and with which options.

    Attributes:
        uri: The parsed URI.
        backend_cls: The backend class serving it.
        backend_options: The backend's options, resolved from all four sources.
        writer_options: :class:`~dcpstore.WriterOptions` fields given (keyword or query),
            converted to their types; absent fields keep their defaults.
        reader_options: The same for :class:`~dcpstore.ReaderOptions`.
        backend_name: The explicit ``backend=`` argument, if any.
        backend_kwargs: The backend options given as keywords (a :meth:`rebind` keeps
            them; query and environment are read again for the new URI).
    """

    uri: ParsedURI
    backend_cls: type[Backend]
    backend_options: BackendOptions
    writer_options: dict[str, Any] = field(default_factory=dict)
    reader_options: dict[str, Any] = field(default_factory=dict)
    backend_name: str | None = None
    backend_kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return str(self.uri)

    def open_backend(self) -> Backend:
        """Create the backend (a new instance on every call)."""
        return self.backend_cls.from_uri(self.uri, self.backend_options)

    def writer(self) -> WriterOptions:
        """The writer options as a :class:`~dcpstore.WriterOptions`."""
        return WriterOptions(**self.writer_options)

    def reader(self) -> ReaderOptions:
        """The reader options as a :class:`~dcpstore.ReaderOptions`."""
        return ReaderOptions(**self.reader_options)

    def rebind(self, uri: str | os.PathLike[str]) -> Backend:
        """A backend for another URI with the same backend choice and keyword options."""
        return open_backend(uri, backend=self.backend_name, **self.backend_kwargs)


def resolve(
    uri: str | os.PathLike[str],
    *,
    backend: str | None = None,
    role: Role = None,
    **options: Any,
) -> Resolved:
    """Parse ``uri``, pick its backend and split ``options`` (see the module docstring).

    Args:
        uri: Checkpoint location.
        backend: Route through this backend regardless of the scheme (feature flag).
        role: Which options besides the backend's are accepted: ``"writer"``,
            ``"reader"``, ``"checkpointer"`` (both), or ``None`` (backend options only;
            query options of writers/readers are then ignored).
        **options: Backend options, plus the writer/reader options ``role`` allows.

    Raises:
        InvalidURIError: The URI is malformed.
        BackendNotFoundError: No backend serves it.
        TypeError: An option (keyword or URI query) is unknown.
        ValueError: A value cannot be converted to its option's type.
    """
    parsed = parse_uri(uri)
    cls = backend_class(selected_backend_name(parsed.scheme, backend))
    theirs = option_names(cls.Options)
    own: frozenset[str] = {
        None: frozenset(),
        "writer": _WRITER,
        "reader": _READER,
        "checkpointer": _WRITER | _READER,
    }[role]
    unknown = sorted(set(options) - own - theirs)
    if unknown:
        if role is None:
            raise TypeError(
                f"unknown option(s) {', '.join(unknown)} for backend {cls.name!r}; valid: "
                f"{', '.join(sorted(theirs))}"
            )
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for {parsed} (backend {cls.name!r}); "
            f"valid options: {', '.join(sorted(own | theirs))}"
        )
    if role is not None:
        unknown_query = sorted(set(parsed.query) - own - theirs)
        if unknown_query:
            raise TypeError(f"unknown URI query option(s) {', '.join(unknown_query)} in {parsed}")
    writer = _own_values(WriterOptions, _WRITER & own, options, parsed.query)
    reader = _own_values(ReaderOptions, _READER & own, options, parsed.query)
    backend_kwargs = {k: v for k, v in options.items() if k in theirs}
    query = {k: v for k, v in parsed.query.items() if k in theirs}
    backend_options = resolve_options(cls.Options, scheme=cls.name, explicit=backend_kwargs,
                                      query=query)
    return Resolved(parsed, cls, backend_options, writer, reader, backend, backend_kwargs)


def serves(uri: Any) -> bool:
    """Whether an installed backend serves ``uri`` (it resolves; no backend is made)."""
    try:
        resolve(str(uri))
    except (DcpstoreError, TypeError, ValueError):
        return False
    return True


def _own_values(
    cls: type[Any], names: frozenset[str], options: Mapping[str, Any], query: Mapping[str, str]
) -> dict[str, Any]:
    if not names:
        return {}
    return option_values(
        cls,
        explicit={k: v for k, v in options.items() if k in names},
        query={k: v for k, v in query.items() if k in names},
    )


def reader_option_values(
    uri: str | os.PathLike[str], options: Mapping[str, Any]
) -> dict[str, Any]:
    """The :class:`~dcpstore.ReaderOptions` fields among ``options`` and ``uri``'s query,
    converted to their types; other options are ignored and no backend is looked up."""
    return _own_values(ReaderOptions, _READER, options, parse_uri(uri).query)


def open_backend(
    uri: str | os.PathLike[str], *, backend: str | None = None, **options: Any
) -> Backend:
    """Create the backend serving ``uri`` (options: keyword > query > env > default).

    Args:
        uri: Checkpoint location.
        backend: Route through this backend regardless of the scheme (feature flag);
            defaults to ``$DCPSTORE_BACKEND``, then the scheme.
        **options: Backend options.

    Raises:
        InvalidURIError: The URI is malformed.
        BackendNotFoundError: No backend serves it.
        TypeError: An unknown option was given.
    """
    return resolve(uri, backend=backend, **options).open_backend()


def env_variable(backend_cls: type[Backend], option: str) -> str:
    """The environment variable of one backend option, e.g. ``DCPSTORE_S3_REGION``."""
    return env_prefix(backend_cls.name) + option.upper()
