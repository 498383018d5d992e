"""Changing checkpoints: ``dcpstore cp``, ``dcpstore rm`` and ``dcpstore gc``.

:func:`copy_checkpoint` streams a checkpoint between any two backends (``.metadata``
last); :func:`remove_checkpoint` deletes one, keeping data files that sibling steps
reference; :func:`gc` removes incomplete saves, unreferenced files and dangling
multipart uploads under a root. Re-exported by :mod:`dcpstore.tools.ops`.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcpstore.dcp import layout
from dcpstore.dcp.checksum import crc32c
from dcpstore.dcp.manifest import SAVE_ID_PREFIX, FileRecord, Manifest
from dcpstore.dcp.metadata_io import check_references, load_metadata, read_manifest, references_in
from dcpstore.dcp.references import (
    PINS_DIR,
    RETIRED_KEY,
    delete_steps,
    list_root,
    read_pins,
    referenced_keys,
    root_key,
    run_root,
)
from dcpstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DcpstoreError,
    IntegrityError,
)
from dcpstore.storage.resolve import open_backend
from dcpstore.storage.uri import is_reference, validate_reference
from dcpstore.tools.listing import group_by_dir
from dcpstore.tools.verify import Progress, no_progress, ordered_chunks, reference_source

__all__ = ["GcReport", "copy_checkpoint", "gc", "remove_checkpoint"]

logger = logging.getLogger("dcpstore.tools.ops")  # where the tools always logged


def copy_checkpoint(src: str, dst: str, *, progress: Progress = no_progress, concurrency: int = 4,
                    overwrite: bool = False, keep_references: bool = False,
                    src_options: dict[str, Any] | None = None,
                    dst_options: dict[str, Any] | None = None) -> int:
    """Stream a checkpoint from ``src`` to ``dst`` (any two backends); return bytes copied.

    Data files and the manifest are copied first (CRC32C checked on the way), ``.metadata``
    last, so an interrupted copy is never mistaken for a checkpoint.

    An incremental checkpoint (one that references files of sibling steps) is copied
    self-contained: the referenced files are copied next to its own and ``.metadata``
    and the manifest are rewritten to point at them. ``keep_references=True`` copies
    only its own files and keeps the references, which then resolve against ``dst``'s
    siblings (for copying a whole run, step by step, oldest first).
    """
    source = open_backend(src, **(src_options or {}))
    target = open_backend(dst, **(dst_options or {}))
    md, md_raw = load_metadata(source)
    if target.exists(layout.METADATA_KEY) and not overwrite:
        raise CheckpointExistsError(f"Checkpoint already exists at {target.uri}; pass "
                                    "--overwrite to replace it")
    save_id = str(layout.save_id_of_metadata(md, source=f"{source.uri}/.metadata"))
    manifest = read_manifest(source, save_id, required=True)
    if manifest is not None:
        manifest.check_metadata(md_raw, source=f"{source.uri}/.metadata")
    check_references(md, manifest, source=f"{source.uri}/.metadata")
    paths = sorted({i.relative_path for i in (md.storage_data or {}).values()})
    manifest_raw = source.get(layout.manifest_key(save_id)) if manifest is not None else b""
    if manifest is not None and manifest.references and not keep_references:
        md_raw, manifest_raw = _self_contained(md_raw, manifest)
    elif keep_references:
        paths = [p for p in paths if not is_reference(p)]
    where = reference_source(source, paths)
    written: list[str] = []

    def copy_one(path: str) -> int:
        store, key = where(path)
        name = validate_reference(path)[1] if is_reference(path) else path
        size = store.stat(key).size
        rec = manifest.record(path) if manifest else None
        crc = 0
        with target.open_upload(name) as up:
            written.append(name)
            for chunk in ordered_chunks(store, key, 0, size):
                up.write(chunk)
                crc = crc32c(chunk, crc)
                progress(len(chunk))
            if rec is not None and (rec.size != size or rec.crc32c != crc):
                raise IntegrityError(f"{store.uri}/{key}: CRC32C/size mismatch while copying; "
                                     "the source is damaged (run `dcpstore verify`)")
            up.commit()
        return size

    copied = 0
    try:
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            copied = sum(pool.map(copy_one, paths))
        if manifest is not None:
            target.put(layout.manifest_key(save_id), manifest_raw)
        target.put(layout.METADATA_KEY, md_raw, atomic=True)
    except BaseException:
        target.delete([*written, *([layout.manifest_key(save_id)] if manifest else [])])
        raise
    finally:
        root = where("")[0]
        if root is not source:
            root.close()
        source.close()
        target.close()
    return copied


def _self_contained(md_raw: bytes, manifest: Manifest) -> tuple[bytes, bytes]:
    """``.metadata`` and manifest of a copy that holds the referenced files itself."""
    from dcpstore.dcp.safe_pickle import safe_loads

    metadata = safe_loads(md_raw, source=".metadata")
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=validate_reference(
            info.relative_path)[1]) if is_reference(info.relative_path) else info
        for index, info in metadata.storage_data.items()
    }
    raw = pickle.dumps(metadata)
    files = dict(manifest.files)
    for path, record in manifest.references.items():
        files[validate_reference(path)[1]] = record
    copy = dataclasses.replace(manifest, files=files, references={},
                               metadata=FileRecord(len(raw), crc32c(raw)), _item_index=None)
    return raw, copy.to_bytes()


def remove_checkpoint(uri: str, *, dry_run: bool = False, **options: Any) -> list[str]:
    """Delete a checkpoint, ``.metadata`` first; return the keys (to be) deleted.

    Data files that sibling steps under the same run root (the parent directory)
    reference are kept until no committed step references them (see
    :func:`dcpstore.dcp.references.delete_steps`). Keys of retired siblings removed on the
    way are returned as ``../<step>/<key>``.
    """
    from dcpstore.training.checkpointer import delete_checkpoint

    backend = open_backend(uri, **options)
    try:
        keys = [o.key for o in backend.list() if layout.is_checkpoint_object(o.key)
                and "/" not in o.key]
        if not keys:
            raise CheckpointNotFoundError(f"no checkpoint at {backend.uri}")
        try:
            root, name = run_root(backend)
        except DcpstoreError:  # at the top of its store: no siblings can reference it
            if not dry_run:
                delete_checkpoint(backend)
            return sorted(keys)
        try:
            if not dry_run:
                deleted = delete_steps(root, [name])
            else:
                listing = list_root(root)
                needed = referenced_keys(root, [s for s in listing.committed if s != name])
                pinned = {s for pin in read_pins(root) for s in pin.steps}
                deleted = [k for k in (f"{name}/{k}" for k in keys)
                           if name not in pinned and k not in (needed or ())
                           and not (needed is None and k.endswith(layout.DATA_SUFFIX))]
            # this checkpoint's keys as before; retired siblings cleaned up on the way
            # as ../<step>/<key>
            return sorted(k.removeprefix(f"{name}/") if k.startswith(f"{name}/") else f"../{k}"
                          for k in deleted)
        finally:
            root.close()
    finally:
        backend.close()


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove with ``dry_run``)."""

    objects: list[str] = field(default_factory=list)
    bytes: int = 0
    uploads: list[tuple[str, str]] = field(default_factory=list)


