"""The scaling curves (``python -m benchmarks --curves``) run end to end, and their
superlinear-growth finding flags what it should.

The end-to-end test runs the quick curve on the local store only (world sizes 1 and 2,
two small states) through the same entry point as ``make bench-curves`` and checks the
outputs: every point of every series ran, every load is bit-exact, the point shared by
two series is measured once, and the JSON, Markdown and both PNGs exist. It asserts
nothing about speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from benchmarks import curves  # noqa: E402

MiB = 1 << 20
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_quick_curve_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "curves"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--curves", "--quick", "--stores", "local",
         "--systems", "dcpstore-local", "--series", "world", "size", "--base-size", "4MiB",
         "--sizes", "4MiB", "12MiB",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "estimated duration" in proc.stdout
    for name in ("results.json", "results.md", "world.png", "size.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "world.png").read_bytes()[:8] == PNG
    assert (out / "size.png").read_bytes()[:8] == PNG
    result = json.loads((out / "results.json").read_text())
    assert result["kind"] == "curves" and result["config"]["mode"] == "quick"
    assert result["complete"] is True
    assert len(result["load_average"]["start"]) == 3
    points = {(p["series"], p["system"], p["op"], p["world_size"], p["state_bytes"]): p
              for p in result["points"]}
    state = {p["series"]: set() for p in result["points"]}
    for p in result["points"]:
        state[p["series"]].add(p["state_bytes"])
    small, large = sorted(state["size"])
    assert small == next(iter(state["world"]))  # 4 MiB: the world series' state
    assert 11 * MiB < large < 13 * MiB  # rows are rounded
    expected = ([("world", w, small) for w in (1, 2)]
                + [("size", 2, small), ("size", 2, large)])
    for system in ("dcpstore-local",):
        for series, world, size in expected:
            for op in ("save", "load"):
                p = points.get((series, system, op, world, size))
                assert p is not None, (series, system, op, world, size)
                s = p["summary"]
                assert s["ok"] and not p["errors"] and s["mbps"] > 0
                assert len(s["peak_extra_rss"]) == world
                assert sum(s["share_bytes"]) == size
                if op == "load":
                    assert s["verified"] is True, (series, system, world, size)
                if world > 1:
                    assert "coordinator_excess_cpu_s" in s
    assert {p["system"] for p in result["points"]} == {"dcpstore-local"}
    # the (world 2, 4 MiB) point belongs to both series and was measured once
    shared = [points[(s, "dcpstore-local", "save", 2, small)]["runs"] for s in ("world", "size")]
    assert shared[0] == shared[1]
    md = (out / "results.md").read_text()
    assert "## local: against world size" in md and "## local: against state size" in md
    assert "## Superlinear growth" in md
    assert "MISMATCH" not in md and "FAILED" not in md and "Incomplete" not in md
    # a run cut short keeps its points: --render rebuilds the report from them
    result["complete"] = False
    result["points"] = [p for p in result["points"] if p["world_size"] == 1]
    (out / "results.json").write_text(json.dumps(result))
    assert curves.main(["--render", str(out)]) == 1  # incomplete: not a healthy run
    md = (out / "results.md").read_text()
    assert "Incomplete" in md and "## local: against world size" in md
    assert "## local: against state size" not in md


def _point(series: str, world: int, cpu_per_gib: float, rss: int, share: int
           ) -> dict[str, Any]:
    return {"series": series, "store": "local", "system": "dcpstore-local", "op": "save",
            "x": world, "world_size": world, "state_bytes": 1 << 30,
            "summary": {"is_dcpstore": True, "cpu_s_per_gib": cpu_per_gib,
                        "peak_extra_rss_max": rss, "rss_per_share_max": rss / share}}


def test_findings_flag_superlinear_cpu_and_memory() -> None:
    gib = 1 << 30
    flat = [_point("world", w, 1.0 + 0.02 * w, 100 * MiB // w, gib // w) for w in (1, 2, 4, 8)]
    assert curves.findings(flat) == []
    growing = [_point("world", 1, 1.0, 100 * MiB, gib), _point("world", 2, 1.1, 60 * MiB, gib // 2),
               _point("world", 4, 1.6, 200 * MiB, gib // 4)]
    found = {(f["figure"], f["x"]) for f in curves.findings(growing)}
    assert found == {("cpu_s_per_gib", 4), ("rss_per_share_max", 4)}
    # every rank's memory growing with the world size is found though each is small
    others = [{**_point("world", w, 1.0, 30 * MiB, gib // w),
               "summary": {**_point("world", w, 1.0, 30 * MiB, gib // w)["summary"],
                           "peak_extra_rss": [30 * MiB] + [w * 5 * MiB] * (w - 1)}}
              for w in (2, 4)]
    assert {(f["figure"], f["x"]) for f in curves.findings(others)} == {
        ("others_peak_rss", 4)}
    # a memory growth under the noise floor is not a finding
    tiny = [_point("world", 1, 1.0, 1 * MiB, gib), _point("world", 2, 1.0, 2 * MiB, gib // 2)]
    assert curves.findings(tiny) == []
    # peers are measured for reference, never flagged
    peer = [{**p, "system": "torch-fs", "summary": {**p["summary"], "is_dcpstore": False}}
            for p in growing]
    assert curves.findings(peer) == []
