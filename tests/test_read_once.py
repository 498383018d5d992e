"""Read once, share: 4 gloo ranks load replicated and HSDP-like (2 x 2 mesh) state from
SeaweedFS through counting proxies.

One launch checks: the bytes each load fetches from the store (about the unique bytes
with sharing, about 4x without), that only the coordinator GETs ``.metadata`` and the
manifest, bit-exact results, and that a byte corrupted in the store is caught by every
rank that received it (an error on each, never garbage).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from mp import run_ranks
from read_once_workers import read_once_run
from stores import build_store

import dcpstore
from dcpstore.testing.faultproxy import FaultPlan, FaultProxy, RequestInfo

pytestmark = pytest.mark.multiprocess

WORLD = 4
PHASES = ("rep_on", "rep_off", "hsdp_on")


def _counting(gets: Counter[str]) -> FaultPlan:
    """A plan that injects nothing and counts the GETs per object."""
    def match(info: RequestInfo) -> bool:
        if info.method == "GET" and info.object_name:
            gets[info.object_name.rsplit("/", 1)[-1]] += 1
        return False

    return FaultPlan(match=match)


def test_read_once_replicated_and_hsdp(request: pytest.FixtureRequest, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = build_store("seaweedfs", request, tmp_path, monkeypatch)
    roots = {name: store.uri(name) for name in ("rep", "hsdp", "bad")}
    gets = {phase: Counter[str]() for phase in PHASES}
    proxies = {phase: FaultProxy(store.upstream or "", _counting(gets[phase]))
               for phase in PHASES}
    for proxy in proxies.values():
        proxy.start()
    try:
        via = {phase: store.via(p.endpoint_url).options for phase, p in proxies.items()}
        results = run_ranks(read_once_run, WORLD, roots, store.options, via)
        down = {phase: p.snapshot().bytes_down for phase, p in proxies.items()}
    finally:
        for proxy in proxies.values():
            proxy.stop()

    def unique(root: str) -> int:
        backend = dcpstore.open_backend(root, **store.options)
        try:
            return sum(o.size for o in backend.list())
        finally:
            backend.close()

    rep, hsdp = unique(roots["rep"]), unique(roots["hsdp"])
    report = {"unique": {"rep": rep, "hsdp": hsdp}, "fetched": down,
              "ranks": [{p: r[p] for p in PHASES} for r in results]}
    # the store served each byte about once with sharing, every rank's bytes without
    assert rep <= down["rep_on"] <= 1.1 * rep, report
    assert hsdp <= down["hsdp_on"] <= 1.1 * hsdp, report
    assert down["rep_off"] >= 3.5 * rep, report
    for phase in ("rep_on", "hsdp_on"):
        metadata = [n for n in gets[phase] if n == ".metadata"]
        manifests = [n for n in gets[phase] if n.startswith(".dcpstore-")]
        assert [gets[phase][n] for n in metadata + manifests] == [1, 1], (phase, gets[phase])
    assert gets["rep_off"][".metadata"] == WORLD, gets["rep_off"]
    # the fetching is spread: no rank fetched (much) more than its share
    for phase, total in (("rep_on", rep), ("hsdp_on", hsdp)):
        fetched = [r[phase]["bytes_read"] for r in results]
        assert sum(fetched) <= total, report
        assert max(fetched) <= total / WORLD * 1.3, report
        received = [r[phase]["bytes_received"] for r in results]
        assert sum(received) == sum(r[phase]["bytes_sent"] for r in results), report
        assert min(received) > 0, report
    for r in results:
        assert r["rep_off"]["bytes_received"] == 0 and r["rep_off"]["bytes_sent"] == 0, report
    # a byte corrupted in the store: every rank that needs it reports it, none loads it
    bad = results[0]["bad"]
    assert isinstance(bad, dict) and sorted(bad) == list(range(WORLD)), bad
    for rank, error in bad.items():
        assert error.startswith("IntegrityError") and "model.w1" in error, (rank, error)
