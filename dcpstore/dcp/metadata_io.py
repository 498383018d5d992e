"""Loading a checkpoint's ``.metadata`` and integrity manifest, safely.

One implementation for everything that opens a checkpoint: the DCP
:class:`~dcpstore.Reader` and the whole-checkpoint operations in :mod:`dcpstore.tools.ops`
(``inspect``, ``verify``, ``cp``, ``ls``, ``gc``).

- :func:`parse_metadata` unpickles ``.metadata`` with the restricted unpickler and checks
  that every storage entry is well formed and stays inside the checkpoint root.
- :func:`load_metadata` fetches and parses it; a missing one is
  :class:`~dcpstore.CheckpointNotFoundError` or, when data files are lying there without
  it, :class:`~dcpstore.IncompleteCheckpointError`.
- :func:`read_manifest` fetches the manifest a save id names and checks it belongs to
  that save.
- :func:`check_references` admits the storage entries that point into a sibling step
  (an incremental save) only when the manifest records them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dcpstore.dcp import layout
from dcpstore.dcp.manifest import SAVE_ID_PREFIX, Manifest
from dcpstore.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    UnsafeCheckpointError,
    UnsafeKeyError,
)
from dcpstore.storage.backend import Backend
from dcpstore.storage.uri import is_reference, validate_storage_path

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "check_references",
    "load_metadata",
    "missing_metadata_error",
    "parse_metadata",
    "read_manifest",
]

logger = logging.getLogger(__name__)


def parse_metadata(raw: bytes, *, source: str, trusted: bool = False) -> Metadata:
    """Unpickle ``.metadata`` and check that it is DCP metadata whose storage entries
    stay inside the checkpoint.

    Args:
        raw: The bytes of ``.metadata``.
        source: Where they came from, for error messages.
        trusted: Unpickle without restriction (``allow_unsafe_metadata``).

    Raises:
        UnsafeCheckpointError: It would import or call something not allowed.
        UnsafeKeyError: A storage entry points outside the checkpoint root.
        IntegrityError: It is damaged or is not DCP metadata.
    """
    # torch here, not at the top: listing checkpoints (``dcpstore ls``) does not import it
    from torch.distributed.checkpoint.metadata import Metadata

    from dcpstore.dcp.safe_pickle import safe_loads
    from dcpstore.torch_internals import StorageInfo

    try:
        metadata = safe_loads(raw, source=source, trusted=trusted)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise IntegrityError(f"{source} is damaged and cannot be read: "
                             f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"{source} holds a {type(metadata).__name__}, not DCP Metadata")
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        path, *sizes = (getattr(info, name, None) for name in ("relative_path", "offset",
                                                               "length"))
        if not (isinstance(info, StorageInfo) and isinstance(path, str)
                and all(isinstance(n, int) and n >= 0 for n in sizes)):
            raise IntegrityError(f"{source}: storage entry of "
                                 f"{getattr(index, 'fqn', index)!r} is malformed")
        validate_storage_path(path)
    return metadata


def check_one_save(metadata: Any, manifest: Manifest, source: str) -> None:
    """Refuse a ``.metadata`` that names a data file of another save than its own which
    its manifest does not record: two saves of one step mixed (a race that a store
    without conditional writes could not decide, or a file copied in by hand).
    References to sibling steps, and files ``dcpstore cp`` copied in with their
    manifest records, are not mixed."""
    save_id = manifest.save_id
    for path in {info.relative_path for info in (metadata.storage_data or {}).values()}:
        other = None if is_reference(path) else layout.save_id_of(path)
        if other is not None and other != save_id and path not in manifest.files:
            raise IntegrityError(
                f"{source} belongs to save {save_id} but names {path}, a data file of "
                f"save {other}: two saves of this checkpoint were mixed (two jobs wrote "
                "it at once on a store without conditional writes). Do not load it: "
                "save it again, or load another checkpoint")


def missing_metadata_error(backend: Backend) -> Exception:
    """Why ``backend`` holds no ``.metadata``: an incomplete save (data files without
    it), a missing bucket, or no checkpoint at all."""
    try:
        leftovers = [o.key for o in backend.list("__") if o.key.endswith(".distcp")]
    except FileNotFoundError as exc:  # e.g. the bucket itself is missing: say so
        return CheckpointNotFoundError(f"no checkpoint at {backend.uri}: {exc}")
    if leftovers:
        return IncompleteCheckpointError(
            f"incomplete checkpoint at {backend.uri}: {len(leftovers)} data files "
            "but no .metadata (a save that failed or is still running). Load another "
            "checkpoint; `dcpstore gc` removes the leftovers."
        )
    return CheckpointNotFoundError(
        f"no checkpoint at {backend.uri} (no .metadata); check the URI"
    )


def load_metadata(backend: Backend, *, trusted: bool = False, diagnose_missing: bool = False
                  ) -> tuple[Metadata, bytes]:
    """``.metadata`` of the checkpoint at ``backend``, parsed and raw.

    Args:
        backend: The checkpoint's root.
        trusted: See :func:`parse_metadata`.
        diagnose_missing: When it is missing, list the root to tell an incomplete save
            from no checkpoint (:func:`missing_metadata_error`).

    Raises:
        CheckpointNotFoundError: There is no ``.metadata``.
        IncompleteCheckpointError: Data files but no ``.metadata`` (``diagnose_missing``).
    """
    try:
        raw = backend.get(layout.METADATA_KEY)
    except FileNotFoundError:
        if diagnose_missing:
            raise missing_metadata_error(backend) from None
        raise CheckpointNotFoundError(f"no checkpoint at {backend.uri} (no .metadata)") from None
    return parse_metadata(raw, source=f"{backend.uri}/{layout.METADATA_KEY}",
                          trusted=trusted), raw


def read_manifest(backend: Backend, save_id: Any, *, required: bool = False,
                  hint: str = "") -> Manifest | None:
    """The integrity manifest of save ``save_id``.

    Args:
        backend: The checkpoint's root.
        save_id: ``storage_meta.save_id`` of its ``.metadata``; anything but a dcpstore
            save id (a checkpoint of torch's writers) has no manifest: ``None``.
        required: A missing manifest is an error (``.metadata`` names it), not ``None``.
        hint: Appended to the message of that error (what the caller can do).

    Raises:
        IntegrityError: It is missing (``required``), damaged, or belongs to another
            save.
    """
    if not (isinstance(save_id, str) and save_id.startswith(SAVE_ID_PREFIX)):
        logger.debug("%s was not written by dcpstore; no manifest to verify against",
                     backend.uri)
        return None
    key = layout.manifest_key(save_id)
    try:
        raw = backend.get(key)
    except FileNotFoundError:
        if required:
            raise IntegrityError(
                f"{backend.uri}: the integrity manifest {key} named by .metadata is missing; "
                f"the checkpoint was damaged after it was written{hint}"
            ) from None
        return None
    manifest = Manifest.from_bytes(raw, source=f"{backend.uri}/{key}")
    if manifest.save_id != save_id:
        raise IntegrityError(f"{backend.uri}/{key} belongs to save {manifest.save_id}, "
                             f"not {save_id}")
    return manifest


def references_in(metadata: Metadata) -> set[str]:
    """The ``relative_path`` s of ``metadata`` that point into sibling steps."""
    return {info.relative_path for info in (metadata.storage_data or {}).values()
            if is_reference(info.relative_path)}


def check_references(metadata: Metadata, manifest: Manifest | None, *, source: str) -> bool:
    """Admit ``metadata``'s references into sibling steps only if its integrity manifest
    records each of them (as the save that committed it did); return whether it has any.

    ``parse_metadata`` already refused every path that is not inside the checkpoint or
    of the one reference form (``../<sibling>/<file>.distcp``), so nothing can reach
    outside the run root; this refuses references the save did not make.

    Raises:
        UnsafeKeyError: A reference is not recorded in the manifest, or there is none.
    """
    paths = references_in(metadata)
    if not paths:
        return False
    recorded = manifest.references if manifest is not None else {}
    unknown = sorted(p for p in paths if p not in recorded)
    if unknown:
        raise UnsafeKeyError(
            f"{source}: object key {unknown[0]!r} points outside the checkpoint and is "
            "not a reference its integrity manifest records; refusing to read it"
        )
    return True
