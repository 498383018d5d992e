"""The benchmark harness (``python -m benchmarks``) runs end to end and reports sane facts.

The smoke test runs the quick mode exactly as CI and ``make bench-quick`` do (all stores,
all systems, one reshard load, the request-counting runs) into a temporary folder and
checks the outputs: every case ran, every load is bit-exact, the bytes each run moved
add up to the state size, the counted requests and wire bytes are there, and the JSON,
Markdown and PNG exist. It asserts nothing about speed. The unit tests below pin the
pieces whose mistakes would silently skew every figure: the workload's values, the
option scoping, and the ratio / limit / target arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from benchmarks import report  # noqa: E402
from benchmarks.cli import _parse_opts, options_for, parse_args  # noqa: E402
from benchmarks.runner import rotated  # noqa: E402
from benchmarks.workload import WorkloadSpec, _fill, parse_size, plan_tensors  # noqa: E402

MiB = 1 << 20


# -- workload ------------------------------------------------------------------------------


def test_workload_shapes() -> None:
    spec = WorkloadSpec(64 * MiB, tensors=16, mix="mixed")
    plans = plan_tensors(spec)
    assert plans == plan_tensors(WorkloadSpec(64 * MiB, tensors=16, mix="mixed", seed=9))
    assert len(plans) == 16
    assert len({p.name for p in plans}) == 16
    total = sum(p.nbytes for p in plans)
    assert abs(total - 64 * MiB) < 64 * MiB * 0.02
    assert spec.state_bytes == total
    vectors = [p for p in plans if len(p.shape) == 1]
    assert len(vectors) == 4
    # odd row counts: Shard(0) splits the matrices unevenly over 2 ranks
    assert all(p.shape[0] % 2 == 1 for p in plans if len(p.shape) == 2)
    equal = plan_tensors(WorkloadSpec(64 * MiB, tensors=8, mix="equal"))
    assert len({p.shape for p in equal}) == 1
    with pytest.raises(ValueError):
        WorkloadSpec(4096, tensors=8)


def test_values_are_position_dependent_and_shard_consistent() -> None:
    whole = torch.empty(3_000_000, dtype=torch.float32)
    _fill(whole, 0, salt=3, seed=0)
    assert torch.isfinite(whole).all()
    assert ((whole.abs() >= 1) & (whole.abs() < 2)).all()
    # a shard starting anywhere (across pattern blocks) holds the same values
    for start, n in ((0, 10), (1_048_570, 20), (2_000_001, 999_999)):
        part = torch.empty(n, dtype=torch.float32)
        _fill(part, start, salt=3, seed=0)
        assert torch.equal(part.view(torch.int32), whole[start:start + n].view(torch.int32))
    # shifted by one element or by one whole pattern block, the bytes differ
    assert not torch.equal(whole[1:1001].view(torch.int32), whole[:1000].view(torch.int32))
    block = 1 << 20
    assert not torch.equal(whole[block:block + 1000].view(torch.int32),
                           whole[:1000].view(torch.int32))
    other = torch.empty(1000, dtype=torch.float32)
    _fill(other, 0, salt=4, seed=0)
    assert not torch.equal(other.view(torch.int32), whole[:1000].view(torch.int32))


def test_sizes() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("64MiB") == 64 * MiB
    assert parse_size("512M") == 512 * MiB
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("lots")


# -- command line --------------------------------------------------------------------------


def test_option_scopes() -> None:
    scoped = _parse_opts(["s3.part_size=64MiB", "files_per_rank=2",
                          "torch-fsspec-s3.thread_count=4", "gcs.max_concurrency=8"])
    assert options_for(scoped, "dcpstore-s3") == {"part_size": 64 * MiB, "files_per_rank": 2}
    assert options_for(scoped, "dcpstore-gcs") == {"max_concurrency": 8, "files_per_rank": 2}
    assert options_for(scoped, "torch-fsspec-s3") == {"thread_count": 4}
    assert options_for(scoped, "s3torchconnector") == {}
    assert options_for(scoped, "limit-s3[64MiBx8]") == {}
    with pytest.raises(ValueError, match="unknown scope"):
        _parse_opts(["nope.x=1"])


def test_quick_and_full_defaults() -> None:
    quick = parse_args(["--quick"])
    assert (quick.runs, quick.sizes["seaweedfs"], quick.reshard) == (1, 64 * MiB, [1])
    full = parse_args([])
    assert (full.runs, full.sizes["seaweedfs"], full.reshard) == (3, 1 << 30, [1, 3])
    assert full.sizes["moto"] < full.sizes["seaweedfs"]


def test_runs_rotate_the_order() -> None:
    systems = ["a", "b", "c"]
    orders = [rotated(systems, rep) for rep in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    # every system goes first once, and each position is held by each system once
    assert {o[0] for o in orders} == set(systems)
    assert all({o[i] for o in orders} == set(systems) for i in range(3))
    assert rotated([], 2) == []


# -- report arithmetic ---------------------------------------------------------------------


def _case(store: str, system: str, op: str, seconds: list[float], *, state: int = 1000_000_000,
          cpu: float = 1.0, extra: dict[str, Any] | None = None, world: int = 2
          ) -> dict[str, Any]:
    runs = []
    for s in seconds:
        runs.append([{"rank": r, "world_size": world, "seconds": s * (1 if r else 0.9),
                      "cpu_user": cpu / 2, "cpu_sys": 0.0, "rss_before": 0,
                      "rss_peak": 10 * MiB, "peak_extra_rss": 10 * MiB, "rchar": 0,
                      "share_bytes": state // world, "largest_tensor_bytes": MiB,
                      "verified": True if op == "load" else None, "extra": extra or {}}
                     for r in range(world)])
    return {"store": store, "system": system, "op": op, "world_size": world, "saved_at": 2,
            "state_bytes": state, "runs": runs, "counted": None, "errors": []}


def test_medians_ratios_limits_and_targets() -> None:
    bound = {"part_size": 16 * MiB, "max_concurrency": 4}
    raw = [
        _case("seaweedfs", "dcpstore-s3", "save", [10.0, 9.0, 30.0], extra=bound),  # median 10
        _case("seaweedfs", "dcpstore-s3", "load", [2.0], extra=bound),
        _case("seaweedfs", "limit-s3[64MiBx8]", "save", [10.0]),
        _case("seaweedfs", "limit-s3[32MiBx16]", "save", [9.5]),  # the faster variant
        _case("seaweedfs", "limit-s3[64MiBx8]", "load", [1.0]),
        _case("seaweedfs", "s3torchconnector", "save", [12.0], cpu=0.5),
        _case("seaweedfs", "s3torchconnector", "load", [4.0], cpu=2.0),
    ]
    kinds = {"dcpstore-s3": (False, True), "limit-s3[64MiBx8]": (True, False),
             "limit-s3[32MiBx16]": (True, False), "s3torchconnector": (False, False)}
    cases = report.build(raw, kinds)
    by = {(c["system"], c["op"]): c for c in cases}
    save = by[("dcpstore-s3", "save")]
    assert save["summary"]["seconds"] == 10.0
    assert save["summary"]["mbps"] == pytest.approx(100.0)
    assert save["vs_limit"]["limit"] == "limit-s3[32MiBx16]"
    assert save["vs_limit"]["ratio"] == pytest.approx(0.95)
    assert save["ratios"]["s3torchconnector"] == pytest.approx(1.2)
    assert save["summary"]["memory_bound"] == 2 * 16 * MiB * 4 + MiB
    targets = {t["id"]: t for t in report.evaluate_targets(cases, 2)}
    assert targets["s3-save-limit"]["status"] == "PASS"  # 0.95 >= 0.90
    assert targets["s3-load-limit"]["status"] == "FAIL"  # 0.5 < 0.85
    assert targets["s3-save-s3tc"]["status"] == "PASS"
    assert targets["s3-load-s3tc"]["status"] == "PASS"  # 2.0x
    assert targets["s3-cpu-save"]["status"] == "FAIL"  # 1.0 > 0.5 CPU s per ~0.93 GiB
    assert targets["s3-cpu-load"]["status"] == "PASS"
    assert targets["s3-save-fsspec"]["status"] == "SKIP"
    assert targets["local-save-torch"]["status"] == "SKIP"
    assert targets["memory-seaweedfs-dcpstore-s3-save-2"]["status"] == "PASS"
    md = report.render_markdown({
        "config": {"mode": "full", "world_size": 2, "runs": 3}, "started": "now",
        "duration_s": 60.0, "command": "python -m benchmarks",
        "machine": {"cpus": 2, "cpu_model": "x", "memory_bytes": 1 << 30, "kernel": "k",
                    "python": "3"},
        "versions": {"torch": "2"},
        "stores": {"seaweedfs": {"state_bytes": 10**9, "note": ""}},
        "cases": cases, "targets": list(targets.values())})
    assert "| **dcpstore-s3** | 100 | 10.00 |" in md
    assert "**FAIL** S3 load >= 85% of the raw limit" in md


# -- end to end ----------------------------------------------------------------------------


def _stores_of(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(result["stores"])


@pytest.mark.timeout(420)
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "quick"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("results.json", "results.md", "chart.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert result["config"]["mode"] == "quick"
    assert result["machine"]["cpus"] and result["versions"]["torch"]
    stores = _stores_of(result)
    assert set(stores) == {"local", "seaweedfs", "moto", "gcs"}
    # a system is skipped only when its package is missing (CI installs them all)
    assert all("not installed" in s["reason"] for s in result["skipped"]), result["skipped"]
    skipped = {(s["store"], s["system"]) for s in result["skipped"]}
    cases = {(c["store"], c["system"], c["op"], c["world_size"]): c for c in result["cases"]}
    n = result["config"]["world_size"]
    for store, info in stores.items():
        assert info["systems"], store
        for system in info["systems"]:
            assert (store, system) not in skipped
            is_limit = system.startswith("limit-")
            ops = [("save", n), ("load", n)] + [
                ("load", m) for m in ([] if is_limit else info["reshard"])]
            for op, world in ops:
                case = cases.get((store, system, op, world))
                assert case is not None, (store, system, op, world)
                _check_case(case, info)
    # one reshard load per DCP system on the reshard stores
    assert stores["seaweedfs"]["reshard"] == [1] and stores["local"]["reshard"] == [1]
    assert ("seaweedfs", "dcpstore-s3", "load", 1) in cases
    assert ("local", "torch-fs", "load", 1) in cases
    # the targets are all evaluated and printed, with no speed asserted here
    ids = {t["id"] for t in result["targets"]}
    assert {"s3-save-limit", "s3-load-limit", "s3-cpu-save", "local-save-torch",
            "local-load-torch"} <= ids
    assert all(t["status"] in ("PASS", "FAIL", "SKIP") for t in result["targets"])
    for line in ("## local:", "## seaweedfs:", "## moto:", "## gcs:", "## Reshard loads",
                 "## Targets"):
        assert line in md
    assert "S3 save >= 90% of the raw limit" in proc.stdout


def _check_case(case: dict[str, Any], info: dict[str, Any]) -> None:
    where = f"{case['store']} {case['system']} {case['op']} @{case['world_size']}"
    s = case["summary"]
    assert not case["errors"], where
    assert s["ok"] and s["mbps"] > 0 and s["seconds"] > 0, where
    assert case["state_bytes"] == info["state_bytes"], where
    # the bytes every run moved add up to the state: the ranks' shares partition it
    for run in case["runs"]:
        assert len(run) == case["world_size"], where
        assert sum(r["share_bytes"] for r in run) == case["state_bytes"], where
        assert all(r["cpu_user"] + r["cpu_sys"] > 0 for r in run), where
        assert all(r["rss_peak"] >= r["rss_before"] > 0 for r in run), where
    if case["op"] == "load":
        assert s["verified"] is True, where
        assert s["bytes_needed"] == case["state_bytes"], where
        # at least the state, at most the state plus headers and `.metadata`; whole
        # data files are not read twice
        assert s["bytes_needed"] <= s["bytes_read"] <= s["bytes_needed"] * 1.05 + MiB, where
    if s["is_dcpstore"]:
        assert s["memory_bound"] > 0, where
        if case["op"] == "load":
            assert s["read_measure"] == "reader", where
            # DCP's items: the tensor bytes plus a small header each
            assert case["state_bytes"] <= s["reader_bytes_needed"] <= s["reader_bytes_read"]
    reshard = case["world_size"] != case["saved_at"]
    # counting runs: on the servers; for dcpstore not on reshard loads (it counts its
    # own bytes read in the timed runs)
    if case["store"] != "local" and not (s["is_dcpstore"] and reshard):
        counted = case["counted"]
        assert counted is not None and counted["verified"], where
        req = counted["requests"]
        if case["op"] == "save":
            assert req.get("PUT", 0) + req.get("POST", 0) > 0, where
            assert counted["bytes_up"] >= case["state_bytes"], where
        else:
            assert req.get("GET", 0) > 0, where
            assert counted["bytes_down"] >= case["state_bytes"] * 0.999, where
