"""Read once, share: 4 gloo ranks load replicated and HSDP-like (2 x 2 mesh) state from
SeaweedFS through counting proxies.

One launch checks: the bytes each load fetches from the store (about the unique bytes
with sharing, about 4x without), that only the coordinator GETs ``.metadata`` and the
manifest, bit-exact results, that a byte corrupted in the store is caught by every
rank that received it (an error on each, never garbage), and that a data file gone
fails every rank with the fetching rank's error instead of leaving the others waiting.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
from mp import run_ranks
from read_once_workers import nccl_world_run, read_once_run
from stores import build_store
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import dcpstore
from dcpstore.dcp.read_plan import ItemRead
from dcpstore.dcp.read_share import plan_sharing
from dcpstore.errors import IncompleteCheckpointError
from dcpstore.testing.faultproxy import FaultPlan, FaultProxy, RequestInfo

pytestmark = pytest.mark.multiprocess

WORLD = 4
PHASES = ("rep_on", "rep_off", "hsdp_on", "inc_on", "rep_nogroup")


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
    roots = {name: store.uri(name) for name in ("rep", "hsdp", "bad", "gone")}
    # an incremental step and the step it references, siblings under one run root
    roots |= {"inc1": store.uri("run/step-000000001"), "inc2": store.uri("run/step-000000002")}
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
    inc_own = unique(roots["inc2"])
    report = {"unique": {"rep": rep, "hsdp": hsdp}, "fetched": down,
              "ranks": [{p: r[p] for p in PHASES} for r in results]}
    # the store served each byte about once with sharing, every rank's bytes without
    assert rep <= down["rep_on"] <= 1.1 * rep, report
    assert hsdp <= down["hsdp_on"] <= 1.1 * hsdp, report
    assert down["rep_off"] >= 3.5 * rep, report
    # an incremental step: its own bytes and the referenced ones of step 1 (read through
    # the run root) are shared too, and the step writes far less than a full one
    assert inc_own < rep / 2, report
    assert down["inc_on"] <= 1.1 * (rep + inc_own), report
    assert min(r["inc_on"]["bytes_received"] for r in results) > 0, report
    for phase in ("rep_on", "hsdp_on"):
        metadata = [n for n in gets[phase] if n == ".metadata"]
        manifests = [n for n in gets[phase] if n.startswith(".dcpstore-")]
        assert [gets[phase][n] for n in metadata + manifests] == [1, 1], (phase, gets[phase])
    assert gets["rep_off"][".metadata"] == WORLD, gets["rep_off"]
    # no process group given to the reader: each rank reads .metadata, the coordinator
    # alone the manifest, and the data reads are shared all the same (a world load)
    nogroup = gets["rep_nogroup"]
    assert nogroup[".metadata"] == WORLD, nogroup
    assert [v for n, v in nogroup.items() if n.startswith(".dcpstore-")] == [1], nogroup
    backend = dcpstore.open_backend(roots["rep"], **store.options)
    try:
        metadata_size = backend.stat(".metadata").size
    finally:
        backend.close()
    assert down["rep_nogroup"] <= down["rep_on"] + (WORLD - 1) * metadata_size, report
    assert min(r["rep_nogroup"]["bytes_received"] for r in results) > 0, report
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
    # a data file gone: every rank raises the fetching rank's error, none hangs
    for rank, r in enumerate(results):
        assert r["gone"].startswith("IntegrityError") and "is missing" in r["gone"], (rank, r)


# -- the schedule alone (no ranks) --------------------------------------------------------


def _requests(*ranges: tuple[str, int, int]) -> list[ItemRead]:
    return [ItemRead(ReadItem(LoadItemType.BYTE_IO, MetadataIndex(f"{path}@{off}"),
                              [0], MetadataIndex(f"{path}@{off}"), [0], [length]),
                     _StorageInfo(path, off, length), off, length)
            for path, off, length in ranges]


def test_plan_sharing_splits_balances_and_leaves_private_ranges_alone() -> None:
    big = ("__0_0.distcp", 0, 40 * 1024)
    small = [("__0_0.distcp", 40 * 1024 + 100 * i, 100) for i in range(20)]
    own = ("__1_0.distcp", 0, 500)
    everyone = [big, *small]
    shares = plan_sharing([_requests(*everyone, own), _requests(*everyone),
                           _requests(*everyone), _requests(*everyone)], min_piece=4096)
    assert len({len(s.windows) for s in shares}) == 1
    units = [u for w in shares[0].windows for u in w]
    assert [u.key for u in units] == sorted(everyone)  # the private range is not shared
    # a rank's plan names who needs a unit only where it sends some of it
    for rank, share in enumerate(shares):
        for unit in (u for w in share.windows for u in w):
            sends = any(p.owner == rank for p in unit.pieces)
            assert unit.needers == ((0, 1, 2, 3) if sends else ()), (rank, unit)
    pieces = [p for u in units for p in u.pieces]
    big_pieces = [p for p in pieces if p.key[0] == big[0] and p.key[1] < big[2]]
    assert len(big_pieces) == 4 and sum(p.key[2] for p in big_pieces) == big[2]
    fetched = Counter[int]()
    for piece in pieces:
        fetched[piece.owner] += piece.key[2]
    total = sum(k[2] for k in everyone)
    assert sum(fetched.values()) == total
    assert max(fetched.values()) <= total / 4 + 4096, fetched
    # pieces each rank owns come in runs: few range requests per rank
    runs = sum(1 for a, b in itertools.pairwise(pieces) if a.owner != b.owner)
    assert runs <= 6, [p.owner for p in pieces]


def test_plan_sharing_hsdp_pairs_and_windows() -> None:
    shard = [("__0_0.distcp", i * 1000, 1000) for i in range(8)]
    # ranks 0 and 2 need the even shards, 1 and 3 the odd ones (2 x 2 mesh)
    plans = [_requests(*shard[r % 2::2]) for r in range(4)]
    shares = plan_sharing(plans, window_bytes=2000)
    assert len({len(s.windows) for s in shares}) == 1 and len(shares[0].windows) == 4
    for rank, share in enumerate(shares):
        for unit in (u for w in share.windows for u in w):
            owners = {p.owner for p in unit.pieces}
            assert owners <= ({0, 2} if rank % 2 == 0 else {1, 3}), (rank, unit)
            if rank in owners:
                assert set(unit.needers) == ({0, 2} if rank % 2 == 0 else {1, 3})
    assert plan_sharing([_requests(shard[0]), _requests(shard[1])])[0].windows == []


def test_plan_sharing_with_holders_routes_each_file_through_a_rank_that_has_it() -> None:
    """A node-local tier on 2 hosts (ranks 0, 1 and 2, 3): a range only one rank needs is
    shared when that rank's host lacks the file; owners always hold the file, needers
    first; an owner that does not need the bytes sends them without receiving any."""
    a, b = ("__0_0.distcp", 0, 1000), ("__2_0.distcp", 0, 1000)
    holders = {"__0_0.distcp": [0, 1], "__2_0.distcp": [2, 3]}
    # rank 1 needs a (its host has it: private), rank 2 needs a (shared, from 0 or 1),
    # ranks 0 and 3 need b (3's host has it: 3 fetches it and sends it to 0)
    plans = [_requests(b), _requests(a), _requests(a), _requests(b)]
    shares = plan_sharing(plans, holders=holders)
    units = {u.key: u for share in shares for w in share.windows for u in w if u.needers}
    assert sorted(units) == [a, b]
    assert units[a].needers == (1, 2) and {p.owner for p in units[a].pieces} == {1}
    assert units[b].needers == (0, 3) and {p.owner for p in units[b].pieces} == {3}
    # the one needer of a file its host lacks, the owner among holders that need nothing
    lone = plan_sharing([_requests(), _requests(), _requests(a), _requests()],
                        holders=holders)
    owner_units = [u for w in lone[0].windows + lone[1].windows for u in w]
    assert [(u.key, u.needers, {p.owner for p in u.pieces}) for u in owner_units] == [
        (a, (2,), {0})]
    assert not owner_units[0].needed_by(0)  # rank 0 sends, and receives nothing
    received = [u for w in lone[2].windows for u in w]
    assert [u.key for u in received] == [a] and received[0].needed_by(2)
    assert lone[3].windows == [[]]  # in every window, with nothing to do
    # a file no rank holds cannot be planned
    with pytest.raises(IncompleteCheckpointError, match="no host holds a copy"):
        plan_sharing([_requests(a), _requests()], holders={"__0_0.distcp": []})
    # files the map does not name are read by each rank itself, as without holders
    assert plan_sharing([_requests(a), _requests()], holders={})[0].windows == []


def test_broadcast_reads_option_from_the_uri() -> None:
    for query, value in (("", None), ("?broadcast_reads=false", False),
                         ("?broadcast_reads=true", True)):
        reader = dcpstore.get_reader(f"s3://b/ckpt{query}", endpoint_url="http://127.0.0.1:9")
        assert reader.options.broadcast_reads is value


def test_an_nccl_world_shares_over_a_gloo_side_group(tmp_path: Path) -> None:
    """What one GPU cannot show (tests/gpu needs 2 for it): with the world's backend
    unable to move CPU tensors, as NCCL's, the shared bytes go over a gloo side group,
    given the group or not; a reader given no group warns once, on the coordinator."""
    results = run_ranks(nccl_world_run, 2, str(tmp_path / "ckpt"))
    for phase in ("world", "nogroup"):
        assert [r[phase]["side_group"] for r in results] == ["gloo", "gloo"], results
        assert sum(r[phase]["bytes_received"] for r in results) > 0, results
    assert [r["warned"] for r in results] == [True, False], results
