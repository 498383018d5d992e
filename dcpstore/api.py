"""The public entry points: ``get_writer``, ``get_reader``, ``save``, ``load``."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlanner

from .backend import Backend
from .errors import CheckpointMismatchError, DcpstoreError
from .options import option_names, resolve_options
from .reader import Reader, ReaderOptions
from .registry import backend_class, selected_backend_name
from .uri import parse_uri
from .writer import Writer, WriterOptions

__all__ = ["get_reader", "get_writer", "load", "open_backend", "save"]

logger = logging.getLogger(__name__)

URI = str | os.PathLike[str]


def _split_options(
    options: Mapping[str, Any], own: type[Any], backend_cls: type[Backend], uri: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    mine = option_names(own)
    theirs = option_names(backend_cls.Options)
    unknown = sorted(set(options) - mine - theirs)
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for {uri} "
            f"(backend {backend_cls.name!r}); valid options: {', '.join(sorted(mine | theirs))}"
        )
    return ({k: v for k, v in options.items() if k in mine},
            {k: v for k, v in options.items() if k in theirs})


def open_backend(uri: URI, *, backend: str | None = None, **options: Any) -> Backend:
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
    parsed = parse_uri(uri)
    cls = backend_class(selected_backend_name(parsed.scheme, backend))
    unknown = sorted(set(options) - option_names(cls.Options))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for backend {cls.name!r}; valid: "
            f"{', '.join(sorted(option_names(cls.Options)))}"
        )
    query = {k: v for k, v in parsed.query.items() if k in option_names(cls.Options)}
    opts = resolve_options(cls.Options, scheme=cls.name, explicit=options, query=query)
    return cls.from_uri(parsed, opts)


def _factory(
    uri: URI, backend: str | None, own: type[Any], options: dict[str, Any]
) -> tuple[Backend, Any, Any]:
    parsed = parse_uri(uri)
    cls = backend_class(selected_backend_name(parsed.scheme, backend))
    own_opts, backend_opts = _split_options(options, own, cls, str(parsed))
    own_query = {k: v for k, v in parsed.query.items() if k in option_names(own)}
    unknown_query = sorted(
        set(parsed.query) - option_names(own) - option_names(cls.Options)
    )
    if unknown_query:
        raise TypeError(f"unknown URI query option(s) {', '.join(unknown_query)} in {parsed}")
    resolved_own = resolve_options(own, scheme="dcpstore", explicit=own_opts, query=own_query,
                                   environ={})

    rebind = functools.partial(open_backend, backend=backend, **backend_opts)
    return open_backend(uri, backend=backend, **backend_opts), resolved_own, rebind


def get_writer(uri: URI, *, backend: str | None = None, **options: Any) -> Writer:
    """A DCP ``StorageWriter`` that saves to ``uri``.

    Args:
        uri: Checkpoint location: a local path, ``file://``, ``s3://``, ``gs://``,
            ``msc://`` or any scheme a plugin registers.
        backend: Route through this backend regardless of the scheme.
        **options: :class:`~dcpstore.WriterOptions` fields (``overwrite``,
            ``files_per_rank``, ...), the backend's options, and ``_extensions`` (DCP
            stream transforms such as ``[ZStandard()]``).

    Example:
        >>> dcp.save(state_dict, storage_writer=dcpstore.get_writer("s3://b/run/step-1"))
    """
    extensions = options.pop("_extensions", None)
    be, opts, rebind = _factory(uri, backend, WriterOptions, options)
    return Writer(be, opts, extensions=extensions, rebind=rebind)


def get_reader(uri: URI, *, backend: str | None = None, **options: Any) -> Reader:
    """A DCP ``StorageReader`` that loads from ``uri``.

    Args:
        uri: Checkpoint location (see :func:`get_writer`).
        backend: Route through this backend regardless of the scheme.
        **options: :class:`~dcpstore.ReaderOptions` fields (``verify``,
            ``coalesce_gap``, ``allow_pickle``, ...), the backend's options, and
            ``_extension_registry``.
    """
    registry = options.pop("_extension_registry", None)
    be, opts, rebind = _factory(uri, backend, ReaderOptions, options)
    return Reader(be, opts, extension_registry=registry, rebind=rebind)


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus a clear error naming mismatching keys/shapes."""

    def create_local_plan(self) -> LoadPlan:
        metadata = self.metadata
        if metadata is not None and not self.allow_partial_load:
            _check_keys(self.state_dict, metadata)
        return super().create_local_plan()


