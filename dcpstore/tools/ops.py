"""Operations on whole checkpoints: list, inspect, verify, copy, remove, garbage-collect.

These are what the ``dcpstore`` CLI runs; they work on any backend. Byte-moving
operations take a ``progress`` callback receiving byte counts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pickle
import re
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcpstore.dcp import layout
from dcpstore.dcp.checksum import BlockCRCs, crc32c
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
from dcpstore.storage.backend import Backend, ObjectInfo, ReadRange
from dcpstore.storage.resolve import open_backend
from dcpstore.storage.uri import is_reference, validate_reference

__all__ = [
    "CheckpointInfo",
    "GcReport",
    "VerifyReport",
    "copy_checkpoint",
    "gc",
    "inspect_checkpoint",
    "list_checkpoints",
    "list_checkpoints_tiered",
    "remove_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

Progress = Callable[[int], None]
_CHUNK = 8 * 1024 * 1024
_STEP_RE = re.compile(r"(?:^|/)step-(\d+)$")
_RANK_RE = re.compile(r"^__(\d+)_")


def _noop(_: int) -> None:
    pass


@dataclass
class CheckpointInfo:
    """One checkpoint (or incomplete save) found under a root."""

    path: str
    committed: bool
    size: int
    files: int
    mtime: float | None
    step: int | None = None
    world_size: int | None = None
    #: With a local tier: where it is committed (``local``, ``remote``, ``both``).
    where: str | None = None
    #: A deleted step whose data files later (incremental) steps still reference.
    retired: bool = False


def _group_by_dir(objects: Iterable[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    groups: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        head, _, name = obj.key.rpartition("/")
        if layout.is_checkpoint_object(name):
            groups.setdefault(head, []).append(obj)
    return groups


def list_checkpoints(root_uri: str, **options: Any) -> list[CheckpointInfo]:
    """Checkpoints (committed or incomplete) under ``root_uri``, one listing."""
    root = open_backend(root_uri, **options)
    out = []
    listing = root.list()
    retired = {o.key.rpartition("/")[0] for o in listing
               if o.key.rpartition("/")[2] == RETIRED_KEY}
    for head, objs in sorted(_group_by_dir(listing).items()):
        committed = any(o.key.endswith(layout.METADATA_KEY) and
                        o.key.rpartition("/")[2] == layout.METADATA_KEY for o in objs)
        m = _STEP_RE.search(head)
        info = CheckpointInfo(
            path=head or ".",
            committed=committed,
            size=sum(o.size for o in objs),
            files=sum(o.key.endswith(".distcp") for o in objs),
            mtime=max((o.mtime for o in objs if o.mtime is not None), default=None),
            step=int(m.group(1)) if m else None,
            retired=head in retired and not committed,
        )
        if committed:
            ckpt = root.child(head) if head else root
            try:
                info.world_size = _world_size(ckpt, objs)
            except Exception as exc:  # listing must not fail on one damaged checkpoint
                logger.warning("%s: %s", head, exc)
        out.append(info)
    root.close()
    return out


def _world_size(ckpt: Backend, objs: list[ObjectInfo]) -> int | None:
    """The world size the manifest of a committed checkpoint records (``None``: another
    writer's checkpoint, which has none).

    The manifest is found as the one that records the size and CRC32C of the
    ``.metadata`` beside it, so ``.metadata`` is not unpickled, which would import torch
    (``dcpstore ls`` does not); only manifests older than that record fall back to the
    save id ``.metadata`` names.
    """
    names = sorted(name for name in (o.key.rpartition("/")[2] for o in objs)
                   if name.endswith(".json") and layout.save_id_of(name) is not None)
    if not names:
        return None
    raw = ckpt.get(layout.METADATA_KEY)
    digest = (len(raw), crc32c(raw))
    unrecorded = False
    for name in names:  # normally one; more while an overwrite or a failed save is there
        try:
            manifest = Manifest.from_bytes(ckpt.get(name), source=f"{ckpt.uri}/{name}")
        except (OSError, ValueError, DcpstoreError) as exc:  # another save's, damaged
            logger.debug("%s: %s", name, exc)
            continue
        if manifest.metadata is None:
            unrecorded = True
        elif (manifest.metadata.size, manifest.metadata.crc32c) == digest:
            return manifest.world_size
    if not unrecorded:
        raise IntegrityError(f"{ckpt.uri}/{layout.METADATA_KEY}: no manifest beside it "
                             "records it (`dcpstore verify` tells more)")
    save_id = getattr(load_metadata(ckpt)[0].storage_meta, "save_id", None)
    named = read_manifest(ckpt, save_id)
    return named.world_size if named else None


def list_checkpoints_tiered(root_uri: str, local_tier: str, **options: Any
                            ) -> list[CheckpointInfo]:
    """:func:`list_checkpoints` of a Checkpointer's root and its local tier, merged:
    ``where`` says whether each step is committed ``local``, ``remote`` or ``both``."""
    merged: dict[str, CheckpointInfo] = {}
    for info in list_checkpoints(root_uri, **options):
        info.where = "remote"
        merged[info.path] = info
    for info in list_checkpoints(local_tier):
        info.where = "local"
        known = merged.get(info.path)
        if known is None or (info.committed and not known.committed):
            merged[info.path] = info
        elif info.committed and known.committed:
            known.where = "both"
    return [merged[k] for k in sorted(merged)]


def inspect_checkpoint(uri: str, **options: Any) -> dict[str, Any]:
    """Keys, dtypes, shapes, sharding, files and versions of one checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    backend = open_backend(uri, **options)
    md = load_metadata(backend)[0]
    manifest = read_manifest(backend, getattr(md.storage_meta, "save_id", None))
    check_references(md, manifest, source=f"{backend.uri}/.metadata")
    ranks_by_key: dict[str, set[int]] = {}
    referenced = 0
    for index, info in (md.storage_data or {}).items():
        if is_reference(info.relative_path):
            referenced += info.length
        m = _RANK_RE.match(info.relative_path.rpartition("/")[2])
        if m:
            ranks_by_key.setdefault(index.fqn, set()).add(int(m.group(1)))
    keys = []
    total = 0
    for fqn, item in sorted(md.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            nbytes = math.prod(item.size) * item.properties.dtype.itemsize
            total += nbytes
            keys.append({"key": fqn, "kind": "tensor", "dtype": str(item.properties.dtype)
                         .removeprefix("torch."), "shape": list(item.size), "bytes": nbytes,
                         "chunks": len(item.chunks), "ranks": len(ranks_by_key.get(fqn, ()))})
        else:
            keys.append({"key": fqn, "kind": "object", "dtype": None, "shape": None,
                         "bytes": None, "chunks": 1, "ranks": len(ranks_by_key.get(fqn, ()))})
    files = ({k: v.size for k, v in sorted(manifest.files.items())} if manifest else
             {o.key: o.size for o in backend.list("__")
              if o.key in {i.relative_path for i in (md.storage_data or {}).values()}})
    backend.close()
    return {
        "uri": uri,
        "save_id": getattr(md.storage_meta, "save_id", None),
        "world_size": manifest.world_size if manifest else len(
            {r for rs in ranks_by_key.values() for r in rs}),
        "dcpstore_version": manifest.dcpstore_version if manifest else None,
        "torch_version": manifest.torch_version if manifest else None,
        "created": manifest.created if manifest else None,
        "tensor_bytes": total,
        "stored_bytes": sum(files.values()),
        # an incremental checkpoint: bytes its items read from sibling steps
        "referenced_bytes": referenced,
        "referenced_files": ({k: v.size for k, v in sorted(manifest.references.items())}
                             if manifest else {}),
        "keys": keys,
        "files": files,
        "verified_by_manifest": manifest is not None,
    }


@dataclass
class VerifyReport:
    """What ``verify`` checked and what it found."""

    uri: str
    files: int = 0
    items: int = 0
    bytes: int = 0
    seconds: float = 0.0
    has_manifest: bool = True
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _ordered_chunks(backend: Backend, key: str, start: int, length: int) -> Iterator[memoryview]:
    """The bytes of ``key[start:start+length]`` in order, fetched concurrently in chunks."""
    ranges = [ReadRange(key, off, min(_CHUNK, start + length - off))
              for off in range(start, start + length, _CHUNK)]
    waiting: dict[int, memoryview] = {}
    nxt = 0
    for index, buf in backend.read_ranges(ranges):
        waiting[index] = buf
        while nxt in waiting:
            yield waiting.pop(nxt)
            nxt += 1


def verify_checkpoint(uri: str, *, progress: Progress = _noop, concurrency: int = 4,
                      **options: Any) -> VerifyReport:
    """Re-read every data file and check sizes and CRC32C against the manifest."""
    started = time.perf_counter()
    backend = open_backend(uri, **options)
    try:
        report = _verify(backend, uri, progress, concurrency)
    finally:
        backend.close()
    report.seconds = time.perf_counter() - started
    return report


def _verify(backend: Backend, uri: str, progress: Progress, concurrency: int) -> VerifyReport:
    report = VerifyReport(uri)
    md, raw = load_metadata(backend)
    source = f"{backend.uri}/.metadata"
    manifest = read_manifest(backend, layout.save_id_of_metadata(md, source=source),
                              required=True)
    names = {(i.relative_path, i.offset): idx.fqn for idx, i in (md.storage_data or {}).items()}
    check_references(md, manifest, source=source)  # a reference the save did not make
    if manifest is not None:
        try:
            manifest.check_metadata(raw, source=source)
        except IntegrityError as exc:
            report.errors.append(str(exc))
        for index, info in (md.storage_data or {}).items():  # as the reader checks them
            try:
                known = manifest.item_crc(info.relative_path, info.offset, info.length)
            except IntegrityError as exc:
                report.errors.append(str(exc))
                continue
            if known is None:
                report.errors.append(f"{info.relative_path}: item {index.fqn!r} at offset "
                                     f"{info.offset} named by .metadata is not in the manifest")
    if manifest is None:
        report.has_manifest = False
        expected = {i.relative_path for i in (md.storage_data or {}).values()}
        records = {}
        for path in sorted(expected):
            try:
                size = backend.stat(path).size
            except FileNotFoundError:
                report.errors.append(f"{path}: missing")
                continue
            records[path] = FileRecord(size, -1, [])
    else:
        records = dict(manifest.files)
        records.update(manifest.references)  # follow references into sibling steps
    root_of = _reference_source(backend, records)

    block = manifest.payload_block if manifest is not None else 0

    def check(path: str, rec: FileRecord) -> tuple[int, int, list[str]]:
        errors: list[str] = []
        store, key = root_of(path)
        try:
            size = store.stat(key).size
        except FileNotFoundError:
            held = [names[(path, o)] for o, _, _ in rec.items if (path, o) in names]
            return 0, 0, [f"{path}: missing" + (f" (holds items {', '.join(map(repr, held))})"
                                                 if held else "")]
        if size != rec.size:
            errors.append(f"{path}: size {size}, manifest says {rec.size}")
        file_crc = 0
        items = sorted(rec.items) or [(0, size, -1)]
        pos = 0
        for offset, length, item_crc in items:
            if offset != pos:
                errors.append(f"{path}: bytes {pos}-{offset} are not covered by any item")
            crc = 0
            payload = rec.payloads.get(offset)
            blocks = (BlockCRCs(block)
                      if payload is not None and payload.block_crcs and block else None)
            try:
                at = offset
                for chunk in _ordered_chunks(store, key, offset, length):
                    crc = crc32c(chunk, crc)
                    file_crc = crc32c(chunk, file_crc)
                    if blocks is not None and payload is not None:  # its payload's bytes
                        lo = max(at, offset + payload.start)
                        hi = min(at + len(chunk), offset + payload.start + payload.nbytes)
                        if lo < hi:
                            blocks.feed(memoryview(chunk)[lo - at : hi - at])
                    at += len(chunk)
                    progress(len(chunk))
            except OSError as exc:
                errors.append(f"{path}: item {names.get((path, offset), '?')!r} unreadable: "
                              f"{exc}")
                return len(items), pos, errors
            if item_crc >= 0 and crc != item_crc:
                errors.append(
                    f"{path}: CRC32C mismatch in item {names.get((path, offset), '?')!r} "
                    f"(bytes {offset}-{offset + length}): expected {item_crc:08x}, got {crc:08x}"
                )
            elif blocks is not None and payload is not None:
                # the block CRCs reshard loads verify against must match the bytes too
                bad = [i for i, (want, got) in enumerate(
                    zip(payload.block_crcs, blocks.result(), strict=False)) if want != got]
                if bad or len(blocks.result()) != len(payload.block_crcs):
                    errors.append(
                        f"{path}: item {names.get((path, offset), '?')!r}: the manifest's "
                        f"payload block CRC32Cs do not match the data (blocks {bad[:5]}); the "
                        "manifest was modified after the save"
                    )
            pos = offset + length
        if rec.crc32c >= 0 and file_crc != rec.crc32c and not errors:
            errors.append(f"{path}: file CRC32C {file_crc:08x}, manifest says {rec.crc32c:08x}")
        return len(items), pos, errors

    try:
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            for n_items, n_bytes, errors in pool.map(lambda kv: check(*kv),
                                                     sorted(records.items())):
                report.files += 1
                report.items += n_items
                report.bytes += n_bytes
                report.errors += errors
    finally:
        store = root_of("")[0]
        if store is not backend:
            store.close()
    return report


def _reference_source(backend: Backend, paths: Iterable[str]
                      ) -> Callable[[str], tuple[Backend, str]]:
    """Where each ``relative_path`` of a checkpoint is read: the checkpoint's own
    backend, or, for references into sibling steps, the run root."""
    if not any(is_reference(p) for p in paths):
        return lambda path: (backend, path)
    root, name = run_root(backend)

    def source(path: str) -> tuple[Backend, str]:
        if not path:
            return root, path
        return (root, root_key(name, path)) if is_reference(path) else (backend, path)

    return source


def copy_checkpoint(src: str, dst: str, *, progress: Progress = _noop, concurrency: int = 4,
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
    where = _reference_source(source, paths)
    written: list[str] = []

    def copy_one(path: str) -> int:
        store, key = where(path)
        name = validate_reference(path)[1] if is_reference(path) else path
        size = store.stat(key).size
        rec = manifest.record(path) if manifest else None
        crc = 0
        with target.open_upload(name) as up:
            written.append(name)
            for chunk in _ordered_chunks(store, key, 0, size):
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
    groups = _group_by_dir(listing)
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
