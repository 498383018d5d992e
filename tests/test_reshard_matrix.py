"""Resharding matrix on the local backend: FSDP2 + AdamW and DTensors saved at 1, 2, 4
ranks, loaded at 1, 2, 3, 4.

Bit-exact model, optimizer and DTensor state; training resumes with the same losses as
the uninterrupted run. The other backends' test modules run ``run_matrix`` against their
servers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reshard_workers import load_big, run_matrix, run_ranks, save_big

from dcpstore.dcp.writer import PAYLOAD_BLOCK

pytestmark = pytest.mark.multiprocess


def test_reshard_matrix_local(tmp_path: Path) -> None:
    run_matrix(str(tmp_path), {})


def test_reshard_reads_about_what_each_rank_needs(tmp_path: Path) -> None:
    """Row shards saved at 2 ranks, loaded at 3: each rank needs part of one or two
    saved shards and fetches only the payload blocks around it (at most a block more
    per side), straight into its local shard."""
    uri = str(tmp_path / "big")
    run_ranks(save_big, 2, uri)
    for rank, got in enumerate(run_ranks(load_big, 3, uri)):
        assert got["exact"], f"rank {rank}"
        assert got["items_partial"] == (2 if rank == 1 else 1), got
        assert got["items_direct"] == got["items_partial"], got
        assert got["bytes_needed"] == got["local_bytes"], got
        slack = 2 * PAYLOAD_BLOCK * got["items_partial"]
        assert got["bytes_needed"] <= got["bytes_read"] <= got["bytes_needed"] + slack, got