def gc(root_uri: str, *, dry_run: bool = False, min_age: float = 3600.0,
       **options: Any) -> GcReport:
    """Remove incomplete saves, unreferenced files and dangling multipart uploads.

    A file counts as garbage when no committed ``.metadata`` references it (in its own
    directory, or from a sibling step: an incremental checkpoint), no pin of a save in
    progress protects its directory, and it is older than ``min_age`` seconds, so saves
    still in progress are left alone. Pins older than ``min_age`` (left by a save that
    crashed) are garbage too.
    """
    root = open_backend(root_uri, **options)
    report = GcReport()
    now = time.time()
    listing = root.list()
    # pins first, then committed steps (see dcpstore.dcp.references)
    pinned: set[str] = set()
    for obj in listing:
        head, _, name = obj.key.rpartition("/")
        if head.rpartition("/")[2] != PINS_DIR or not name.endswith(".json"):
            continue
        if obj.mtime is not None and now - obj.mtime >= min_age:
            report.objects.append(obj.key)  # a crashed save's pin
            report.bytes += obj.size
            continue
        parent = head.rpartition("/")[0]
        run = root.child(parent) if parent else root
        pinned |= {f"{parent}/{s}".lstrip("/") for pin in read_pins(run) for s in pin.steps}
    groups = group_by_dir(listing)
    retired = {o.key.rpartition("/")[0]: o for o in listing
               if o.key.rpartition("/")[2] == RETIRED_KEY}
    keep: dict[str, set[str]] = {}
    needed: set[str] = set()  # keys under root that committed steps reference
    # run roots holding a step whose references cannot be read: keep their data files
    unknown: set[str] = set()
    for head, objs in sorted(groups.items()):
        if layout.METADATA_KEY not in {o.key.rpartition("/")[2] for o in objs}:
            continue
        ckpt = root.child(head) if head else root
        try:
            md = load_metadata(ckpt)[0]
        except Exception as exc:
            logger.warning("gc: skipping %s, and keeping the data files beside it that it "
                           "may reference: %s", ckpt.uri, exc)
            keep[head] = {o.key.rpartition("/")[2] for o in objs}
            unknown.add(head.rpartition("/")[0])
            continue
        mine = {i.relative_path for i in (md.storage_data or {}).values()}
        mine.add(layout.METADATA_KEY)
        save_id = getattr(md.storage_meta, "save_id", None)
        if isinstance(save_id, str) and save_id.startswith(SAVE_ID_PREFIX):
            mine.add(layout.manifest_key(save_id))
        keep[head] = mine
        if head and references_in(md):
            parent, _, name = head.rpartition("/")
            needed |= {f"{parent}/{root_key(name, p)}".lstrip("/") for p in references_in(md)}
    for head, objs in sorted(groups.items()):
        for obj in objs:
            name = obj.key.rpartition("/")[2]
            if name in keep.get(head, ()) or obj.key in needed:
                continue
            if name.endswith(layout.DATA_SUFFIX) and head.rpartition("/")[0] in unknown:
                continue
            if head in pinned:  # a save in progress reads or references it
                continue
            if obj.mtime is not None and now - obj.mtime < min_age:
                continue
            report.objects.append(obj.key)
            report.bytes += obj.size
    doomed = set(report.objects)
    for head, marker in retired.items():
        if not any(o.key.endswith(layout.DATA_SUFFIX) and o.key not in doomed
                   for o in groups.get(head, [])):
            report.objects.append(marker.key)  # nothing referenced is left there
            report.bytes += marker.size
    report.uploads = root.list_uploads()
    if not dry_run:
        root.delete(report.objects)
        if report.uploads:
            root.abort_uploads(report.uploads)
        if report.objects:
            for head in {k.rpartition("/")[0] for k in report.objects if "/" in k}:
                root.child(head).remove_empty_dirs()
    root.close()
    return report
