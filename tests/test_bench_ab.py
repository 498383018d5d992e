"""``benchmarks.ab_summary``: the A/B of two commits' libraries, from the files
``benchmarks/ab_commits.sh`` leaves."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import ab_summary


def _results(path: Path, cases: list[tuple[str, str, str, list[float]]]) -> None:
    path.mkdir(parents=True)
    path.joinpath("results.json").write_text(json.dumps({"cases": [
        {"store": store, "system": system, "op": op, "state_bytes": 100_000_000,
         "summary": {"ok": True, "seconds_all": seconds}}
        for store, system, op, seconds in cases] + [
        {"store": "local", "system": "limit-local", "op": "save", "state_bytes": 1,
         "summary": {"ok": True, "seconds_all": [1.0]}}]}))


def test_medians_ranges_and_slower_beyond_the_spread(tmp_path: Path) -> None:
    for side, rnd, save, load in (("old", 1, [1.0, 1.1], [0.10, 0.12]),
                                  ("new", 1, [0.9, 1.0], [0.20, 0.22]),
                                  ("old", 2, [1.05], [0.11]), ("new", 2, [0.95], [0.21])):
        _results(tmp_path / f"{side}-{rnd}" / "main", [
            ("seaweedfs", "dcpstore-s3", "save", save), ("seaweedfs", "dcpstore-s3", "load",
                                                         load)])
    (tmp_path / "commits.txt").write_text("old=a new=b")
    text = ab_summary.summarize(tmp_path)
    rows = {line.split(" | ")[2]: line for line in text.splitlines()
            if line.startswith("| seaweedfs")}
    assert set(rows) == {"save", "load"}  # limits are left out
    assert rows["save"].endswith("| no |") and "| 95 (91-100) | 105 (100-111) |" in rows[
        "save"]
    assert rows["load"].endswith("| **yes** |"), rows["load"]  # every new run slower
    assert ab_summary.main([str(tmp_path)]) == 0
    assert (tmp_path / "summary.md").read_text() == text
