"""Peer replication of a node-local tier (dcpstore.training.replication): who copies to
whom, and a copy that a full disk refuses. Runs across real hosts: tests/test_multihost.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mp import run_ranks
from replication_workers import save_with_a_full_disk

from dcpstore.training.replication import peers

pytestmark = pytest.mark.multiprocess


def test_each_rank_copies_to_its_place_on_the_next_hosts() -> None:
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert [peers(hosts, r, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert peers(hosts, 0, 2) == [2, 4] and peers(hosts, 5, 2) == [1, 3]
    assert peers(hosts, 0, 9) == [2, 4]  # no two copies on one host
    assert peers(hosts, 0, 0) == []
    # uneven hosts: a rank's place wraps around the smaller host's ranks
    assert [peers(["a", "b", "b"], r, 1) for r in range(3)] == [[1], [0], [0]]
    assert peers(["a", "a"], 0, 1) == []  # one host: nothing to copy


def test_a_full_disk_fails_the_copy_loudly_and_keeps_the_commit(tmp_path: Path) -> None:
    results = run_ranks(save_with_a_full_disk, 2, str(tmp_path / "root"),
                        str(tmp_path / "tiers"))
    for r in results:
        assert len(r["errors"]) == 1 and "No space left on device" in r["errors"][0], r
        assert "rank 0" in r["errors"][0], r  # names the rank (and host) that failed
        assert r["steps"] == [(1, "both")], r  # committed locally and drained
        assert r["leftovers"] == [], r  # no half copy left behind
        assert r["where"] == "local" and r["equal"], r
    assert results[1]["received"] == 1 and results[0]["received"] == 0, results
