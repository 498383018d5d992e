"""References between the checkpoints of one run root (incremental saves).

An incremental save does not write a tensor payload that is unchanged since an earlier
committed step under the same *run root* (the parent of the checkpoints): its
``.metadata`` entry points into the sibling step that holds the bytes, for example
``../step-000000100/__0_0.<save>.distcp``. This module owns what follows from that:

- the syntax of references and how they map to keys of the run root
  (:func:`run_root`, :func:`root_key`, :func:`reference_path`);
- **pins**: a save in progress writes ``<root>/.dcpstore-pins/<save>.json`` naming the
  steps whose files it is about to reference, *before* it reads them; retention and
  ``gc`` keep every file of a pinned step (see ``docs/reliability.md``);
- **reference-aware deletion** (:func:`delete_steps`): a deleted step loses its
  ``.metadata`` first (it stops being a checkpoint at once); files that a committed step
  still references, or that a pin protects, stay, marked by a small
  ``.dcpstore-retired.json``, until nothing needs them.

The order of the steps of both sides is what makes a concurrent retention safe:

=============================================  =========================================
save (coordinator)                             retention
=============================================  =========================================
1. pin the base                                1. delete ``.metadata`` of doomed steps
2. read the base's ``.metadata`` + manifest    2. list pins
3. pin the base and every step it references   3. list committed steps, read their
4. read the base's ``.metadata`` again: it         references
   must be unchanged, else no references       4. delete files neither needed nor pinned
5. ... write, stat the referenced files,
   commit; then remove the pin
=============================================  =========================================

If retention's step 2 does not see the pin of step 3, its step 1 came before the save's
step 4, which then finds the base gone and saves without references. If it does, the
pinned files stay. A pin is removed only after the save's ``.metadata`` is committed, and
retention lists committed steps after pins, so it sees either the pin or the new step.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from dcpstore.dcp import layout
from dcpstore.dcp.metadata_io import load_metadata
from dcpstore.errors import DcpstoreError
from dcpstore.storage.backend import Backend, ObjectInfo
from dcpstore.storage.uri import is_reference, validate_key, validate_reference

__all__ = [
    "INCREMENTAL_DIR",
    "PINS_DIR",
    "RETIRED_KEY",
    "Pin",
    "RootListing",
    "delete_steps",
    "list_root",
    "mark_incremental",
    "read_pins",
    "reference_path",
    "referenced_keys",
    "remove_pin",
    "root_key",
    "run_root",
    "write_pin",
]

logger = logging.getLogger(__name__)

#: Directory (under the run root) of the pins of saves in progress.
PINS_DIR = ".dcpstore-pins"
#: Marker of a deleted step whose data files other steps still reference.
RETIRED_KEY = ".dcpstore-retired.json"
#: Directory whose presence marks a run root that has held incremental saves. Only under
#: such a root can a step's files be referenced by another, so retention elsewhere
#: deletes steps without reading the retained ones (see :func:`mark_incremental`).
INCREMENTAL_DIR = ".dcpstore-incremental"


def run_root(ckpt: Backend) -> tuple[Backend, str]:
    """The run root of a checkpoint (its parent, same backend and options) and the
    checkpoint's name in it.

    Raises:
        DcpstoreError: The checkpoint is at the top of its store (no parent).
    """
    location = ckpt.location.rstrip("/")
    parent, _, name = location.rpartition("/")
    if not parent or not name:
        raise DcpstoreError(
            f"{ckpt.uri} has no parent directory to share with other steps; incremental "
            "checkpoints live in sub-directories of a run root (e.g. run/step-000000100)"
        )
    return ckpt.at(parent), validate_key(name)


def root_key(step: str, path: str) -> str:
    """Key under the run root of ``path`` (a ``relative_path`` of step ``step``)."""
    if is_reference(path):
        sibling, name = validate_reference(path)
        return f"{sibling}/{name}"
    return f"{step}/{validate_key(path)}"


def reference_path(base_step: str, base_path: str) -> str:
    """The ``relative_path`` a new step uses for bytes that ``base_path`` of step
    ``base_step`` points at: into the step that wrote them, never a chain of ``..``."""
    if is_reference(base_path):
        validate_reference(base_path)
        return base_path
    return f"../{base_step}/{validate_key(base_path)}"


# -- pins --------------------------------------------------------------------------------


@dataclass
class Pin:
    """A save in progress and the steps whose files it may reference."""

    key: str
    save_id: str
    step: str
    steps: list[str]
    created: float
    mtime: float | None = None


def _pin_key(save_id: str) -> str:
    return f"{PINS_DIR}/{save_id.removeprefix('dcpstore-')}.json"


def write_pin(root: Backend, *, save_id: str, step: str, steps: Iterable[str]) -> str:
    """Pin ``steps`` for the save ``save_id`` of ``step`` (replaces its earlier pin)."""
    key = _pin_key(save_id)
    doc = {"save_id": save_id, "step": step, "steps": sorted(set(steps)),
           "created": time.time()}
    root.put(key, json.dumps(doc).encode(), atomic=True)
    return key


def mark_incremental(root: Backend) -> None:
    """Mark ``root`` as a run root that holds references (before the first pin of an
    incremental save, so no committed step references another under an unmarked root)."""
    root.put(f"{INCREMENTAL_DIR}/run.json",
             json.dumps({"references": True, "marked": time.time()}).encode(), atomic=True)


def remove_pin(root: Backend, save_id: str) -> None:
    """Remove the pin of ``save_id`` (quietly: ``gc`` removes what is left)."""
    try:
        root.delete([_pin_key(save_id)])
    except Exception as exc:
        logger.warning("could not remove the pin of save %s under %s (%s); `dcpstore gc` "
                       "will", save_id, root.uri, exc)


def read_pins(root: Backend) -> list[Pin]:
    """Every pin under ``root``. An unreadable pin protects nothing and is logged."""
    pins = []
    for obj in root.list(PINS_DIR + "/"):
        try:
            doc = json.loads(root.get(obj.key))
            steps = [validate_key(str(s)) for s in doc["steps"]]
            pins.append(Pin(obj.key, str(doc["save_id"]), str(doc["step"]), steps,
                            float(doc.get("created", 0.0)), obj.mtime))
        except FileNotFoundError:
            continue  # removed since the listing: its save committed or failed
        except Exception as exc:
            logger.warning("ignoring unreadable pin %s/%s (%s)", root.uri, obj.key, exc)
    return pins


# -- what a run root holds ---------------------------------------------------------------


@dataclass
class RootListing:
    """One listing of a run root, by step directory (direct sub-directories only)."""

    objects: dict[str, list[ObjectInfo]] = field(default_factory=dict)

    @property
    def committed(self) -> list[str]:
        """Directories holding a ``.metadata``."""
        return sorted(d for d, objs in self.objects.items()
                      if any(o.key == f"{d}/{layout.METADATA_KEY}" for o in objs))

    @property
    def retired(self) -> list[str]:
        """Directories of deleted steps that keep referenced files."""
        return sorted(d for d, objs in self.objects.items()
                      if any(o.key == f"{d}/{RETIRED_KEY}" for o in objs))


def list_root(root: Backend) -> RootListing:
    """List ``root`` once, grouping the objects of its direct sub-directories."""
    listing = RootListing()
    for obj in root.list():
        head, sep, name = obj.key.partition("/")
        if sep and "/" not in name and head != PINS_DIR:
            listing.objects.setdefault(head, []).append(obj)
    return listing


def referenced_keys(root: Backend, steps: Iterable[str]) -> set[str] | None:
    """Keys under ``root`` of the files that the committed ``steps`` reference in their
    siblings (read from each one's ``.metadata``); ``None`` when that cannot be told (a
    ``.metadata`` that cannot be read: then no referenced file may be deleted)."""
    needed: set[str] = set()
    for step in steps:
        ckpt = root.child(step)
        try:
            metadata = load_metadata(ckpt)[0]
        except FileNotFoundError:
            continue  # deleted since the listing: it needs nothing any more
        except Exception as exc:
            logger.warning("cannot tell which files %s references (%s); keeping every "
                           "data file of the steps being deleted", ckpt.uri, exc)
            return None
        finally:
            ckpt.close()
        for info in (metadata.storage_data or {}).values():
            if is_reference(info.relative_path):
                needed.add(root_key(step, info.relative_path))
    return needed


def _retired_save(root: Backend, step: str) -> str | None:
    try:
        return str(json.loads(root.get(f"{step}/{RETIRED_KEY}"))["save_id"])
    except FileNotFoundError:
        return None
    except Exception as exc:
        logger.warning("unreadable %s/%s/%s (%s)", root.uri, step, RETIRED_KEY, exc)
        return None


def delete_steps(root: Backend, steps: Iterable[str]) -> list[str]:
    """Delete checkpoints under a run root without breaking the ones that stay.

    Each step loses its ``.metadata`` first. Then every data file that a committed step
    references, or that a pin protects, is kept (its directory marked retired); the rest
    is deleted. Directories retired earlier whose files are no longer needed are
    cleaned up too.

    Returns:
        The keys deleted.
    """
    doomed = sorted(set(steps))
    saves: dict[str, str | None] = {}
    deleted: list[str] = []
    for step in doomed:
        key = f"{step}/{layout.METADATA_KEY}"
        try:
            saves[step] = layout.save_id_of_metadata(load_metadata(root.child(step))[0])
        except FileNotFoundError:
            saves[step] = None
        except Exception as exc:  # a damaged step is still deleted
            logger.warning("%s/%s: %s", root.uri, step, exc)
            saves[step] = None
        if root.exists(key):
            root.delete([key])
            deleted.append(key)
    # pins first, then committed steps: see the module docstring
    pinned = {s for pin in read_pins(root) for s in pin.steps}
    listing = list_root(root)
    needed = referenced_keys(root, listing.committed)
    committed = set(listing.committed)
    for step in sorted(set(doomed) | set(listing.retired)):
        if step in committed:
            continue  # saved again since: not ours to delete
        objs = listing.objects.get(step, [])
        retired_save = saves.get(step) if step in saves else _retired_save(root, step)
        if step not in saves and retired_save is None:
            continue
        mine = [o.key for o in objs if o.key != f"{step}/{RETIRED_KEY}"
                and (step in saves or layout.save_id_of(o.key) == retired_save)]
        if step in pinned:  # a save is reading it: its manifest too
            kept, doomed_keys = mine, []
        elif needed is None:
            kept = [k for k in mine if k.endswith(layout.DATA_SUFFIX)]
            doomed_keys = [k for k in mine if not k.endswith(layout.DATA_SUFFIX)]
        else:
            kept = [k for k in mine if k in needed]
            doomed_keys = [k for k in mine if k not in needed]
        if kept:
            save_id = retired_save or layout.save_id_of(kept[0]) or ""
            root.put(f"{step}/{RETIRED_KEY}",
                     json.dumps({"save_id": save_id, "files": len(kept)}).encode(),
                     atomic=True)
            logger.info("%s/%s: kept %d data files other steps reference", root.uri, step,
                        len(kept))
        else:
            doomed_keys.append(f"{step}/{RETIRED_KEY}")
        root.delete(doomed_keys)
        deleted += [k for k in doomed_keys if any(o.key == k for o in objs)]
        if not kept:
            ckpt = root.child(step)
            ckpt.remove_empty_dirs()
            ckpt.close()
    return deleted
