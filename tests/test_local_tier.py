"""The local tier: commit locally first, drain to the root in the background.

Also the reliability run: a rank SIGKILLed at seeded points of the drain (quick subset by
default, many seeds with ``--full``) leaves the local step loadable, the remote's previous
step intact, never a torn remote step, and nothing ``dcpstore gc`` cannot clean.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import signal
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp import run_killable, run_ranks
from stores import GatedBackend, Store, full_requested, make_store
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcpstore
import dcpstore.training.background
import dcpstore.training.checkpointer as ckpt_mod
import dcpstore.training.drain
import dcpstore.training.loading
import dcpstore.training.local_tier
from dcpstore.dcp import layout
from dcpstore.storage import registry
from dcpstore.storage.local import LocalBackend
from dcpstore.testing import assert_state_equal
from dcpstore.testing.servers import isolate_env
from dcpstore.tools.cli import main as cli_main
from dcpstore.tools.ops import gc, verify_checkpoint
from dcpstore.training.latest import POINTER_KEY

logger = logging.getLogger(__name__)


def _state(v: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(128, 64, generator=g), "b": torch.randn(64, generator=g),
            "step": v}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(128, 64), "b": torch.zeros(64), "step": -1}


class _Sources:
    """Records which URI every Checkpointer.load read from."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.uris: list[str] = []
        real = dcpstore.training.loading.load

        def spy(state: Any, uri: Any, **kw: Any) -> None:
            self.uris.append(str(uri))
            real(state, uri, **kw)

        monkeypatch.setattr(dcpstore.training.loading, "load", spy)


