"""Read planning on its own: no backend, no files, no ``dcp.load``.

Coalescing of neighbours and gaps, the ``max_range`` cap, block-aligned partial reads of
a reshard, the geometry of reshard boxes, and every case that falls back to reading the
whole item.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcpstore.dcp.manifest import FileRecord, Manifest, Payload
from dcpstore.dcp.read_plan import (
    BlockSpan,
    ChunkIndex,
    ItemRead,
    chunk_index,
    coalesce,
    plan_item,
    plan_reads,
)
from dcpstore.errors import IntegrityError

FILE = "__0_0.0123456789abcdef.distcp"
BLOCK = 64
HEADER = 100  # bytes of archive before the payload, in these made-up items


def _item(fqn: str, offsets: tuple[int, ...] = (), lengths: tuple[int, ...] = (),
          chunk: tuple[int, ...] = (), kind: LoadItemType = LoadItemType.TENSOR) -> ReadItem:
    return ReadItem(type=kind, dest_index=MetadataIndex(fqn), dest_offsets=torch.Size(offsets),
                    storage_index=MetadataIndex(fqn, torch.Size(chunk) if chunk else None),
                    storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))


def _whole(path: str, offset: int, length: int) -> ItemRead:
    return ItemRead(_item(f"{path}@{offset}"), _StorageInfo(path, offset, length), offset,
                    length)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, at: int = 0,
            block: int = BLOCK) -> tuple[_StorageInfo, Manifest, ChunkIndex]:
    """A saved chunk ``w`` of ``shape`` at offset ``at`` of FILE, with block CRCs."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    length = HEADER + nbytes + 50
    blocks = tuple(range(-(-nbytes // block)))
    record = FileRecord(at + length, 0, [(at, length, 0)],
                        {at: Payload(HEADER, nbytes, blocks)})
    manifest = Manifest("dcpstore-0123456789abcdef", 1, {FILE: record}, payload_block=block)
    return _StorageInfo(FILE, at, length), manifest, {("w", ()): (dtype, shape)}


def _box(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...],
         **kw: object) -> ItemRead:
    info, manifest, chunks = _tensor(shape, **kw)  # type: ignore[arg-type]
    return plan_item(_item("w", offsets, lengths), info, manifest, chunks)


# -- coalescing ----------------------------------------------------------------------------


def test_neighbours_merge_and_gaps_split() -> None:
    reqs = [_whole("a", 0, 100), _whole("a", 100, 50), _whole("a", 160, 40),
            _whole("a", 1000, 10)]
    ranges = coalesce(reqs, gap=10, max_range=1 << 20)
    assert [(r.key, r.offset, r.length) for r in ranges] == [("a", 0, 200), ("a", 1000, 10)]
    assert [len(r.items) for r in ranges] == [3, 1]
    assert sum(r.length for r in ranges) == 210  # the 10-byte gap is fetched too


def test_zero_gap_merges_only_touching_ranges() -> None:
    ranges = coalesce([_whole("a", 0, 10), _whole("a", 10, 10), _whole("a", 21, 9)],
                      gap=0, max_range=1 << 20)
    assert [(r.offset, r.length) for r in ranges] == [(0, 20), (21, 9)]


def test_ranges_are_per_file_sorted_by_offset() -> None:
    reqs = [_whole("b", 50, 10), _whole("a", 30, 10), _whole("b", 0, 10), _whole("a", 0, 10)]
    ranges = coalesce(reqs, gap=1 << 20, max_range=1 << 20)
    assert [(r.key, r.offset, r.length) for r in ranges] == [("a", 0, 40), ("b", 0, 60)]
    assert [i.offset for i in ranges[1].items] == [0, 50]


def test_max_range_caps_merging_but_never_splits_an_item() -> None:
    reqs = [_whole("a", 0, 60), _whole("a", 60, 60), _whole("a", 120, 500)]
    ranges = coalesce(reqs, gap=0, max_range=100)
    assert [(r.offset, r.length) for r in ranges] == [(0, 60), (60, 60), (120, 500)]
    assert [(r.offset, r.length) for r in coalesce(reqs, gap=0, max_range=120)] == [
        (0, 120), (120, 500)]


def test_overlapping_requests_share_one_range() -> None:
    ranges = coalesce([_whole("a", 0, 100), _whole("a", 20, 30)], gap=0, max_range=1 << 20)
    assert [(r.offset, r.length, len(r.items)) for r in ranges] == [(0, 100, 2)]


def test_plan_reads_names_an_item_missing_from_metadata() -> None:
    with pytest.raises(IntegrityError, match=r"s3://b/c/.metadata has no storage entry for 'x'"):
        plan_reads([_item("x")], {}, None, {}, uri="s3://b/c")


# -- reshard geometry ----------------------------------------------------------------------


def test_rows_of_a_dim0_shard_read_only_their_blocks() -> None:
    # 16 x 8 float32 = 512 payload bytes, 8 blocks of 64 (two rows each)
    r = _box((16, 8), (5, 0), (4, 8))
    span = r.partial
    assert isinstance(span, BlockSpan)
    assert (span.first, span.stop) == (5 * 32, 9 * 32)  # rows 5..8
    assert (span.lo, span.hi) == (128, 320)  # whole blocks 2..4 around them
    assert span.contiguous and span.strides == (8, 1) and span.dtype == torch.float32
    assert (r.offset, r.length) == (HEADER + 128, 192)
    assert r.needed == 4 * 32


def test_block_aligned_box_reads_exactly_its_blocks() -> None:
    r = _box((16, 8), (4, 0), (4, 8))
    assert r.partial is not None
    assert (r.partial.lo, r.partial.hi) == (128, 256) == (r.partial.first, r.partial.stop)
    assert r.length == r.needed == 128


def test_last_block_may_be_short() -> None:
    r = _box((15, 8), (13, 0), (1, 8), at=1000)  # 480 bytes: the last block has 32
    assert r.partial is not None
    assert (r.partial.lo, r.partial.hi) == (384, 448)
    r = _box((15, 8), (14, 0), (1, 8), at=1000)
    assert r.partial is not None
    assert (r.partial.lo, r.partial.hi) == (448, 480)
    assert (r.offset, r.length) == (1000 + HEADER + 448, 32)


def test_column_box_spans_rows_and_is_not_contiguous() -> None:
    r = _box((16, 8), (2, 4), (3, 4))
    span = r.partial
    assert span is not None and not span.contiguous
    # from element (2, 4) to element (4, 7), inclusive
    assert (span.first, span.stop) == ((2 * 8 + 4) * 4, (4 * 8 + 7 + 1) * 4)
    assert r.needed == span.stop - span.first  # the run around the box, not the box


def test_three_dims_strides() -> None:
    r = _box((8, 4, 4), (6, 0, 0), (1, 4, 4), dtype=torch.float16)
    assert r.partial is not None
    assert r.partial.strides == (16, 4, 1) and r.partial.contiguous
    assert (r.partial.first, r.partial.stop) == (6 * 32, 7 * 32)


@pytest.mark.parametrize(("offsets", "lengths"), [
    ((0, 0), (16, 8)),  # the whole chunk
    ((0, 0), (15, 8)),  # every block but part of the last one
    ((1, 0), (15, 8)),  # from the first block to the last
    ((3, 0), (0, 8)),  # empty
    ((10, 0), (8, 8)),  # beyond the chunk
    ((-1, 0), (2, 8)),  # negative
    ((3,), (2,)),  # wrong rank
])
def test_boxes_that_need_every_block_or_are_odd_read_the_whole_item(
        offsets: tuple[int, ...], lengths: tuple[int, ...]) -> None:
    r = _box((16, 8), offsets, lengths)
    assert r.partial is None
    assert (r.offset, r.length) == (0, HEADER + 512 + 50)


def test_whole_item_without_block_crcs_or_manifest() -> None:
    info, manifest, chunks = _tensor((16, 8))
    item = _item("w", (5, 0), (4, 8))
    assert plan_item(item, info, None, chunks).partial is None
    assert plan_item(item, info, manifest, {}).partial is None  # chunk unknown
    manifest.payload_block = 0
    assert plan_item(item, info, manifest, chunks).partial is None
    info, manifest, chunks = _tensor((16, 8))
    manifest.files[FILE].payloads[0] = Payload(HEADER, 512, ())
    assert plan_item(item, info, manifest, chunks).partial is None
    manifest.files[FILE].payloads[0] = Payload(HEADER, 500, tuple(range(8)))  # wrong size
    assert plan_item(item, info, manifest, chunks).partial is None
    manifest.files[FILE].payloads[0] = Payload(HEADER, 512, tuple(range(7)))  # wrong count
    assert plan_item(item, info, manifest, chunks).partial is None
    manifest.files[FILE].payloads[0] = Payload(200, 512, tuple(range(8)))  # past the item
    assert plan_item(item, info, manifest, chunks).partial is None
    byte_io = _item("w", (5, 0), (4, 8), kind=LoadItemType.BYTE_IO)
    assert plan_item(byte_io, *_tensor((16, 8))).partial is None


def test_partial_reads_of_one_file_coalesce_with_whole_items() -> None:
    a = _box((16, 8), (0, 0), (2, 8))  # block 0
    b = _box((16, 8), (4, 0), (2, 8))  # block 2
    ranges = coalesce([a, b], gap=0, max_range=1 << 20)
    assert [(r.offset, r.length) for r in ranges] == [(HEADER, 64), (HEADER + 128, 64)]
    ranges = coalesce([a, b], gap=64, max_range=1 << 20)
    assert [(r.offset, r.length) for r in ranges] == [(HEADER, 192)]


def test_chunk_index_of_metadata() -> None:
    props = TensorProperties(dtype=torch.bfloat16)
    md = Metadata(state_dict_metadata={
        "w": TensorStorageMetadata(props, torch.Size([4, 6]), [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))]),
        "step": object(),  # type: ignore[dict-item]
    })
    assert chunk_index(md) == {("w", (0, 0)): (torch.bfloat16, (2, 6)),
                               ("w", (2, 0)): (torch.bfloat16, (2, 6))}
