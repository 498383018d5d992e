"""Incremental saves, at save time: the base a save may reference, and which of this
rank's tensor chunks are unchanged since it.

The coordinator pins and reads the base (:func:`_open_base`, following the order that
:mod:`dcpstore.dcp.references` sets out), sends each rank the base's copies of the chunks
it saves, and before the commit checks every referenced file is still there, whole
(:func:`_check_referenced`). A rank writes a reference instead of a chunk's bytes when
the base's copy has the same size, dtype, shape and XXH3-128 (:func:`_unchanged`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import WriteItem

from dcpstore import errors
from dcpstore.dcp import layout
from dcpstore.dcp import references as refs
from dcpstore.dcp.manifest import FileRecord, Payload
from dcpstore.dcp.metadata_io import load_metadata, read_manifest
from dcpstore.dcp.read_plan import chunk_index
from dcpstore.storage.backend import Backend
from dcpstore.storage.resolve import open_backend
from dcpstore.storage.uri import validate_reference

__all__ = ["payload_digest"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _BaseItem:
    """A tensor chunk of the base checkpoint an incremental save may reference."""

    path: str  # relative_path from the new checkpoint (into the step holding the bytes)
    offset: int
    length: int
    crc32c: int
    payload: Payload
    dtype: torch.dtype
    sizes: tuple[int, ...]


#: ``(fqn, chunk offsets)`` of a tensor chunk.
_ChunkKey = tuple[str, tuple[int, ...]]


@dataclass
class _Base:
    """The coordinator's view of the base of an incremental save."""

    root: Backend  # the run root
    name: str  # this checkpoint's directory in it
    save_id: str  # the save that pinned it
    items: dict[_ChunkKey, _BaseItem]
    records: dict[str, FileRecord]  # by reference path


def payload_digest(tensor: torch.Tensor) -> str:
    """XXH3-128 of a contiguous CPU tensor's bytes, as 32 hex digits."""
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(raw.data)


def _chunk_key(fqn: str, offsets: Sequence[int] | None) -> _ChunkKey:
    return fqn, tuple(int(o) for o in (offsets or ()))


def _frozen_keys(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset(k.strip() for k in value.split(",") if k.strip())
    return frozenset(value or ())


def _open_base(backend: Backend, uri: str, *, save_id: str, base_required: bool,
               rebind: Callable[[str], Backend] | None) -> _Base:
    """Coordinator: pin and read the base at ``uri`` of an incremental save to
    ``backend`` (see :mod:`dcpstore.dcp.references` for the order of the steps and
    why). A base without usable chunks is returned empty: the save is then in full."""
    root, name = refs.run_root(backend)
    base_backend = rebind(uri) if rebind is not None else open_backend(uri)
    base = _Base(root, name, save_id, {}, {})
    pinned = False
    try:
        base_root, base_name = refs.run_root(base_backend)
        if type(base_root) is not type(root) or base_root.location != root.location:
            raise errors.DcpstoreError(
                f"the base {base_backend.uri} of an incremental save to "
                f"{backend.uri} must be a sibling under the same run root "
                f"({root.uri}); references cannot leave the run root"
            )
        if base_name == name:
            raise errors.DcpstoreError(f"the base of an incremental save cannot be its own "
                                       f"target ({backend.uri})")
        refs.mark_incremental(root)
        refs.write_pin(root, save_id=save_id, step=name, steps=[base_name])
        pinned = True  # from here on, failures remove the pin
        try:
            metadata, raw = load_metadata(base_backend)
        except errors.CheckpointNotFoundError:
            if base_required:
                raise errors.CheckpointNotFoundError(
                    f"the base {base_backend.uri} of the incremental save to "
                    f"{backend.uri} is not a committed checkpoint") from None
            logger.warning("base %s is gone; saving %s in full", base_backend.uri,
                           backend.uri)
            return base
        source = f"{base_backend.uri}/.metadata"
        manifest = read_manifest(base_backend, layout.save_id_of_metadata(
            metadata, source=source), required=True)
        if manifest is None:
            logger.warning("base %s was not written by dcpstore (no content hashes); "
                           "saving %s in full", base_backend.uri, backend.uri)
            return base
        manifest.check_metadata(raw, source=source)
        holders = {validate_reference(p)[0] for p in manifest.references}
        if holders:
            refs.write_pin(root, save_id=save_id, step=name, steps=[base_name, *holders])
        try:  # unchanged since it was pinned, so a retention run cannot have missed it
            still = base_backend.get(layout.METADATA_KEY) == raw
        except FileNotFoundError:
            still = False
        if not still:
            logger.warning("base %s was deleted or replaced while the save to %s "
                           "started; saving in full", base_backend.uri, backend.uri)
            return base
        chunks = chunk_index(metadata)
        for index, info in (metadata.storage_data or {}).items():
            chunk = chunks.get(_chunk_key(index.fqn, index.offset))
            payload = manifest.item_payload(info.relative_path, info.offset)
            record = manifest.record(info.relative_path)
            if (chunk is None or payload is None or not payload.digest
                    or record is None or info.transform_descriptors):
                continue
            crc = manifest.item_crc(info.relative_path, info.offset, info.length)
            if crc is None:
                continue
            path = refs.reference_path(base_name, info.relative_path)
            if validate_reference(path)[0] == name:
                continue  # bytes in this very directory: an overwrite may delete them
            base.records[path] = record
            base.items[_chunk_key(index.fqn, index.offset)] = _BaseItem(
                path, info.offset, info.length, crc, payload, chunk[0], chunk[1])
        logger.info("incremental save to %s: base %s, %d candidate chunks",
                    backend.uri, base_backend.uri, len(base.items))
        return base
    except BaseException:
        if pinned:
            _close_base(base)  # removes the pin, closes the root
        else:
            root.close()
        raise
    finally:
        base_backend.close()


def _close_base(base: _Base | None) -> None:
    """Remove the pin of the save that opened ``base`` and close its run root."""
    if base is not None:
        refs.remove_pin(base.root, base.save_id)
        base.root.close()


def _check_referenced(base: _Base, references: dict[str, FileRecord]) -> None:
    """Before the commit: every referenced file is still there, whole."""
    for path, record in sorted(references.items()):
        key = refs.root_key(base.name, path)
        try:
            size = base.root.stat(key).size
        except FileNotFoundError:
            size = -1
        if size != record.size:
            raise errors.IntegrityError(
                f"{base.root.uri}/{key}, which this incremental save references, "
                f"is {'gone' if size < 0 else f'{size} bytes, not {record.size}'}; "
                "nothing was committed. Save again (in full, or with another base)"
            )


def _unchanged(item: WriteItem, tensor: torch.Tensor, base: dict[_ChunkKey, _BaseItem] | None,
               frozen: frozenset[str]) -> tuple[_BaseItem | None, str]:
    """The base's copy of this tensor chunk if it is the same (size, dtype, shape and
    XXH3-128; not hashed for keys in ``frozen``, which the caller marked so), and the
    hash computed on the way (``""``: none)."""
    if not base or item.tensor_data is None:
        return None, ""
    same = base.get(_chunk_key(item.index.fqn, item.index.offset))
    if (same is None or same.dtype != tensor.dtype or same.payload.nbytes != tensor.nbytes
            or same.sizes != tuple(item.tensor_data.chunk.sizes)
            or tuple(tensor.shape) != same.sizes):
        return None, ""
    if item.index.fqn in frozen:
        return same, same.payload.digest
    digest = payload_digest(tensor)
    return (same if digest == same.payload.digest else None), digest