def _check_keys(state_dict: Mapping[str, Any], metadata: Metadata) -> None:
    saved = metadata.state_dict_metadata
    missing = [k for k in state_dict if k not in saved]
    wrong = []
    for key, value in state_dict.items():
        md = saved.get(key)
        shape = getattr(value, "shape", None)
        if (isinstance(md, TensorStorageMetadata) and shape is not None
                and tuple(md.size) != tuple(shape)):
                wrong.append(f"{key}: checkpoint {list(md.size)} vs model {list(shape)}")
    if not missing and not wrong:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) not in the checkpoint: {', '.join(missing[:5])}"
                     + (" ..." if len(missing) > 5 else ""))
        extra = [k for k in saved if k not in state_dict][:5]
        if extra:
            parts.append(f"the checkpoint has e.g. {', '.join(extra)}")
    if wrong:
        parts.append(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:5])}")
    raise CheckpointMismatchError(
        "the state dict does not match the checkpoint: " + "; ".join(parts)
        + ". Load into the model the checkpoint was saved from, or pass a planner that "
        "allows partial loads."
    )


def _unwrap(exc: CheckpointException) -> BaseException:
    """The most useful error inside DCP's CheckpointException: a dcpstore error first,
    then an ``OSError``, then whatever a rank raised; annotated with the rank."""
    failures = [
        (rank, f[0] if isinstance(f, tuple) else f) for rank, f in exc.failures.items()
    ]
    for kind in (DcpstoreError, OSError, Exception):
        for rank, err in failures:
            if isinstance(err, kind):
                if hasattr(err, "add_note"):
                    err.add_note(f"(raised on rank {rank} during {exc.args[0]!r}; "
                                 f"{len(failures)} rank(s) failed)")
                return err
    return exc


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: here that is deliberate."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(
    state_dict: dict[str, Any],
    uri: URI,
    *,
    process_group: Any = None,
    planner: SavePlanner | None = None,
    backend: str | None = None,
    **options: Any,
) -> Metadata:
    """Save ``state_dict`` to ``uri`` with ``dcp.save`` and a dcpstore writer.

    Collective when ``torch.distributed`` is initialized. On failure nothing is
    committed, this save's files are removed, and the most specific error is raised.

    Args:
        state_dict: The state to save (tensors, DTensors, ``Stateful`` objects, ...).
        uri: Checkpoint location.
        process_group: Process group for the collectives (default: the global group).
        planner: A custom ``SavePlanner``.
        backend: Route through this backend regardless of the scheme.
        **options: Writer and backend options (see :func:`get_writer`).

    Returns:
        The DCP ``Metadata`` that was committed.
    """
    writer = get_writer(uri, backend=backend, **options)
    try:
        with _single_process_quiet():
            return dcp.save(state_dict, storage_writer=writer, planner=planner,
                            process_group=process_group, no_dist=not _distributed())
    except CheckpointException as exc:
        if writer.is_coordinator:
            try:
                writer.discard()
            except Exception as cleanup:  # must not mask the error that failed the save
                logger.warning("could not remove the files of the failed save at %s (%s); "
                               "`dcpstore gc` will", writer.backend.uri, cleanup)
        raise _unwrap(exc) from exc
    finally:
        writer.backend.close()  # this call made it: release its threads and connections


def load(
    state_dict: dict[str, Any],
    uri: URI,
    *,
    process_group: Any = None,
    planner: LoadPlanner | None = None,
    backend: str | None = None,
    **options: Any,
) -> None:
    """Load ``uri`` into ``state_dict`` in place with ``dcp.load`` and a dcpstore reader.

    Args:
        state_dict: Destination (its tensors/DTensors decide what each rank reads).
        uri: Checkpoint location.
        process_group: Process group for the collectives.
        planner: A custom ``LoadPlanner`` (default: DCP's, with key/shape checks).
        backend: Route through this backend regardless of the scheme.
        **options: Reader and backend options (see :func:`get_reader`).

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError,
        CheckpointMismatchError, UnsafeCheckpointError: see :mod:`dcpstore.errors`.
    """
    reader = get_reader(uri, backend=backend, **options)
    try:
        with _single_process_quiet():
            dcp.load(state_dict, storage_reader=reader, planner=planner or CheckedLoadPlanner(),
                     process_group=process_group, no_dist=not _distributed())
    except CheckpointException as exc:
        # DCP folds read_metadata errors into an AssertionError; the reader kept ours
        if reader.metadata_error is not None:
            raise reader.metadata_error from exc
        raise _unwrap(exc) from exc
    finally:
        reader.backend.close()

