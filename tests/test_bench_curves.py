"""The scaling curves (``python -m benchmarks --curves``) run end to end, and their
superlinear-growth finding flags what it should.

The end-to-end test runs the quick curve on the local store and SeaweedFS (world sizes 1
and 2, two small states) through the same entry point as ``make bench-curves`` and checks
the outputs: every point of every series ran, every load is bit-exact, the point shared
by two series is measured once, SeaweedFS is a fresh server at each point and its peak
RSS is recorded, and the JSON, Markdown and both PNGs exist. It asserts nothing about
speed. The memory handling is tested on its own: the in-place load (one copy of the
state, every load still checked bit-exact, the source made whole again after a wrong
or unchecked load), the per-point memory estimate, and the skip of a point that would
not fit.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from benchmarks import curves  # noqa: E402
from benchmarks.workload import RankState, WorkloadSpec  # noqa: E402
from dcpstore.testing.servers import free_port  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
PNG = b"\x89PNG\r\n\x1a\n"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.mark.timeout(300)
def test_quick_curve_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "curves"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--curves", "--quick", "--stores", "local",
         "seaweedfs", "--systems", "dcpstore-local", "dcpstore-s3", "--series", "world",
         "size", "--base-size", "4MiB", "--sizes", "4MiB", "12MiB", "--server-memory", "1GiB",
         "--out", str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "estimated duration" in proc.stdout
    assert "largest predicted peak" in proc.stdout
    for name in ("results.json", "results.md", "world.png", "size.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "world.png").read_bytes()[:8] == PNG
    assert (out / "size.png").read_bytes()[:8] == PNG
    result = json.loads((out / "results.json").read_text())
    assert result["kind"] == "curves" and result["config"]["mode"] == "quick"
    assert result["complete"] is True
    assert result["config"]["load_in_place"] is True and result["skipped"] == []
    assert len(result["load_average"]["start"]) == 3
    local = [p for p in result["points"] if p["store"] == "local"]
    points = {(p["series"], p["system"], p["op"], p["world_size"], p["state_bytes"]): p
              for p in local}
    state: dict[str, set[int]] = {p["series"]: set() for p in local}
    for p in local:
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
                assert p["server"] is None  # the local store has no server
                assert p["memory_estimate"]["state"] == size
                # a pool that ran a point before drops its state first
                if (world, size) == (2, large):
                    released = p["ranks_rss_released"]
                    assert len(released) == 2 and all(r > 50 * MiB for r in released)
                    assert p["memory_estimate"]["ranks"] == 0  # its ranks ran already
                elif (world, size) == (1, small):
                    assert p["ranks_rss_released"] is None
    assert {p["system"] for p in local} == {"dcpstore-local"}
    # SeaweedFS: the same points, each on a fresh server whose peak RSS is recorded
    weed = [p for p in result["points"] if p["store"] == "seaweedfs"]
    assert {p["system"] for p in weed} == {"dcpstore-s3"}
    assert {(p["series"], p["op"], p["world_size"], p["state_bytes"]) for p in weed} == {
        (series, op, world, size) for series, world, size in expected
        for op in ("save", "load")}
    for p in weed:
        assert p["summary"]["ok"] and not p["errors"], p["errors"]
        if p["op"] == "load":
            assert p["summary"]["verified"] is True
        server = p["server"]
        assert server["process"] == "weed" and server["memory_limit"] == GiB
        assert server["rss_peak"] >= server["rss_start"] > 0
        # every SeaweedFS point after the first runs on a fresh server
        first = p["world_size"] == 1
        assert server["replaced"] is not first
        assert p["memory_estimate"]["server"] > 0
    assert result["stores"]["seaweedfs"]["fresh_restarts"] == 2  # 3 points
    # the (world 2, 4 MiB) point belongs to both series and was measured once
    shared = [points[(s, "dcpstore-local", "save", 2, small)]["runs"] for s in ("world", "size")]
    assert shared[0] == shared[1]
    md = (out / "results.md").read_text()
    assert "## local: against world size" in md and "## local: against state size" in md
    assert "## seaweedfs: against world size" in md and "server RSS" in md
    assert "Skipped for memory" not in md
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


# -- memory ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    """A 1-D mesh of one gloo rank in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _locals(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.to_local() for k, v in sd.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def test_in_place_load_holds_the_state_once_and_checks_every_load(
        mesh: Any, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # tensors larger than the check's 16 MiB chunk (and than a pattern block)
    spec = WorkloadSpec(36 * MiB, tensors=2, mix="equal")
    reference = RankState(spec, mesh)  # source and a separate destination
    expected = _locals(reference.source())
    state = RankState(spec, mesh, in_place=True)
    source = _locals(state.source())
    assert _same(source, expected)
    assert state.concat() == reference.concat()
    dcp.save(state.source(), checkpoint_id=str(tmp_path / "ckpt"))
    # the destination is the source, zeroed: one copy of the state, not two
    destination = _locals(state.destination())
    assert all(destination[k].data_ptr() == source[k].data_ptr() for k in source)
    assert all(not t.any() for t in destination.values())
    dcp.load(state.destination(), checkpoint_id=str(tmp_path / "ckpt"))
    assert state.verify() is True and state.verify() is True
    assert _same(_locals(state.source()), expected)
    # a wrong load is caught (one element of the largest tensor, past the first chunk)
    destination = _locals(state.destination())
    for name, t in destination.items():
        t.copy_(expected[name])
    largest = max(destination, key=lambda k: destination[k].numel())
    assert destination[largest].numel() * 4 > 16 * MiB
    destination[largest].view(-1)[-1] = 3.0
    assert state.verify() is False
    assert _same(_locals(state.source()), expected)  # and the source is whole again
    # a load that failed before it was checked: the next save still saves the state
    state.destination()
    assert _same(_locals(state.source()), expected)
    # the default (separate destination) is unchanged
    assert reference.verify() is False  # nothing loaded yet
    dst = _locals(reference.destination())
    assert all(dst[k].data_ptr() != expected[k].data_ptr() for k in dst)
    dcp.load(reference.destination(), checkpoint_id=str(tmp_path / "ckpt"))
    assert reference.verify() is True


def _spec_point(series: str, store: str, world: int, size: int, tensors: int = 32
           ) -> curves.Point:
    return curves.Point(series, store, world, WorkloadSpec(size, tensors=tensors))


def test_memory_estimate_of_the_largest_points_fits_the_machine() -> None:
    limit = 2 * GiB
    big_local = curves.estimate_memory(_spec_point("size", "local", 2, 8 * GiB),
                                       ["dcpstore-local", "torch-fs"], server_memory=limit)
    big_weed = curves.estimate_memory(_spec_point("size", "seaweedfs", 2, 8 * GiB),
                                      ["dcpstore-s3"], server_memory=limit)
    wide_weed = curves.estimate_memory(_spec_point("world", "seaweedfs", 8, GiB),
                                       ["dcpstore-s3"], server_memory=limit)
    for e in (big_local, big_weed, wide_weed):
        assert e["total"] == sum(v for k, v in e.items() if k != "total")
    # the state is held once (the load goes into it), the ranks' own memory beside it
    assert big_local["state"] == _spec_point("size", "local", 2, 8 * GiB).workload.state_bytes
    assert big_local["ranks"] == 2 * curves.RANK_BASE_RSS
    assert big_local["server"] == 0
    # torch-fs reads its largest item whole: 1/W of the largest tensor, per rank
    assert 2 * 400 * MiB < big_local["operations"] < 2 * 700 * MiB
    # comfortably inside 24 GiB: at most half of it at 8 GiB, 10 GiB at 8 ranks
    assert big_local["total"] < 12 * GiB and big_weed["total"] < 12 * GiB
    assert wide_weed["total"] < 10 * GiB
    # SeaweedFS: the heap for 8 ranks' requests in flight, bounded by GOMEMLIMIT
    unbounded = curves.estimate_memory(_spec_point("world", "seaweedfs", 8, GiB),
                                       ["dcpstore-s3"], server_memory=None)
    assert wide_weed["server"] <= limit + 256 * MiB < unbounded["server"]
    assert curves.estimate_memory(_spec_point("world", "seaweedfs", 8, GiB), ["dcpstore-s3"],
                                  server_memory=limit, pool_running=True)["ranks"] == 0
    # many small tensors: metadata per (rank x tensor) on every rank
    many = curves.estimate_memory(_spec_point("many", "local", 8, GiB, tensors=1024),
                                  ["dcpstore-local"], server_memory=limit)
    few = curves.estimate_memory(_spec_point("world", "local", 8, GiB), ["dcpstore-local"],
                                 server_memory=limit)
    assert many["operations"] > few["operations"]


def test_memory_estimate_counts_a_checkpoint_on_tmpfs(tmp_path: Path) -> None:
    point = _spec_point("world", "local", 1, 64 * MiB)
    on_disk = curves.estimate_memory(point, ["dcpstore-local"], server_memory=None,
                                     local_root=str(tmp_path))
    assert on_disk["page_cache"] == 0 or curves._on_tmpfs(str(tmp_path))
    if os.path.isdir("/dev/shm") and curves._on_tmpfs("/dev/shm"):
        in_memory = curves.estimate_memory(point, ["dcpstore-local"], server_memory=None,
                                           local_root="/dev/shm")
        assert in_memory["page_cache"] == point.workload.state_bytes


@pytest.mark.timeout(120)
def test_a_point_that_would_not_fit_is_skipped_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "curves"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--curves", "--quick", "--stores", "local",
         "--systems", "dcpstore-local", "--series", "world", "--base-size", "4MiB",
         "--memory-headroom", "1000000GiB", "--out", str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]  # nothing ran
    result = json.loads((out / "results.json").read_text())
    assert result["complete"] is True and result["points"] == []
    assert [(k["series"], k["world_size"]) for k in result["skipped"]] == [
        ("world", 1), ("world", 2)]
    for k in result["skipped"]:
        assert k["reason"].startswith("skipped: predicted peak")
        assert "available" in k["reason"] and "headroom" in k["reason"]
        assert k["memory_estimate"]["state"] == k["state_bytes"]
    md = (out / "results.md").read_text()
    assert "## Skipped for memory" in md and "- local @2 " in md
    assert "No point was measured" in md


def test_server_watch_records_the_peak() -> None:
    # moto runs in this process, so its watch samples this process
    with curves._ServerWatch("moto", None, interval=0.02) as watch:
        # new pages (a fresh mapping, not memory the allocator kept), every one touched
        block = mmap.mmap(-1, 64 * MiB)
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(0.3)
    block.close()
    figures = watch.figures()
    assert figures is not None and figures["memory_limit"] is None
    assert figures["rss_peak"] - figures["rss_start"] > 48 * MiB
    with curves._ServerWatch("local", GiB) as none:
        pass
    assert none.figures() is None
