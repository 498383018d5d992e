"""``Checkpointer`` with CUDA state over an NCCL default group: every mode, the local
tier, and pinned staging with device-to-host copies on a side stream."""

from __future__ import annotations

from pathlib import Path

import gpu_workers as w
import pytest
import torch
from conftest import GPU
from mp import run_ranks

import dcpstore
from dcpstore.dcp.staging import Stager, StagingOptions

MODES = [None, "thread", "process"]


@pytest.mark.parametrize("mode", MODES, ids=["blocking", "thread", "process"])
def test_modes_snapshot_and_resume(gpu: GPU, mode: str | None, tmp_path: Path) -> None:
    out = run_ranks(w.checkpointer_round_trip, gpu.world, str(tmp_path / "run"), gpu.device,
                    mode, None, backend=gpu.backend)
    assert {o["where"] for o in out} == {"remote"}
    if mode is not None:  # one staging arena for both saves
        assert {o["stager_allocations"] for o in out} == {1}


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_local_tier(gpu: GPU, mode: str, tmp_path: Path) -> None:
    out = run_ranks(w.checkpointer_round_trip, gpu.world, str(tmp_path / "run"), gpu.device,
                    mode, str(tmp_path / "local"), backend=gpu.backend)
    assert {o["where"] for o in out} == {"local"}


@pytest.mark.parametrize("async_staging", [False, True])
def test_pinned_staging_copies_on_a_side_stream(needs_cuda: None, async_staging: bool) -> None:
    """The snapshot holds the values as of ``stage``: an in-place update queued right
    after it never reaches it; one pinned arena, reused, of the state's size."""
    stager = Stager(StagingOptions(use_pinned_memory=True, use_async_staging=async_staging))
    x = torch.randn(1 << 20, device="cuda")
    ptr = None
    for _ in range(3):
        want = x.cpu()
        staged = stager.stage({"x": x})
        x.mul_(3)  # queued on the current stream right after stage() returned
        stager.synchronize()
        assert torch.equal(staged["x"], want)
        assert stager.arena is not None and stager.arena.pinned
        assert staged["x"].is_pinned()
        assert ptr is None or staged["x"].data_ptr() == ptr
        ptr = staged["x"].data_ptr()
    assert stager.allocations == 1
    assert x.numel() * 4 <= stager.nbytes < x.numel() * 4 + (1 << 20)
    stager.close()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_one_process_snapshot(needs_cuda: None, mode: str, tmp_path: Path) -> None:
    """Without a process group: a CUDA model modified right after ``save`` returned."""
    model = torch.nn.Linear(512, 512).cuda()
    ckpt = dcpstore.Checkpointer(str(tmp_path), async_mode=mode,  # type: ignore[arg-type]
                                 staging=StagingOptions(use_pinned_memory=True,
                                                        use_async_staging=True))
    want = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    ckpt.save(1, {"m": model.state_dict()})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.wait()
    out = {"m": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    ckpt.load(out)  # into CUDA tensors
    for k, v in want.items():
        assert out["m"][k].is_cuda and torch.equal(out["m"][k].cpu(), v), k
    ckpt.close()
