"""The coordinator's commit protocol: the target checked once before any rank writes;
after every rank's writes succeeded, the manifest, then ``.metadata`` (the commit
point); whether a ``.metadata`` whose request failed landed after all; and the files
that are no longer needed once a save is committed (those of the checkpoint it
overwrote) or once it failed (its own).

Nothing is deleted that a committed ``.metadata`` may still name: a save's own files
stay where its commit may have landed, and an overwritten checkpoint's files stay where
another step of an incremental run references them or a save in progress pinned them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch.distributed.checkpoint.metadata import Metadata

from dcpstore import errors
from dcpstore.dcp import layout
from dcpstore.dcp import references as refs
from dcpstore.dcp.safe_pickle import safe_loads
from dcpstore.storage.backend import Backend

__all__: list[str] = []

logger = logging.getLogger(__name__)


def _commit_landed(backend: Backend, sent: bytes | None) -> bool | None:
    """Whether ``backend`` holds the ``.metadata`` a save sent, ``sent`` (``None``:
    cannot tell; ``False`` also when its PUT was never attempted: ``sent`` is ``None``)."""
    if sent is None:
        return False
    try:
        return backend.get(layout.METADATA_KEY) == sent
    except FileNotFoundError:
        return False
    except Exception as exc:
        logger.warning("cannot read %s/.metadata back (%s)", backend.uri, exc)
        return None


def _check_target(backend: Backend, overwrite: bool) -> Metadata | None:
    """Coordinator only: one existence check, before any rank writes. Returns the
    ``.metadata`` of the checkpoint this save replaces (``None``: none, or unreadable)."""
    try:
        raw = backend.get(layout.METADATA_KEY)
    except FileNotFoundError:
        return None
    if not overwrite:
        raise errors.CheckpointExistsError(
            f"Checkpoint already exists at {backend.uri} and overwrite=False; pass "
            "overwrite=True to replace it (atomically), or save to a new location"
        )
    try:
        previous = safe_loads(raw, source=f"{backend.uri}/.metadata")
        return previous if isinstance(previous, Metadata) else None
    except Exception as exc:  # an unreadable old checkpoint must not block a new one
        logger.warning("existing .metadata at %s is unreadable (%s); it will be "
                       "replaced but its data files are left for `dcpstore gc`",
                       backend.uri, exc)
        return None


def _delete_stale(backend: Backend, previous: Metadata | None, keep: set[str]) -> None:
    """After the commit: delete the files of the save this one overwrote (``previous``
    is its ``.metadata``) that this save did not write again (``keep``) and no other
    step needs."""
    if previous is None:
        return
    stale = {
        getattr(info, "relative_path", None)
        for info in (previous.storage_data or {}).values()
    }
    stale.discard(None)
    old_save = getattr(previous.storage_meta, "save_id", None)
    if isinstance(old_save, str) and old_save.startswith("dcpstore-"):
        stale.add(layout.manifest_key(old_save))
    doomed = _unreferenced(
        backend, sorted(k for k in stale if isinstance(k, str) and k not in keep))
    if doomed:
        logger.info("deleting %d files of the overwritten checkpoint", len(doomed))
        _delete_quietly(backend, doomed)


def _unreferenced(backend: Backend, keys: list[str]) -> list[str]:
    """The files of an overwritten save that no other step needs: under a run root
    that held incremental saves, files a committed sibling references, or that a
    save in progress pinned, stay (``dcpstore gc`` follows the same references)."""
    try:
        root, name = refs.run_root(backend)
    except errors.DcpstoreError:
        return keys  # at the top of its store: no siblings
    try:
        # pins first, then committed steps (see dcpstore.dcp.references)
        pins = refs.read_pins(root)
        dirs = root.list_dirs()
        if refs.INCREMENTAL_DIR not in dirs:
            return keys  # no step here references another
        if any(name in pin.steps for pin in pins):
            needed = None
        else:
            siblings = [d for d in dirs if d != name and not d.startswith(".")
                        and root.exists(f"{d}/{layout.METADATA_KEY}")]
            needed = refs.referenced_keys(root, siblings)
    except Exception as exc:
        logger.warning("cannot tell which files of the overwritten %s other steps "
                       "reference (%s); keeping its data files for `dcpstore gc`",
                       backend.uri, exc)
        needed = None
    finally:
        root.close()
    if needed is None:
        return [k for k in keys if not k.endswith(layout.DATA_SUFFIX)]
    kept = [k for k in keys if f"{name}/{k}" in needed]
    if kept:
        logger.info("keeping %d files of the overwritten %s that other steps reference",
                    len(kept), backend.uri)
    return [k for k in keys if f"{name}/{k}" not in needed]


def _delete_quietly(backend: Backend, keys: Sequence[str]) -> None:
    try:
        backend.delete(keys)
    except Exception as exc:
        logger.warning("could not delete %d objects under %s (%s); `dcpstore gc` will",
                       len(keys), backend.uri, exc)


def _remove_save(backend: Backend, save_id: str) -> None:
    """Delete every object of the save ``save_id`` (its data files and manifest) after
    it failed uncommitted; never ``.metadata`` or files of other saves."""
    keys = [o.key for o in backend.list("__") if layout.save_id_of(o.key) == save_id]
    keys.append(layout.manifest_key(save_id))
    _delete_quietly(backend, keys)
    if backend.exists(layout.METADATA_KEY):
        return
    # nothing else there: leave no empty directory behind on local disk
    backend.remove_empty_dirs()
