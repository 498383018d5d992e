"""The scale model (``python -m benchmarks.scale``) in its quick mode: it runs, its output
has every row and column, and the request counts are the ones the design promises (a
save's and a ``latest()``'s requests do not grow with the number of ranks or steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import scale  # noqa: E402

WORLDS = [4, 8]
RETAINED = 5


def test_quick_model_counts() -> None:
    doc = scale.run_scale(WORLDS, scale.QUICK_MIX, retained=RETAINED, log=lambda _: None)
    rows = doc["rows"]
    assert [r["ranks"] for r in rows] == WORLDS
    keys = scale.QUICK_MIX.keys()
    for row in rows:
        n = row["ranks"]
        assert row["keys"] == keys
        # every rank plans every key (replicated ones too) before torch's dedup
        assert row["items_per_rank"] == keys - scale.QUICK_MIX.byte_items
        assert row["metadata_mb"] > 0 and row["manifest_mb"] > 0
        assert row["cached_plan_s"] is not None  # plan caching is supported
        # per save: every rank's upload (create, one part, complete); the coordinator's
        # overwrite check, manifest, .metadata, the latest pointer, one listing of the
        # step directories for retention and a HEAD of each older step it counts (it
        # confirms what it keeps) -- nothing else per rank
        assert row["save_requests"] == {"PUT": n + 3, "POST": 2 * n, "GET": 1,
                                        "HEAD": RETAINED - 1, "LIST": 1, "DELETE": 0}
        # latest(): the pointer, the tail of its .metadata, the directories after it
        assert row["latest_requests"] == {"PUT": 0, "POST": 0, "GET": 2, "HEAD": 0,
                                          "LIST": 1, "DELETE": 0}
        assert row["listed_keys_per_latest"] == 0
        # steps(): one listing, one HEAD per step (each is confirmed, none trusted)
        assert row["steps_requests"]["LIST"] == 1
        assert row["steps_requests"]["HEAD"] == RETAINED
        # retention after a save: the step just committed is not asked about again
        assert row["retention_requests"] == {"PUT": 0, "POST": 0, "GET": 0,
                                             "HEAD": RETAINED - 1, "LIST": 1, "DELETE": 0}
    table = scale.to_markdown(doc)
    assert table.count("\n") == len(table.strip().splitlines())
    assert "| | 4 ranks | 8 ranks |" in table and "requests per save" in table
    both = scale.compare_markdown(doc, doc).splitlines()
    assert both[0] == "| | 4 before | 4 after | 8 before | 8 after |"
    assert len(both) == len(table.splitlines())
    assert all(line.count("|") == 6 for line in both)


def test_command_line_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert [r["ranks"] for r in doc["rows"]] == WORLDS
    assert (tmp_path / "scale.md").read_text() in proc.stdout
