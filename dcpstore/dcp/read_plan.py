"""Read planning: which bytes of which files a load fetches, in which requests.

Pure functions over DCP's read items, ``.metadata`` and the integrity manifest; nothing
here touches a store, so all of it is unit-testable on its own.

1. :func:`plan_item` decides what one read item needs: the whole item, or, on a reshard
   (N -> M) that needs only a box of a saved chunk, just the whole payload blocks around
   that box (a :class:`BlockSpan`), which the manifest's per-block CRC32Cs can verify.
2. :func:`coalesce` groups the requests by file, sorts them by offset and merges
   neighbours into :class:`CoalescedRange` s, one range request each.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcpstore.dcp.manifest import Manifest, Payload
from dcpstore.errors import IntegrityError
from dcpstore.torch_internals import StorageInfo, element_size

__all__ = [
    "BlockSpan",
    "ChunkIndex",
    "CoalescedRange",
    "ItemRead",
    "chunk_index",
    "coalesce",
    "plan_item",
    "plan_reads",
]

#: ``(fqn, chunk offsets) -> (dtype, chunk sizes)`` of every saved tensor chunk.
ChunkIndex = dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]


def chunk_index(metadata: Metadata, wanted: Iterable[MetadataIndex] | None = None
                ) -> ChunkIndex:
    """The dtype and size of saved tensor chunks, by fqn and chunk offsets.

    Args:
        metadata: The checkpoint's ``.metadata``.
        wanted: Index only these chunks (the ``storage_index`` of a plan's read items),
            so that a rank holds an entry per chunk it reads, not per chunk of the
            checkpoint; ``None``: every chunk.
    """
    state = metadata.state_dict_metadata
    if wanted is None:
        return {
            (fqn, tuple(chunk.offsets)): (md.properties.dtype, tuple(chunk.sizes))
            for fqn, md in state.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }
    out: ChunkIndex = {}
    for index in wanted:
        md = state.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            continue
        offsets = tuple(index.offset or ())
        key = (index.fqn, offsets)
        if key in out:
            continue
        hint = index.index
        found: ChunkStorageMetadata | None
        if hint is not None and 0 <= hint < len(md.chunks) and tuple(
                md.chunks[hint].offsets) == offsets:
            found = md.chunks[hint]  # DCP's planners set the chunk's position as a hint
        else:
            found = next((c for c in md.chunks if tuple(c.offsets) == offsets), None)
        if found is not None:
            out[key] = (md.properties.dtype, tuple(found.sizes))
    return out


@dataclass
class BlockSpan:
    """The part of a tensor item's payload a reshard request needs.

    ``first``/``stop`` delimit the requested box, from its first to its last element,
    and ``lo``/``hi`` the whole blocks around it that are fetched and verified: byte
    offsets into the payload.
    """

    payload: Payload
    block: int
    dtype: torch.dtype
    strides: tuple[int, ...]  # row-major element strides of the saved chunk
    first: int
    stop: int
    lo: int
    hi: int
    contiguous: bool  # the box is one run of bytes (e.g. rows of a dim-0 shard)


@dataclass
class ItemRead:
    """One read item and the bytes of its file that serve it: the whole item, or (see
    :class:`BlockSpan`) whole blocks of its payload."""

    req: ReadItem
    info: StorageInfo
    offset: int
    length: int
    partial: BlockSpan | None = None

    @property
    def needed(self) -> int:
        """Bytes the load needs from this request (the box, for a partial one)."""
        return self.length if self.partial is None else self.partial.stop - self.partial.first


@dataclass
class CoalescedRange:
    """A coalesced request and the items it carries."""

    key: str
    offset: int
    length: int
    items: list[ItemRead] = field(default_factory=list)


def plan_item(req: ReadItem, info: StorageInfo, manifest: Manifest | None,
              chunks: ChunkIndex) -> ItemRead:
    """What to fetch for one read item: the whole item, or only the payload blocks
    around the box it needs (a reshard load that needs part of a saved chunk).

    Only the blocks are fetched when the manifest records the item's payload with block
    CRCs, the payload is the chunk's raw little-endian bytes and the box leaves at least
    one block out; anything else reads the whole item.
    """
    whole = ItemRead(req, info, info.offset, info.length)
    if (manifest is None or not manifest.payload_block or req.type != LoadItemType.TENSOR
            or info.transform_descriptors or sys.byteorder != "little"):
        return whole
    chunk = chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
    payload = manifest.item_payload(info.relative_path, info.offset)
    if chunk is None or payload is None or not payload.block_crcs:
        return whole
    dtype, sizes = chunk
    offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
    if (len(offsets) != len(sizes) or len(lengths) != len(sizes)
            or (not any(offsets) and lengths == sizes) or 0 in lengths
            or any(o < 0 or o + n > size
                   for o, n, size in zip(offsets, lengths, sizes, strict=True))):
        return whole
    itemsize = element_size(dtype)
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    numel = strides[0] * sizes[0] if sizes else 1
    block = manifest.payload_block
    if (numel * itemsize != payload.nbytes
            or len(payload.block_crcs) != -(-payload.nbytes // block)
            or payload.start < 0 or payload.start + payload.nbytes > info.length):
        return whole
    # the box's first and last element, as byte offsets into the payload
    first = sum(o * st for o, st in zip(offsets, strides, strict=True)) * itemsize
    last = sum((o + n - 1) * st for o, n, st in zip(offsets, lengths, strides, strict=True))
    stop = (last + 1) * itemsize
    lo = first // block * block
    hi = min(-(-stop // block) * block, payload.nbytes)
    if hi - lo >= payload.nbytes:
        return whole  # the box spans (nearly) every block: read and verify the item
    box = itemsize
    for n in lengths:
        box *= n
    span = BlockSpan(payload, block, dtype, tuple(strides), first, stop, lo, hi,
                     contiguous=stop - first == box)
    return ItemRead(req, info, info.offset + payload.start + lo, hi - lo, span)


def plan_reads(items: Iterable[ReadItem], storage_data: Mapping[MetadataIndex, StorageInfo],
               manifest: Manifest | None, chunks: ChunkIndex, *, uri: str
               ) -> list[ItemRead]:
    """:func:`plan_item` for every item of a load plan.

    Raises:
        IntegrityError: ``.metadata`` (of the checkpoint at ``uri``) has no storage entry
            for an item.
    """
    requests = []
    for req in items:
        info = storage_data.get(req.storage_index)
        if info is None:
            raise IntegrityError(
                f"{uri}/.metadata has no storage entry for {req.storage_index.fqn!r}"
            )
        requests.append(plan_item(req, info, manifest, chunks))
    return requests


def coalesce(requests: Sequence[ItemRead], gap: int, max_range: int) -> list[CoalescedRange]:
    """Group read requests by file, sort by offset and merge neighbours into ranges.

    Args:
        requests: What to read.
        gap: Neighbours at most this many bytes apart are fetched as one range (the gap
            is fetched and dropped).
        max_range: No merged range grows beyond this many bytes (a single larger
            request stays whole).
    """
    per_file: dict[str, list[ItemRead]] = {}
    for request in requests:
        per_file.setdefault(request.info.relative_path, []).append(request)
    ranges: list[CoalescedRange] = []
    for key in sorted(per_file):
        current: CoalescedRange | None = None
        for request in sorted(per_file[key], key=lambda r: (r.offset, r.length)):
            end = request.offset + request.length
            if (
                current is not None
                and request.offset - (current.offset + current.length) <= gap
                and max(end, current.offset + current.length) - current.offset <= max_range
            ):
                current.length = max(end, current.offset + current.length) - current.offset
            else:
                current = CoalescedRange(key, request.offset, request.length)
                ranges.append(current)
            current.items.append(request)
    return ranges
