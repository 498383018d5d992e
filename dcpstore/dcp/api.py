"""The public entry points: ``get_writer``, ``get_reader``, ``save``, ``load``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlanner

from dcpstore.dcp.dist import UNSET, is_distributed, single_process_quiet, unwrap
from dcpstore.dcp.reader import Reader
from dcpstore.dcp.writer import Writer
from dcpstore.errors import CheckpointMismatchError
from dcpstore.storage.resolve import Resolved, Role, open_backend, resolve

__all__ = ["get_reader", "get_writer", "load", "open_backend", "save"]

logger = logging.getLogger(__name__)

URI = str | os.PathLike[str]


def get_writer(uri: URI | Resolved, *, backend: str | None = None,
               process_group: Any = UNSET, **options: Any) -> Writer:
    """A DCP ``StorageWriter`` that saves to ``uri``.

    Args:
        uri: Checkpoint location: a local path, ``file://``, ``s3://``, ``gs://``,
            ``az://``, ``msc://`` or any scheme a plugin registers; or a URI already
            resolved by :func:`dcpstore.storage.resolve.resolve` (with ``role="writer"``;
            then no other options), so a caller that resolved it does not again.
        backend: Route through this backend regardless of the scheme.
        process_group: The process group of the ``dcp.save`` this writer serves
            (``None``: the world); its ranks name the data files. Not given: DCP's rank
            when it passes one, else the global rank.
        **options: :class:`~dcpstore.WriterOptions` fields (``overwrite``,
            ``files_per_rank``, ...), the backend's options, and ``_extensions`` (DCP
            stream transforms such as ``[ZStandard()]``).

    Example:
        >>> dcp.save(state_dict, storage_writer=dcpstore.get_writer("s3://b/run/step-1"))
    """
    extensions = options.pop("_extensions", None)
    resolved = _resolved(uri, backend, "writer", options)
    return Writer(resolved.open_backend(), resolved.writer(), extensions=extensions,
                  rebind=resolved.rebind, process_group=process_group)


def get_reader(uri: URI | Resolved, *, backend: str | None = None,
               process_group: Any = UNSET, **options: Any) -> Reader:
    """A DCP ``StorageReader`` that loads from ``uri``.

    Args:
        uri: Checkpoint location, or a resolved one (see :func:`get_writer`).
        backend: Route through this backend regardless of the scheme.
        process_group: The process group of the ``dcp.load`` this reader serves
            (``None``: the world), so that one rank reads ``.metadata`` and the manifest
            for all and bytes several ranks need are fetched once. Not given: every
            rank reads ``.metadata`` itself, and reads are shared only when the load
            runs over the whole world (a warning says so once).
        **options: :class:`~dcpstore.ReaderOptions` fields (``verify``,
            ``coalesce_gap``, ``allow_pickle``, ...), the backend's options,
            ``_extension_registry`` and ``_file_holders`` (the Reader's
            ``file_holders``: a checkpoint spread over several hosts' disks).
    """
    registry = options.pop("_extension_registry", None)
    holders = options.pop("_file_holders", None)
    resolved = _resolved(uri, backend, "reader", options)
    return Reader(resolved.open_backend(), resolved.reader(), extension_registry=registry,
                  rebind=resolved.rebind, process_group=process_group, file_holders=holders)


def _resolved(uri: URI | Resolved, backend: str | None, role: Role,
              options: dict[str, Any]) -> Resolved:
    if not isinstance(uri, Resolved):
        return resolve(uri, backend=backend, role=role, **options)
    if backend is not None or options:
        raise TypeError("options go to resolve() when the URI is given resolved; got "
                        f"{', '.join(sorted(options)) or 'backend='}")
    return uri


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


def save(
    state_dict: dict[str, Any],
    uri: URI,
    *,
    process_group: Any = None,
    planner: SavePlanner | None = None,
    backend: str | None = None,
    staging: Any = None,
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
        staging: Snapshot the state into staging memory first (one bulk device-to-host
            copy into pinned memory on CUDA): ``True``, a
            :class:`~dcpstore.StagingOptions` (or torch's, or a dict), or a
            :class:`~dcpstore.Stager` to reuse its memory across calls. ``None``: write
            from the state directly.
        **options: Writer and backend options (see :func:`get_writer`).

    Returns:
        The DCP ``Metadata`` that was committed.
    """
    if staging not in (None, False):
        from dcpstore.dcp.staging import Stager, as_staging_options

        stager = staging if isinstance(staging, Stager) else _stager_for(
            as_staging_options(staging))
        state_dict = stager.stage(state_dict)
        stager.synchronize()
    writer = get_writer(uri, backend=backend, process_group=process_group, **options)
    try:
        with single_process_quiet():
            return dcp.save(state_dict, storage_writer=writer, planner=planner,
                            process_group=process_group, no_dist=not is_distributed())
    except CheckpointException as exc:
        if writer.is_coordinator:
            try:
                writer.discard()
            except Exception as cleanup:  # must not mask the error that failed the save
                logger.warning("could not remove the files of the failed save at %s (%s); "
                               "`dcpstore gc` will", writer.backend.uri, cleanup)
        raise unwrap(exc) from exc
    finally:
        writer.backend.close()  # this call made it: release its threads and connections


_STAGERS: dict[Any, Any] = {}


def _stager_for(options: Any) -> Any:
    """One stager per set of options, kept for the process (its memory is reused)."""
    from dcpstore.dcp.staging import Stager

    if options not in _STAGERS:
        _STAGERS[options] = Stager(options)
    return _STAGERS[options]


def load(
    state_dict: dict[str, Any],
    uri: URI | Resolved,
    *,
    process_group: Any = None,
    planner: LoadPlanner | None = None,
    backend: str | None = None,
    **options: Any,
) -> None:
    """Load ``uri`` into ``state_dict`` in place with ``dcp.load`` and a dcpstore reader.

    Args:
        state_dict: Destination (its tensors/DTensors decide what each rank reads).
        uri: Checkpoint location, or one already resolved (see :func:`get_writer`).
        process_group: Process group for the collectives.
        planner: A custom ``LoadPlanner`` (default: DCP's, with key/shape checks).
        backend: Route through this backend regardless of the scheme.
        **options: Reader and backend options (see :func:`get_reader`).

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError,
        CheckpointMismatchError, UnsafeCheckpointError: see :mod:`dcpstore.errors`.
    """
    reader = get_reader(uri, backend=backend, process_group=process_group, **options)
    load_with(reader, state_dict, planner=planner, process_group=process_group,
              no_dist=not is_distributed())


def load_with(reader: Reader, state_dict: dict[str, Any], *,
              planner: LoadPlanner | None = None, process_group: Any = None,
              no_dist: bool = False) -> None:
    """``dcp.load`` with ``reader`` (closed at the end), dcpstore's errors unwrapped.

    ``no_dist=True`` loads on this process alone, without collectives, even inside a
    distributed job (an integration loading replicated state on each rank by itself).
    """
    try:
        with single_process_quiet():
            dcp.load(state_dict, storage_reader=reader, planner=planner or CheckedLoadPlanner(),
                     process_group=process_group, no_dist=no_dist)
    except CheckpointException as exc:
        # DCP folds read_metadata errors into an AssertionError; the reader kept ours
        if reader.metadata_error is not None:
            raise reader.metadata_error from exc
        raise unwrap(exc) from exc
    finally:
        reader.backend.close()

