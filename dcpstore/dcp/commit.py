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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Target:
    """What a save found at its URI before any rank wrote.

    Attributes:
        previous: The ``.metadata`` this save replaces (``None``: none, or unreadable).
        version: That ``.metadata``'s version, what the commit's ``if_match`` compares
            (``None``: there was none, or the store has no conditional writes).
    """

    previous: Metadata | None = None
    version: str | None = None


def _check_target(backend: Backend, overwrite: bool) -> Target:
    """Coordinator only: one existence check (a GET), before any rank writes.

    Where a checkpoint is there and ``overwrite=True`` replaces it, on a store with
    conditional writes: its version (a HEAD), then its ``.metadata`` again (a version
    read before the bytes: if they changed in between, the commit's ``if_match``
    fails and the commit reads the target again)."""
    version = None
    try:
        raw = backend.get(layout.METADATA_KEY)
        if not overwrite:
            raise _exists_error(backend, during=False, raw=raw)
        if backend.conditional_writes:
            version = backend.stat(layout.METADATA_KEY).version
            raw = backend.get(layout.METADATA_KEY)
    except FileNotFoundError:
        return Target()
    try:
        previous = safe_loads(raw, source=f"{backend.uri}/.metadata")
        return Target(previous if isinstance(previous, Metadata) else None, version)
    except Exception as exc:  # an unreadable old checkpoint must not block a new one
        logger.warning("existing .metadata at %s is unreadable (%s); it will be "
                       "replaced but its data files are left for `dcpstore gc`",
                       backend.uri, exc)
        return Target(None, version)


def _exists_error(backend: Backend, *, during: bool,
                  raw: bytes | None = None) -> errors.CheckpointExistsError:
    """The error of a save with ``overwrite=False`` that finds a committed checkpoint
    at its URI: before it wrote (``during=False``) or at its commit, which another save
    won meanwhile (``during=True``). Names that other save."""
    try:
        if raw is None:
            raw = backend.get(layout.METADATA_KEY)
        other = layout.save_id_of_metadata(safe_loads(raw, source=f"{backend.uri}/.metadata"))
        whose = f"save {other}" if other else "a save by another writer (no dcpstore save id)"
    except Exception as exc:
        whose = f"a save whose .metadata cannot be read now ({type(exc).__name__})"
    if during:
        return errors.CheckpointExistsError(
            f"Checkpoint already exists at {backend.uri}: another job committed it "
            f"({whose}) while this save was running, and overwrite=False. That "
            "checkpoint is whole and this save's files were removed; save to a new "
            "location, or pass overwrite=True to replace it")
    return errors.CheckpointExistsError(
        f"Checkpoint already exists at {backend.uri} ({whose}) and overwrite=False; "
        "pass overwrite=True to replace it (atomically), or save to a new location")


#: How many other commits an ``overwrite=True`` save replaces in turn before it gives
#: up (each lost compare-and-swap means another job committed in between).
_COMMIT_RACES = 8


def _commit(backend: Backend, data: bytes, target: Target, *, overwrite: bool) -> Target:
    """Put ``.metadata`` (the commit point) and return the target it replaced.

    With conditional writes the PUT succeeds only over what the save found
    (``if_absent``, or ``if_match`` its version), so of two saves racing to one URI
    exactly one commits: with ``overwrite=False`` the other gets
    :class:`~dcpstore.errors.CheckpointExistsError`; with ``overwrite=True`` it
    replaces the commit that beat it, whole (the last commit wins), and learns which
    files that commit made stale. Without, a HEAD just before the PUT narrows the
    window (``docs/reliability.md`` says what then holds).
    """
    if not backend.conditional_writes:
        if not overwrite and backend.exists(layout.METADATA_KEY):
            raise _exists_error(backend, during=True)
        backend.put(layout.METADATA_KEY, data, atomic=True)
        return target
    for _ in range(_COMMIT_RACES):
        try:
            if target.version is None:
                backend.put(layout.METADATA_KEY, data, atomic=True, if_absent=True)
            else:
                backend.put(layout.METADATA_KEY, data, atomic=True, if_match=target.version)
            return target
        except errors.PreconditionFailedError:
            landed = _commit_landed(backend, data)
            if landed:  # a retry of this save's own PUT, whose first answer was lost
                logger.warning("commit of %s: a retried .metadata request failed its "
                               "condition, but the store holds this save's .metadata: "
                               "committed", backend.uri)
                return target
            if landed is None:  # the caller keeps this save's files
                raise errors.StoreUnavailableError(
                    f"commit of {backend.uri}: a retried .metadata request failed its "
                    "condition and .metadata cannot be read back, so whether this save "
                    "committed cannot be told; its files are kept (`dcpstore verify` "
                    "tells)") from None
            if not overwrite:
                raise _exists_error(backend, during=True) from None
            logger.warning("another save committed %s while this one was running; "
                           "replacing it (overwrite=True: the last commit wins)",
                           backend.uri)
            target = _check_target(backend, overwrite=True)
    raise errors.StoreError(
        f"could not commit {backend.uri}: {_COMMIT_RACES} other saves committed there "
        "while this one tried; stop the other jobs writing this URI")


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