@pytest.fixture
def seaweed(seaweedfs_s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    store = make_store("seaweedfs", "local_tier", tmp_path / "store",
                       {"seaweedfs": seaweedfs_s3}, None)
    isolate_env(monkeypatch, extra=store.env)
    return store


# -- single process -----------------------------------------------------------------------


def test_commits_locally_then_drains_and_tells_where(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    remote, local = tmp_path / "remote", tmp_path / "local"
    ckpt = dcpstore.Checkpointer(str(remote), local_tier=str(local), keep_last=2,
                                 keep_last_local=1, drain_policy="every")
    for step in (1, 2, 3):
        ckpt.save(step, _state(step))
        assert (local / ckpt_mod.step_dir(step) / ".metadata").is_file()  # local at once
    ckpt.wait()
    steps = ckpt.steps()
    assert steps == [2, 3] and [s.where for s in steps] == ["remote", "both"]
    assert ckpt.latest() == 3 and ckpt.latest().where == "both"  # type: ignore[union-attr]
    assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == [
        "step-000000003"]  # keep_last_local=1
    assert verify_checkpoint(str(remote / "step-000000003")).ok
    # load prefers the verified local copy ...
    sources = _Sources(monkeypatch)
    out = _empty()
    assert ckpt.load(out) == 3
    assert_state_equal(out, _state(3))
    assert sources.uris[-1] == str(local / "step-000000003")
    # ... and reads the remote for a step only the remote holds
    assert ckpt.load(out, step=2) == 2 and sources.uris[-1].endswith("remote/step-000000002")
    assert_state_equal(out, _state(2))
    ckpt.close()
    # another node (an empty local tier) reads the remote
    other = dcpstore.Checkpointer(str(remote), local_tier=str(tmp_path / "other"))
    assert [s.where for s in other.steps()] == ["remote", "remote"]
    assert other.load(out) == 3 and sources.uris[-1].endswith("remote/step-000000003")
    other.close()
    # a damaged local copy is not used (size check), the remote is
    victim = next(p for p in (local / "step-000000003").iterdir() if p.suffix == ".distcp")
    with open(victim, "r+b") as f:
        f.truncate(10)
    again = dcpstore.Checkpointer(str(remote), local_tier=str(local))
    assert again.load(out) == 3 and sources.uris[-1].endswith("remote/step-000000003")
    assert_state_equal(out, _state(3))
    again.close()


class _FlakyBackend(LocalBackend):
    failures = 0  # uploads still to fail

    @classmethod
    def from_uri(cls, uri: Any, options: Any) -> Any:
        return cls("/" + uri.location, options)

    def _open_upload(self, key: str) -> Any:
        if _FlakyBackend.failures > 0:
            _FlakyBackend.failures -= 1
            raise PermissionError(13, "injected: remote refuses the upload", key)
        return super()._open_upload(key)


@pytest.fixture
def custom_backends() -> Any:
    dcpstore.register_backend("gated", GatedBackend, clobber=True)
    dcpstore.register_backend("flaky", _FlakyBackend, clobber=True)
    try:
        yield
    finally:
        GatedBackend.gate.set()
        _FlakyBackend.failures = 0
        registry._reset_for_tests()


@pytest.mark.parametrize("mode", [None, "thread", "process"])
def test_remote_shows_a_step_only_when_drained(mode: str | None, tmp_path: Path,
                                               custom_backends: Any) -> None:
    remote = tmp_path / "remote"
    ckpt = dcpstore.Checkpointer(f"gated:/{remote}", local_tier=str(tmp_path / "local"),
                                 async_mode=mode,  # type: ignore[arg-type]
                                 drain_policy="every")
    GatedBackend.gate.clear()
    ckpt.save(1, _state(1))  # returns: the drain waits at the gate
    deadline = time.monotonic() + 30
    while not (tmp_path / "local" / "step-000000001" / ".metadata").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [s.where for s in ckpt.steps()] == ["local"]
    assert not (remote / "step-000000001" / ".metadata").exists()
    # the next save commits locally while the drain of step 1 still waits: the write of
    # step 2 does not queue behind that drain, and local retention (keep_last_local=1)
    # spares step 1 until it is drained
    ckpt.save(2, _state(2))
    while not (tmp_path / "local" / "step-000000002" / ".metadata").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [(int(s), s.where) for s in ckpt.steps()] == [(1, "local"), (2, "local")]
    GatedBackend.gate.set()
    ckpt.wait()
    assert [(int(s), s.where) for s in ckpt.steps()] == [(1, "remote"), (2, "both")]
    assert ckpt.last_timings["durable_s"] is not None
    ckpt.close()


def test_failed_drain_is_retried_then_reported(tmp_path: Path, custom_backends: Any) -> None:
    remote, local = tmp_path / "remote", tmp_path / "local"
    ckpt = dcpstore.Checkpointer(f"flaky:/{remote}", local_tier=str(local),
                                 keep_last_local=1, drain_retries=2)
    _FlakyBackend.failures = 2  # two attempts fail, the third succeeds
    ckpt.save(1, _state(1))
    ckpt.wait()
    assert [s.where for s in ckpt.steps()] == ["both"]
    _FlakyBackend.failures = 100  # every attempt fails
    ckpt.save(2, _state(2))
    with pytest.raises(dcpstore.DrainError, match="step 2 is committed in the local tier"):
        ckpt.wait()
    # the remote never shows step 2, keeps step 1, and holds no partial files of step 2
    assert not (remote / "step-000000002" / ".metadata").exists()
    assert not list((remote / "step-000000002").glob("*.distcp")) \
        if (remote / "step-000000002").exists() else True
    assert [(int(s), s.where) for s in ckpt.steps()] == [(1, "remote"), (2, "local")]
    out = _empty()
    assert ckpt.load(out) == 2
    assert_state_equal(out, _state(2))
    # the local step is kept while it is newer than the remote's newest
    _FlakyBackend.failures = 0
    ckpt.save(3, _state(3))
    ckpt.wait()
    assert [(int(s), s.where) for s in ckpt.steps()] == [(1, "remote"), (3, "both")]
    # reported once, also through save()
    _FlakyBackend.failures = 100
    ckpt.save(4, _state(4))
    ckpt._jobs.pending[-1].future.exception()  # let the drain fail
    with pytest.raises(dcpstore.DrainError):
        ckpt.save(5, _state(5))
    ckpt.close()


class _CountingBackend(LocalBackend):
    """Counts the root queries a load makes (listings and existence checks)."""

    calls: list[str] = []  # shared on purpose: every instance records

    @classmethod
    def from_uri(cls, uri: Any, options: Any) -> Any:
        return cls("/" + uri.location, options)

    def list(self, prefix: str = "") -> Any:
        _CountingBackend.calls.append(f"list {self.location}")
        return super().list(prefix)

    def list_dirs(self, prefix: str = "", *, start_after: str = "") -> Any:
        _CountingBackend.calls.append(f"list_dirs {self.location}")
        return super().list_dirs(prefix, start_after=start_after)

    def exists(self, key: str) -> bool:
        _CountingBackend.calls.append(f"exists {self.location}/{key}")
        return super().exists(key)


def _flip_bytes(step_dir: Path) -> None:
    """Damage a data file without changing its size (only the CRC32C check sees it)."""
    victim = max((p for p in step_dir.iterdir() if p.suffix == ".distcp"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_load_from_the_local_tier_does_not_touch_the_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dcpstore.register_backend("counting", _CountingBackend, clobber=True)
    try:
        remote, local = tmp_path / "remote", tmp_path / "local"
        with dcpstore.Checkpointer(f"counting:/{remote}", local_tier=str(local),
                                   keep_last_local=2) as ckpt:
            for step in (1, 2):
                ckpt.save(step, _state(step))
            ckpt.wait()
        sources = _Sources(monkeypatch)
        _CountingBackend.calls.clear()
        out = _empty()
        with dcpstore.Checkpointer(f"counting:/{remote}", local_tier=str(local)) as again:
            # an explicit step held locally: the root is not contacted at all, not even
            # set up (no client library imported for it)
            assert again.load(out, step=1) == 1
            assert _CountingBackend.calls == [] and not again._root.is_resolved
            assert again.last_load["where"] == "local" and again.last_load["step"] == 1
            assert_state_equal(out, _state(1))
            # the newest step: the root is listed once (the step directories after its
            # latest pointer, to find a newer step there), no object listing
            assert again.load(out) == 2
            assert [c.split()[0] for c in _CountingBackend.calls] == ["list_dirs"]
            assert again.last_load["where"] == "local"
            assert_state_equal(out, _state(2))
        assert sources.uris == [str(local / "step-000000001"), str(local / "step-000000002")]
        # a step saved straight to the root (say, the local tier was full) is newer there:
        # it is the one loaded, after the older local copy
        with dcpstore.Checkpointer(f"counting:/{remote}") as plain:
            plain.save(3, _state(3))
        with dcpstore.Checkpointer(f"counting:/{remote}", local_tier=str(local)) as again:
            assert again.load(out) == 3
            assert again.last_load["where"] == "remote"
            assert sources.uris[-1].endswith("remote/step-000000003")
            assert_state_equal(out, _state(3))
            assert [(int(s), s.where) for s in again.steps()] == [
                (1, "both"), (2, "both"), (3, "remote")]
    finally:
        registry._reset_for_tests()


def test_options_are_checked_by_the_first_save_with_a_local_tier(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"Checkpointer\(.*unknown option.*bogus"):
        dcpstore.Checkpointer(str(tmp_path / "remote"), bogus=1)  # no tier: at once
    ckpt = dcpstore.Checkpointer(str(tmp_path / "remote"), local_tier=str(tmp_path / "local"),
                                 bogus=1)
    with pytest.raises(TypeError, match=r"Checkpointer\(.*unknown option.*bogus"):
        ckpt.save(1, _state(1))
    assert not (tmp_path / "local").exists() or not os.listdir(tmp_path / "local")
    ckpt.close()  # nothing to release


def test_corrupt_local_copy_is_caught_by_the_read_and_the_root_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote, local = tmp_path / "remote", tmp_path / "local"
    with dcpstore.Checkpointer(str(remote), local_tier=str(local), keep_last_local=2) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        ckpt.wait()
    _flip_bytes(local / "step-000000002")  # sizes still match: only the CRC32C check sees it
    step_dir = LocalBackend(str(local / "step-000000002"))
    assert dcpstore.training.local_tier.local_step_verified(step_dir)
    sources = _Sources(monkeypatch)
    for step in (None, 2):
        out = _empty()
        with dcpstore.Checkpointer(str(remote), local_tier=str(local)) as again:
            assert again.load(out, step=step) == 2
            assert again.last_load["where"] == "remote"
        assert_state_equal(out, _state(2))
        assert sources.uris[-2:] == [str(local / "step-000000002"),
                                     str(remote / "step-000000002")]
    # a damaged copy of a step that only the local tier holds: the error is raised
    with dcpstore.Checkpointer(str(tmp_path / "nowhere"), local_tier=str(local)) as lonely:
        for step in (None, 2):
            with pytest.raises(dcpstore.IntegrityError):
                lonely.load(_empty(), step=step)
        assert lonely.load(out, step=1) == 1 and lonely.last_load["where"] == "local"
        assert_state_equal(out, _state(1))


def test_unwritable_or_full_local_tier_goes_straight_to_remote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    remote = tmp_path / "remote"
    ckpt = dcpstore.Checkpointer(str(remote), local_tier=str(tmp_path / "a-file" / "tier"))
    with pytest.warns(RuntimeWarning, match="local tier unusable for step 1.*not writable"):
        ckpt.save(1, _state(1))
    assert (remote / "step-000000001" / ".metadata").is_file()
    assert [s.where for s in ckpt.steps()] == ["remote"]
    ckpt.close()

    class Usage:
        free = 1000

    monkeypatch.setattr(dcpstore.training.local_tier.shutil, "disk_usage", lambda _: Usage())
    full = dcpstore.Checkpointer(str(remote), local_tier=str(tmp_path / "full"),
                                 async_mode="thread")
    with pytest.warns(RuntimeWarning, match="GB free"):
        full.save(2, _state(2))
    full.wait()
    assert [(int(s), s.where) for s in full.steps()] == [(1, "remote"), (2, "remote")]
    full.close()


def test_cli_ls_tells_where(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            custom_backends: Any) -> None:
    remote, local = tmp_path / "remote", tmp_path / "local"
    ckpt = dcpstore.Checkpointer(str(remote), local_tier=str(local), keep_last_local=2)
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))
    ckpt.wait()
    ckpt.delete(1)  # now: step 2 in both
    ckpt.close()
    ckpt = dcpstore.Checkpointer(f"flaky:/{remote}", local_tier=str(local), keep_last_local=2,
                                 drain_retries=0)
    _FlakyBackend.failures = 100
    ckpt.save(3, _state(3))
    with pytest.raises(dcpstore.DrainError):
        ckpt.wait()
    ckpt.close()
    os.makedirs(remote / "step-000000000")  # remote-only step
    dcpstore.save(_state(0), str(remote / "step-000000000"), overwrite=True)
    assert cli_main(["ls", str(remote), "--local-tier", str(local)]) == 0
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("step-")}
    assert rows == {"step-000000000": "remote", "step-000000002": "both",
                    "step-000000003": "local"}
    assert cli_main(["ls", str(remote), "--json", "--local-tier", str(local)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {c["path"]: c["where"] for c in listed}["step-000000003"] == "local"


# -- 2 ranks, gloo, SeaweedFS as the remote ------------------------------------------------


def _rank_tiered(rank: int, world_size: int, remote: str, local: str, other: str,
                 options: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    state = {"d": distribute_tensor(full.clone(), mesh, [Shard(0)]), "n": 1}
    seen: list[str] = []
    real = dcpstore.training.loading.load

    def spy(st: Any, uri: Any, **kw: Any) -> None:
        seen.append(str(uri))
        real(st, uri, **kw)

    dcpstore.training.loading.load = spy  # type: ignore[assignment]
    ckpt = dcpstore.Checkpointer(remote, local_tier=local, async_mode="thread", keep_last=1,
                                 keep_last_local=1, **options)
    ckpt.save(1, state)
    with torch.no_grad():
        state["d"].add_(1)
    ckpt.save(2, state)
    ckpt.wait()
    where = [(int(s), s.where) for s in ckpt.steps()]
    out = {"d": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "n": 0}
    ckpt.load(out)
    local_ok = torch.equal(out["d"].to_local(), (full + 1).chunk(world_size)[rank])
    ckpt.close()
    # rank 1 restarts on "another node" (an empty local tier): it gets the commit record,
    # and its bytes from rank 0's disk over the process group; the root is not read
    tier = local if rank == 0 else other
    again = dcpstore.Checkpointer(remote, local_tier=tier, **options)
    where_again = [(int(s), s.where) for s in again.steps()]
    out = {"d": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "n": 0}
    again.load(out)
    remote_ok = torch.equal(out["d"].to_local(), (full + 1).chunk(world_size)[rank])
    again.close()
    dist.barrier()
    return {"where": where, "where_again": where_again, "sources": seen,
            "ok": [local_ok, remote_ok]}


def test_two_ranks_local_tier_with_seaweedfs(tmp_path: Path, seaweed: Store) -> None:
    remote = seaweed.uri("run")
    results = run_ranks(_rank_tiered, 2, remote, str(tmp_path / "local"),
                        str(tmp_path / "other"), seaweed.options)
    # steps() is each rank's own view: only rank 0's tier directory was emptied by hand
    assert [r["where_again"] for r in results] == [[(2, "both")], [(2, "remote")]]
    for r in results:
        assert r["ok"] == [True, True]
        assert r["where"] == [(2, "both")]
        assert r["sources"][0] == str(tmp_path / "local" / "step-000000002")
    assert [r["sources"][1] for r in results] == [
        str(tmp_path / tier / "step-000000002") for tier in ("local", "other")]
    assert (tmp_path / "other" / "step-000000002" / ".metadata").is_file()
    assert verify_checkpoint(f"{remote}/step-000000002", **seaweed.options).ok


# -- latest-wins drains and the drain's memory --------------------------------------------


class _SlowRemote(LocalBackend):
    """Local files whose uploads wait for ``gate``; ``entered`` is set by the first
    upload that waits, and ``uploads`` counts uploads per step directory."""

    name = "slowremote"
    schemes = ("slowremote",)
    gate = threading.Event()
    entered = threading.Event()
    uploads: collections.Counter[str] = collections.Counter()

    @classmethod
    def from_uri(cls, uri: Any, options: Any) -> Any:
        return cls("/" + uri.location, options)

    def _open_upload(self, key: str) -> Any:
        _SlowRemote.uploads[os.path.basename(self.location.rstrip("/"))] += 1
        _SlowRemote.entered.set()
        assert _SlowRemote.gate.wait(60)
        return super()._open_upload(key)

    @classmethod
    def reset(cls) -> None:
        cls.gate.clear()
        cls.entered.clear()
        cls.uploads.clear()


def _remote_untorn(remote: Path) -> list[int]:
    """Steps committed under ``remote``, each checked whole (no torn step)."""
    steps = sorted(int(p.parent.name.split("-")[1]) for p in remote.glob("step-*/.metadata"))
    for step in steps:
        assert verify_checkpoint(str(remote / ckpt_mod.step_dir(step))).ok, step
    return steps


def _four_quick_saves(ckpt: dcpstore.Checkpointer, remote: Path, state: Any) -> None:
    """Step 1's drain is held at the remote; steps 2-4 commit locally meanwhile."""
    ckpt.save(1, state(1))
    assert _SlowRemote.entered.wait(60)  # drain 1 decided and is uploading
    for step in (2, 3, 4):
        ckpt.save(step, state(step))  # latest wins: never waits for a drain
    ckpt._jobs.writes.join()  # the writes (async modes) are committed locally
    assert _remote_untorn(remote) == []
    _SlowRemote.gate.set()
    ckpt.wait()


@pytest.mark.parametrize("mode", [None, "thread", "process"])
def test_slow_drains_coalesce_latest_wins(mode: str | None, tmp_path: Path) -> None:
    dcpstore.register_backend("slowremote", _SlowRemote, clobber=True)
    _SlowRemote.reset()
    remote, local = tmp_path / "remote", tmp_path / "local"
    try:
        ckpt = dcpstore.Checkpointer(f"slowremote:/{remote}", local_tier=str(local),
                                     async_mode=mode,  # type: ignore[arg-type]
                                     keep_last_local=3)
        _four_quick_saves(ckpt, remote, _state)
        # 2 and 3 were superseded by 4 before their drains started: never uploaded
        assert ckpt.skipped_drains == [2, 3]
        assert sorted(_SlowRemote.uploads) == ["step-000000001", "step-000000004"]
        assert _remote_untorn(remote) == [1, 4]
        assert [(int(s), s.where) for s in ckpt.steps()] == [
            (1, "remote"), (2, "local"), (3, "local"), (4, "both")]
        assert ckpt.latest() == 4 and ckpt.last_timings["durable_s"] is not None
        out = _empty()
        assert ckpt.load(out, step=3) == 3 and ckpt.last_load["where"] == "local"
        assert_state_equal(out, _state(3))
        ckpt.close()
        # keep_last_local=1: a superseded step is deleted locally at once, the step
        # being drained stays until it is on the remote
        _SlowRemote.reset()
        again = dcpstore.Checkpointer(f"slowremote:/{remote}", local_tier=str(local),
                                      keep_last_local=1, drain_policy="latest")
        again.save(5, _state(5))
        assert _SlowRemote.entered.wait(60)
        for step in (6, 7):
            again.save(step, _state(step))
        assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == [
            "step-000000005", "step-000000007"]
        _SlowRemote.gate.set()
        again.wait()
        assert again.skipped_drains == [6]
        assert [(int(s), s.where) for s in again.steps()] == [
            (1, "remote"), (4, "remote"), (5, "remote"), (7, "both")]
        again.close()
    finally:
        _SlowRemote.gate.set()
        registry._reset_for_tests()


def test_drain_every_step_on_request(tmp_path: Path) -> None:
    remote, local = tmp_path / "remote", tmp_path / "local"
    with pytest.raises(ValueError, match="drain_policy"):
        dcpstore.Checkpointer(str(remote), local_tier=str(local),
                              drain_policy="newest")  # type: ignore[arg-type]
    ckpt = dcpstore.Checkpointer(str(remote), local_tier=str(local), async_mode="thread",
                                 drain_policy="every")
    for step in (1, 2, 3, 4):
        ckpt.save(step, _state(step))
    ckpt.wait()
    assert ckpt.skipped_drains == []
    assert _remote_untorn(remote) == [1, 2, 3, 4]
    ckpt.close()


def test_drain_copies_through_one_buffer_not_a_heap_chunk_per_read(tmp_path: Path) -> None:
    # the cause of the local tier's RSS growth from save to save: each read of the drain
    # was a fresh 8 MiB bytes from the malloc arena of a short-lived drain thread, and
    # freed arena memory stays resident; the copy now reads into one anonymous buffer
    # per file, which malloc (and tracemalloc) never sees
    local, remote = tmp_path / "local", tmp_path / "remote"
    ckpt = dcpstore.Checkpointer(str(remote / "unused"), local_tier=str(local))
    ckpt.save(1, {"a": torch.rand(5 << 20), "b": torch.rand(5 << 20)})  # 2 x 20 MiB
    step = str(local / ckpt_mod.step_dir(1))
    ckpt._settle(keep_last_drain=False)
    ckpt.close()
    target = LocalBackend(str(remote / "copy"))
    tracemalloc.start()
    try:
        copied = dcpstore.training.local_tier.copy_rank_files(step, target, 0, True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert copied.bytes >= 40 << 20
    assert peak < dcpstore.training.local_tier._CHUNK // 4, f"{peak} bytes allocated on the heap"


def test_freed_heap_is_released_after_each_background_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the other part of the RSS growth: concurrent save and drain threads get their own
    # malloc arenas, whose freed blocks stay resident until trimmed
    calls: list[str] = []
    real = dcpstore.training.background.release_freed_heap
    monkeypatch.setattr(dcpstore.training.background, "release_freed_heap",
                        lambda: (calls.append(threading.current_thread().name), real()))
    ckpt = dcpstore.Checkpointer(str(tmp_path / "remote"), local_tier=str(tmp_path / "l"),
                                 async_mode="thread", drain_policy="every")
    for step in (1, 2, 3):
        ckpt.save(step, _state(step))
    ckpt.close()
    assert sorted(calls) == ["dcpstore-ckpt"] * 3 + ["dcpstore-drain"] * 3


def _rank_coalesce(rank: int, world_size: int, remote: str, local: str) -> dict[str, Any]:
    dcpstore.register_backend("slowremote", _SlowRemote, clobber=True)
    _SlowRemote.reset()
    mesh = init_device_mesh("cpu", (world_size,))

    def state(v: int) -> dict[str, Any]:
        full = torch.arange(64, dtype=torch.float32).reshape(16, 4) + v
        return {"d": distribute_tensor(full, mesh, [Shard(0)]), "n": v}

    ckpt = dcpstore.Checkpointer(f"slowremote:/{remote}", local_tier=local,
                                 async_mode="thread", keep_last_local=1)
    _four_quick_saves(ckpt, Path(remote), state)
    out = {"d": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "n": 0}
    ckpt.load(out)
    ok = torch.equal(out["d"].to_local(), state(4)["d"].to_local()) and out["n"] == 4
    result = {"skipped": list(ckpt.skipped_drains), "uploads": sorted(_SlowRemote.uploads),
              "where": [(int(s), s.where) for s in ckpt.steps()], "ok": ok,
              "loaded": ckpt.last_load["where"]}
    ckpt.close()
    dist.barrier()
    return result


def test_two_ranks_agree_which_drains_are_skipped(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    results = run_ranks(_rank_coalesce, 2, str(remote), str(tmp_path / "local"))
    for r in results:
        assert r["skipped"] == [2, 3]
        assert r["uploads"] == ["step-000000001", "step-000000004"]
        assert r["where"] == [(1, "remote"), (4, "both")]
        assert r["ok"] and r["loaded"] == "local"
    assert _remote_untorn(remote) == [1, 4]


# -- reliability: SIGKILL during the drain -------------------------------------------------

POINTS = ["before_copy", "mid_copy", "after_copy", "before_manifest", "before_metadata",
          "after_metadata", "timer"]
_COORDINATOR_POINTS = {"before_manifest", "before_metadata", "after_metadata"}
QUICK_SEEDS = 4
FULL_SEEDS = 42


def _die(where: str, outdir: str) -> None:
    with open(os.path.join(outdir, "crash.json"), "w") as f:
        json.dump({"point": where, "rank": dist.get_rank()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, outdir: str, delay: float) -> None:
    """Install the kill on this rank, for the drain (background thread) only."""
    from dcpstore.storage.backend import Backend

    def in_drain() -> bool:
        return threading.current_thread().name.startswith("dcpstore-ckpt")

    real_copy = dcpstore.training.drain.copy_rank_files
    real_upload = Backend.open_upload
    real_put = Backend.put

    def copy(*a: Any, **kw: Any) -> Any:
        if point == "before_copy":
            _die(point, outdir)
        out = real_copy(*a, **kw)
        if point == "after_copy":
            _die(point, outdir)
        return out

    def open_upload(self: Backend, key: str, **kw: Any) -> Any:
        up = real_upload(self, key, **kw)
        if point == "mid_copy" and in_drain():
            real_write = up.write

            def write(data: Any) -> int:
                n = real_write(bytes(data)[: max(1, len(data) // 2)])
                _die(point, outdir)
                return n

            up.write = write  # type: ignore[method-assign]
        return up

    def put(self: Backend, key: str, data: bytes, **kw: Any) -> None:
        if in_drain():
            if point == "before_manifest" and key.startswith(".dcpstore-"):
                _die(point, outdir)
            if point == "before_metadata" and key == layout.METADATA_KEY:
                _die(point, outdir)
        real_put(self, key, data, **kw)
        if in_drain() and point == "after_metadata" and key == layout.METADATA_KEY:
            _die(point, outdir)

    dcpstore.training.drain.copy_rank_files = copy  # type: ignore[assignment]
    Backend.open_upload = open_upload  # type: ignore[method-assign]
    Backend.put = put  # type: ignore[method-assign]


def _rank_drain_crash(rank: int, world_size: int, remote: str, local: str,
                      options: dict[str, Any], victim: int, point: str, delay: float,
                      outdir: str) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = dcpstore.Checkpointer(remote, local_tier=local, keep_last=2, keep_last_local=2,
                                 drain_retries=0, **options)

    def state(v: int) -> dict[str, Any]:
        full = _state(v)
        return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": full["b"],
                "step": v}

    ckpt.save(1, state(1))
    ckpt.wait()
    dist.barrier()
    if rank == victim:
        _arm(point, outdir, delay)
    ckpt.save(2, state(2))  # committed locally; the drain runs in the background
    if rank == victim and point == "timer":
        threading.Timer(delay, _die, args=(point, outdir)).start()
    ckpt.wait()
    ckpt.close()
    return "finished"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "drain_seed" in metafunc.fixturenames:
        n = FULL_SEEDS if full_requested(metafunc.config) else QUICK_SEEDS
        metafunc.parametrize("drain_seed", range(n))


def _plan(seed: int) -> tuple[str, str, int, float]:
    rng = random.Random(seed)
    point = POINTS[seed % len(POINTS)] if seed < len(POINTS) else rng.choice(POINTS)
    store = "seaweedfs" if seed % 2 else "local"
    victim = 0 if point in _COORDINATOR_POINTS else rng.randrange(2)
    return point, store, victim, rng.uniform(0.0, 0.05)  # drains take tens of ms


def test_rank_killed_during_drain(drain_seed: int, tmp_path: Path,
                                  request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    point, store_name, victim, delay = _plan(drain_seed)
    report_path = os.environ.get("DCPSTORE_DRAIN_CRASH_REPORT")  # before the env is isolated
    servers = ({"seaweedfs": request.getfixturevalue("seaweedfs_s3")}
               if store_name == "seaweedfs" else {})
    store = make_store(store_name, "local_tier", tmp_path / "remote", servers, None)
    isolate_env(monkeypatch, extra=store.env)
    remote = store.uri("run") if store_name != "local" else str(tmp_path / "remote")
    local = str(tmp_path / "local")
    outdir = str(tmp_path / "out")
    result = run_killable(_rank_drain_crash, 2, remote, local, store.options, victim, point,
                          delay, outdir, outdir=outdir, env=dict(os.environ), timeout=120)
    assert not result.timed_out
    crashed = os.path.exists(os.path.join(outdir, "crash.json"))
    line = {"seed": drain_seed, "store": store_name, "point": point, "victim": victim,
            "killed": crashed, "exitcodes": result.exitcodes}
    # 1. the local tier's committed step loads (at another world size, too)
    out = _empty()
    dcpstore.load(out, f"{local}/step-000000002")
    assert_state_equal(out, _state(2))
    # 2. the remote's previous step is intact
    dcpstore.load(out, f"{remote}/step-000000001", **store.options)
    assert_state_equal(out, _state(1))
    assert verify_checkpoint(f"{remote}/step-000000001", **store.options).ok
    # 3. the remote never has a torn step: step 2 is whole or not committed at all
    remote_2 = dcpstore.open_backend(f"{remote}/step-000000002", **store.options)
    committed = remote_2.exists(layout.METADATA_KEY)
    remote_2.close()
    if committed:
        assert verify_checkpoint(f"{remote}/step-000000002", **store.options).ok
        dcpstore.load(out, f"{remote}/step-000000002", **store.options)
        assert_state_equal(out, _state(2))
    else:
        assert point != "after_metadata" or not crashed
    line["remote_committed"] = committed
    # 4. gc leaves exactly the committed files, no dangling upload
    report = gc(remote, min_age=0, **store.options)
    line["gc_objects"] = len(report.objects)
    line["gc_uploads"] = len(report.uploads)
    leftover = dcpstore.open_backend(remote, **store.options)
    keys = {o.key for o in leftover.list()}
    assert not leftover.list_uploads()
    leftover.close()
    wanted = {POINTER_KEY}  # written after step 1's drain committed
    for step in (1, 2) if committed else (1,):
        d = ckpt_mod.step_dir(step)
        md = dcpstore.get_reader(f"{remote}/{d}", **store.options).read_metadata()
        wanted |= {f"{d}/{i.relative_path}" for i in md.storage_data.values()}
        wanted |= {f"{d}/{layout.METADATA_KEY}",
                   f"{d}/{layout.manifest_key(md.storage_meta.save_id)}"}
    assert keys == wanted
    # 5. a restart on the same node resumes from the local tier
    restarted = dcpstore.Checkpointer(remote, local_tier=local, **store.options)
    latest = restarted.latest()
    assert latest == 2 and latest.local  # type: ignore[union-attr]
    assert restarted.load(out) == 2
    assert_state_equal(out, _state(2))
    restarted.close()
    logger.info("drain crash run: %s", line)
    if report_path:
        with open(report_path, "a") as f:
            f.write(json.dumps(line) + "\n")
