"""What a rank of a ``dcp.load`` holds grows with its own share of the checkpoint, not
with the world size: only the coordinator holds the whole integrity manifest, every other
rank the records of the items it reads (sent in its load plan), and each rank indexes
only the saved chunks it reads.

Figures of the same effect against world size: ``python -m benchmarks.memory_scaling``
(docs/performance.md, "Memory per rank").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from memory_workers import memory_run
from mp import run_ranks
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcpstore.dcp.manifest import FileRecord, Manifest, Payload
from dcpstore.dcp.read_plan import chunk_index

WORLD = 4
TENSORS = 24


@pytest.mark.multiprocess
def test_each_rank_holds_its_own_share_of_the_manifest(tmp_path: Path) -> None:
    results = run_ranks(memory_run, WORLD, str(tmp_path / "ckpt"), TENSORS)
    own = TENSORS + 1  # one chunk of each sharded tensor, and the plain tensor
    total = results[0]["total_items"]
    assert total == TENSORS * WORLD + 1, results[0]
    for rank, r in enumerate(results):
        for phase in ("alone", "shared"):
            got = r[phase]
            if rank == 0:  # the coordinator plans every rank's reads: the whole manifest
                assert got["items"] == total, (rank, phase, got)
            else:
                assert got["items"] == own, (rank, phase, got)
            # the chunk index: the chunks this rank reads, on every rank
            assert got["chunks"] == own, (rank, phase, got)
        # a planner that drops the plan's storage_data: the rank reads the whole manifest
        # itself and still verifies every item it loads
        assert r["dropped"]["items"] == total, (rank, r["dropped"])


def _manifest() -> Manifest:
    files = {
        "__0_0.distcp": FileRecord(300, 1, [(0, 100, 11), (100, 100, 12), (200, 100, 13)],
                                   {0: Payload(10, 80, (5,)), 100: Payload(10, 80, (6,))}),
        "__1_0.distcp": FileRecord(100, 2, [(0, 100, 21)], {0: Payload(10, 80, (7,))}),
    }
    refs = {"../step-1/__0_0.distcp": FileRecord(50, 3, [(0, 50, 31)])}
    return Manifest("dcpstore-x", 2, files, metadata=FileRecord(9, 99), payload_block=64,
                    references=refs)


def test_manifest_subset_and_header() -> None:
    manifest = _manifest()
    sub = manifest.subset([("__0_0.distcp", 100), ("../step-1/__0_0.distcp", 0)])
    assert sub.item_count == 2 and manifest.item_count == 5
    assert list(sub.files) == ["__0_0.distcp"]
    assert sub.files["__0_0.distcp"].items == [(100, 100, 12)]
    assert sub.files["__0_0.distcp"].size == 300  # the file's own record is kept
    assert sub.item_crc("__0_0.distcp", 100, 100) == 12
    assert sub.item_crc("__0_0.distcp", 0, 100) is None  # not this rank's
    assert sub.item_payload("__0_0.distcp", 100) == Payload(10, 80, (6,))
    assert sub.item_payload("__0_0.distcp", 0) is None
    assert sub.item_crc("../step-1/__0_0.distcp", 0, 50) == 31
    assert (sub.save_id, sub.metadata, sub.payload_block) == ("dcpstore-x",
                                                              FileRecord(9, 99), 64)
    header = manifest.header()
    assert header.item_count == 0 and not header.files
    assert list(header.references) == ["../step-1/__0_0.distcp"]
    assert Manifest.from_bytes(header.to_bytes()) == header
    header.check_metadata_digest(9, 99)
    with pytest.raises(Exception, match="is damaged"):
        header.check_metadata_digest(9, 98)


def test_chunk_index_of_the_wanted_chunks_only() -> None:
    props = TensorProperties(dtype=torch.float32)
    chunks = [ChunkStorageMetadata(offsets=torch.Size((4 * r,)), sizes=torch.Size((4,)))
              for r in range(8)]
    md = Metadata({"w": TensorStorageMetadata(props, torch.Size((32,)), chunks)})
    assert len(chunk_index(md)) == 8
    # with DCP's position hint, a wrong hint, and none
    wanted = [MetadataIndex("w", (8,), 2), MetadataIndex("w", (12,), 0),
              MetadataIndex("w", (28,)), MetadataIndex("w", (28,), 7)]
    assert chunk_index(md, wanted) == {("w", (8,)): (torch.float32, (4,)),
                                       ("w", (12,)): (torch.float32, (4,)),
                                       ("w", (28,)): (torch.float32, (4,))}
    assert chunk_index(md, [MetadataIndex("w", (5,)), MetadataIndex("x", (0,))]) == {}
