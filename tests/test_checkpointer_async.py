"""Async saves: persistent staging, snapshot-at-save, process mode (persistent writer
process, no torch.distributed needed, death detected), CUDA staging where a GPU exists."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcpstore
from dcpstore.dcp.staging import Stager, StagingOptions

MODES = ["thread", "process"]


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "nested": {"steps": torch.arange(10), "lr": 0.1, "names": ["a", "b"]},
        "t": torch.randn(8, 8, generator=g).t(),  # non-contiguous
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"]),
        "nested": {"steps": torch.zeros_like(state["nested"]["steps"]), "lr": 0.0,
                   "names": []},
        "t": torch.zeros(8, 8),
    }


def _mutate(state: dict[str, Any]) -> None:
    state["w"].add_(1.0)
    state["b"].mul_(2)
    state["nested"]["steps"].add_(100)
    state["nested"]["names"].append("c")
    state["t"].zero_()


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["w"], want["w"])
    assert torch.equal(got["b"], want["b"])
    assert torch.equal(got["nested"]["steps"], want["nested"]["steps"])
    assert got["nested"]["lr"] == want["nested"]["lr"]
    assert got["nested"]["names"] == want["nested"]["names"]
    assert torch.equal(got["t"], want["t"])


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": state["w"].clone(), "b": state["b"].clone(),
            "nested": {"steps": state["nested"]["steps"].clone(),
                       "lr": state["nested"]["lr"], "names": list(state["nested"]["names"])},
            "t": state["t"].clone()}


# -- the stager ---------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_stager_allocates_once_and_snapshots(shared: bool) -> None:
    stager = Stager(StagingOptions(use_shared_memory=shared))
    state = _state()
    ptrs = None
    for i in range(5):
        want = _clone(state)
        staged = stager.stage(state)
        _mutate(state)  # the live state changes; the snapshot must not
        _assert_same(staged, want)
        now = [staged["w"].data_ptr(), staged["b"].data_ptr(),
               staged["nested"]["steps"].data_ptr(), staged["t"].data_ptr()]
        assert ptrs is None or now == ptrs, f"save {i} got new staging memory"
        ptrs = now
        assert staged["t"].is_contiguous()
        # each staged tensor owns a storage of exactly its size (no copy in the writer)
        assert staged["w"].untyped_storage().nbytes() == staged["w"].nbytes
    assert stager.allocations == 1
    assert (stager.arena is not None and stager.arena.fd is not None) == shared
    # a changed layout reallocates (once)
    state["w"] = torch.zeros(3)
    stager.stage(state)
    assert stager.allocations == 2
    stager.close()


def test_staging_options_accept_torch_options_and_dicts() -> None:
    from torch.distributed.checkpoint.staging import StagingOptions as TorchOptions

    opts = dcpstore.dcp.staging.as_staging_options(TorchOptions(False, True, False, True))
    assert opts == StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                  use_async_staging=False, use_non_blocking_copy=True)
    assert dcpstore.dcp.staging.as_staging_options({"use_shared_memory": False},
                                               process=True).use_shared_memory
    with pytest.raises(TypeError, match="valid fields"):
        dcpstore.dcp.staging.as_staging_options({"pinned": True})
    with pytest.raises(ValueError, match="need staging"):
        dcpstore.Checkpointer("/tmp/x", async_mode="thread", staging=False)


def test_save_with_staging_reuses_a_stager(tmp_path: Path) -> None:
    stager = Stager()
    state = _state()
    for i in range(3):
        dcpstore.save(state, str(tmp_path / f"s{i}"), staging=stager)
    assert stager.allocations == 1
    out = _zeros_like(state)
    dcpstore.load(out, str(tmp_path / "s2"))
    _assert_same(out, state)
    dcpstore.save(state, str(tmp_path / "opt"), staging={"use_shared_memory": True})


# -- snapshot at save(), single process (no torch.distributed) ----------------------------


@pytest.mark.parametrize("mode", MODES)
def test_mutating_right_after_save_keeps_the_snapshot(mode: str, tmp_path: Path) -> None:
    assert not dist.is_initialized()  # process mode works without a process group
    state = _state()
    with dcpstore.Checkpointer(str(tmp_path), keep_last=2, async_mode=mode) as ckpt:
        wanted = {}
        for step in range(1, 4):
            wanted[step] = _clone(state)
            ckpt.save(step, state)
            _mutate(state)  # training changes parameters in place at once
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        assert ckpt.stager is not None and ckpt.stager.allocations == 1
        for step in (2, 3):
            out = _zeros_like(state)
            assert ckpt.load(out, step=step) == step
            _assert_same(out, wanted[step])
        assert ckpt.last_timings["step"] == 3 and ckpt.last_timings["durable_s"] is not None


def test_process_mode_uses_one_persistent_process(tmp_path: Path) -> None:
    with dcpstore.Checkpointer(str(tmp_path), async_mode="process") as ckpt:
        assert ckpt._writers.worker is not None
        pid = ckpt._writers.worker.pid
        for step in range(1, 5):
            ckpt.save(step, _state(step))
        ckpt.wait()
        assert ckpt._writers.worker.pid == pid and ckpt._writers.worker.alive()
        assert ckpt.steps() == [1, 2, 3, 4]
    assert not ckpt._writers.worker.alive()  # close() stops it


def test_writer_process_starts_and_warms_up_with_the_checkpointer(tmp_path: Path) -> None:
    """The process is started by the constructor and imports torch while training runs,
    so no save (not even the first) waits for it to start."""
    with dcpstore.Checkpointer(str(tmp_path), async_mode="process") as ckpt:
        worker = ckpt._writers.worker
        assert worker is not None and worker.alive()  # before any save
        pid = worker.pid
        deadline = time.monotonic() + 120
        while True:  # torch's library mapped = imported (the import is its last step)
            with open(f"/proc/{pid}/maps") as f:
                if "libtorch" in f.read():
                    break
            assert time.monotonic() < deadline, "the writer process never imported torch"
            time.sleep(0.05)
        ckpt.save(1, _state(1))
        assert ckpt._writers.worker.pid == pid
        ckpt.wait()
        assert ckpt.steps() == [1]


def _kill(worker: Any, *, settle: bool = True) -> None:
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while settle and worker.alive() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_killed_writer_process_is_detected_and_nothing_committed(tmp_path: Path) -> None:
    big = {"x": torch.randn(16 << 20)}  # 64 MiB: the write is in flight when killed
    ckpt = dcpstore.Checkpointer(str(tmp_path), async_mode="process")
    try:
        ckpt.save(1, {"x": torch.ones(4)})
        ckpt.wait()
        # killed while idle: the next save() raises, starts nothing, commits nothing
        assert ckpt._writers.worker is not None
        _kill(ckpt._writers.worker)
        with pytest.raises(dcpstore.BackgroundWriterDiedError, match="died"):
            ckpt.save(2, {"x": torch.zeros(4)})
        # killed while writing: the next wait() raises; nothing of step 3 is committed
        ckpt.save(3, big)
        assert ckpt._writers.worker is not None
        _kill(ckpt._writers.worker, settle=False)
        with pytest.raises(dcpstore.BackgroundWriterDiedError, match="not committed"):
            ckpt.wait()
        assert ckpt.steps() == [1]
        assert not (tmp_path / "step-000000003" / ".metadata").exists()
        # and the run goes on with a new process
        ckpt.save(4, {"x": torch.full((4,), 4.0)})
        ckpt.wait()
        assert ckpt.steps() == [1, 4]
        out = {"x": torch.zeros(4)}
        ckpt.load(out)
        assert torch.equal(out["x"], torch.full((4,), 4.0))
    finally:
        ckpt.close()


def test_copy_overlaps_the_write_only_with_a_core_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dcpstore.training.checkpointer import cores_per_local_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_per_local_rank() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cores_per_local_rank() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with dcpstore.Checkpointer(str(tmp_path), async_mode="process") as ckpt:
        assert ckpt.overlap_copy is False  # 2 cores a rank: copy first, then the write
        ckpt.save(1, _state(1))
        ckpt.wait()
        assert ckpt.steps() == [1]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with dcpstore.Checkpointer(str(tmp_path), async_mode="process") as ckpt:
        assert ckpt.overlap_copy is True
    with dcpstore.Checkpointer(str(tmp_path), async_mode="thread") as ckpt:
        assert ckpt.overlap_copy is False  # a thread's writer reads the slots as they are


def _data_bytes(step_dir: Path) -> int:
    """Bytes in a step's data files so far (everything but the commit files)."""
    if not step_dir.exists():
        return 0
    return sum(p.stat().st_size for p in step_dir.rglob("*")
               if p.is_file() and not p.name.startswith("."))


def test_process_mode_writes_while_the_snapshot_is_copied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The background process writes the first tensor while save() is still copying the
    second (the copy is not added to the time until durable), and a copy that fails
    half-way fails the save: nothing is committed, and the next save works."""
    first = torch.randn(1 << 20)  # 4 MiB, written first
    state = {"a": first, "b": torch.randn(1 << 10)}
    seen: dict[str, int] = {}
    fail: list[bool] = [False]
    original = Stager._set_copied

    def copied(self: Stager, n: int) -> None:
        original(self, n)
        if n != 1:
            return
        step_dir = tmp_path / f"step-{seen['step']:09d}"
        deadline = time.monotonic() + 60  # a hang guard, not a speed limit
        while _data_bytes(step_dir) < first.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        seen[f"written_{seen['step']}"] = _data_bytes(step_dir)  # while "b" is not copied
        if fail[0]:
            raise RuntimeError("copy failed half-way")

    monkeypatch.setattr(Stager, "_set_copied", copied)
    with dcpstore.Checkpointer(str(tmp_path), async_mode="process") as ckpt:
        ckpt.overlap_copy = True  # whatever this machine's cores per rank
        for step in (1, 2):
            seen["step"] = step
            ckpt.save(step, state)
            ckpt.wait()
            assert seen[f"written_{step}"] >= first.nbytes, seen
        fail[0], seen["step"] = True, 3
        with pytest.raises(RuntimeError, match="half-way"):
            ckpt.save(3, state)
        ckpt.wait()  # the write failed for the error save() raised: not reported again
        assert ckpt.steps() == [1, 2]
        assert not (tmp_path / "step-000000003" / ".metadata").exists()
        fail[0], seen["step"] = False, 4
        assert ckpt._writers.worker is not None and ckpt._writers.worker.alive()
        ckpt.save(4, state)
        ckpt.wait()
        assert ckpt.steps() == [1, 2, 4]
        out = {"a": torch.zeros_like(first), "b": torch.zeros(1 << 10)}
        assert ckpt.load(out) == 4
        assert torch.equal(out["a"], first) and torch.equal(out["b"], state["b"])


# -- 2 ranks, gloo: DTensor shards, mutate right after save --------------------------------


def _rank_save_mutate_load(rank: int, world_size: int, root: str, mode: str) -> bool:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = torch.randn(16, 8)
    state = {"d": distribute_tensor(full.clone(), mesh, [Shard(0)]),
             "plain": torch.full((4,), 7.0), "step": 0}
    ckpt = dcpstore.Checkpointer(root, keep_last=1, async_mode=mode)
    want_local = state["d"].to_local().clone()
    ckpt.save(1, state)
    with torch.no_grad():
        state["d"].add_(1.0)  # in place, right after save() returned
        state["plain"].add_(1.0)
    ckpt.save(2, state)  # waits for step 1 first
    want_local2 = state["d"].to_local().clone()
    with torch.no_grad():
        state["d"].mul_(0)
    ckpt.wait()
    assert ckpt.stager is not None and ckpt.stager.allocations == 1
    out = {"d": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)]),
           "plain": torch.zeros(4), "step": -1}
    assert ckpt.load(out) == 2 and ckpt.steps() == [2]
    assert isinstance(out["d"], DTensor)
    assert torch.equal(out["d"].to_local(), want_local2)
    assert torch.equal(want_local2, want_local + 1)
    assert torch.equal(out["plain"], torch.full((4,), 8.0))
    ckpt.close()
    return True


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_snapshot_at_save(mode: str, tmp_path: Path) -> None:
    assert run_ranks(_rank_save_mutate_load, 2, str(tmp_path / "root"), mode) == [True, True]


def _rank_killed_writer(rank: int, world_size: int, root: str) -> str:
    ckpt = dcpstore.Checkpointer(root, async_mode="process")
    ckpt.save(1, {f"x{rank}": torch.ones(4)})
    ckpt.wait()
    if rank == 1:
        assert ckpt._writers.worker is not None
        _kill(ckpt._writers.worker)
    dist.barrier()
    try:
        ckpt.save(2, {f"x{rank}": torch.zeros(4)})
    except dcpstore.BackgroundWriterDiedError as exc:
        outcome = f"raised: {exc}"
    else:
        outcome = "no error"
    assert ckpt.steps() == [1]
    ckpt.save(3, {f"x{rank}": torch.full((4,), 3.0)})
    ckpt.wait()
    assert ckpt.steps() == [1, 3]
    ckpt.close()
    return outcome


def test_two_ranks_killed_writer_is_reported_on_every_rank(tmp_path: Path) -> None:
    outcomes = run_ranks(_rank_killed_writer, 2, str(tmp_path / "root"))
    assert all(o.startswith("raised:") and "rank(s) [1]" in o for o in outcomes), outcomes


# -- CUDA: device-to-host into pinned memory on a side stream ------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_cuda_staging_options_on_cpu_tensors(mode: str, tmp_path: Path) -> None:
    """The CUDA options with a CPU state: pinning only where CUDA is, no side stream for
    host tensors, nothing left in flight, and the snapshot as of save()."""
    opts = StagingOptions(use_pinned_memory=True, use_async_staging=True,
                          use_non_blocking_copy=True)
    stager = Stager(opts)
    state = _state()
    staged = stager.stage(state)
    assert stager.arena is not None and stager.arena.pinned == torch.cuda.is_available()
    assert stager._stream is None and stager._event is None  # host tensors: plain copies
    stager.synchronize()
    _assert_same(staged, _state())
    stager.close()
    ckpt = dcpstore.Checkpointer(str(tmp_path), async_mode=mode,  # type: ignore[arg-type]
                                 staging=opts)
    ckpt.save(1, state)
    _mutate(state)
    ckpt.wait()
    out = _zeros_like(state)
    assert ckpt.load(out) == 1
    _assert_same(out, _state())
    ckpt.close()


def _rank_device_lost_mid_save(rank: int, world_size: int, root: str, mode: str | None) -> str:
    """Step 1 saved; then rank 1's device is lost while step 2 is staged (faked at the
    staging seam: its copy raises, as a CUDA copy from a lost device does)."""
    from dcpstore.dcp.staging import stager as stager_module

    staging = StagingOptions(use_pinned_memory=True)
    ckpt = dcpstore.Checkpointer(root, async_mode=mode,  # type: ignore[arg-type]
                                 staging=staging)
    state = {f"x{rank}": torch.full((1024,), 1.0), "shared": torch.ones(8)}
    ckpt.save(1, state)
    ckpt.wait()
    real = stager_module.Stager.copy
    if rank == 1:
        def lost(self: Any, pending: Any) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered "
                               "(device lost, faked at the staging seam)")
        stager_module.Stager.copy = lost  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            state[f"x{rank}"].fill_(2.0)
        ckpt.save(2, state)
        ckpt.wait()
    except Exception as exc:
        outcome = f"raised: {type(exc).__name__}: {exc}"
    else:
        outcome = "no error"
    finally:
        stager_module.Stager.copy = real  # type: ignore[method-assign]
    assert ckpt.steps() == [1], ckpt.steps()
    out = {f"x{rank}": torch.zeros(1024), "shared": torch.zeros(8)}
    assert ckpt.load(out) == 1
    assert torch.equal(out[f"x{rank}"], torch.full((1024,), 1.0))
    ckpt.close()
    return outcome


@pytest.mark.parametrize("mode", [None, *MODES])
def test_a_device_lost_on_one_rank_fails_the_save_on_every_rank(
        mode: str | None, tmp_path: Path) -> None:
    """What the GPU suite does with a real lost CUDA context, on one rank of two: the save
    fails on both ranks (none waits forever for the other), and step 1 stays the newest,
    loadable."""
    outcomes = run_ranks(_rank_device_lost_mid_save, 2, str(tmp_path / "root"), mode,
                         timeout=90)
    assert all(o.startswith("raised:") for o in outcomes), outcomes
    assert "device lost" in outcomes[1], outcomes
