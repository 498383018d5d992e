"""FSDP2 over an NCCL default group on CUDA: dcpstore's save, load, reshard, routing and
read sharing, bit-exact (one rank per GPU)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import gpu_workers as w
import pytest
import torch
from conftest import GPU
from fsdp_workers import Net
from mp import run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict

import dcpstore
from dcpstore.testing import assert_state_equal


def _plain_cpu_state() -> dict[str, Any]:
    """The tests' model and AdamW unsharded on the CPU, in one process without a process
    group (their state dicts have the sharded model's keys)."""
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def test_save_load_bit_exact_and_reshard_to_cpu_and_back(gpu: GPU, tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    want = run_ranks(w.save_and_reload, gpu.world, uri, gpu.device, backend=gpu.backend)[0]

    on_cpu = _plain_cpu_state()  # the GPU save resharded onto one CPU process
    dcpstore.load(on_cpu, uri)
    assert_state_equal(on_cpu, want)

    back = str(tmp_path / "from-cpu")  # and back: saved on the CPU, loaded sharded on GPU
    dcpstore.save(on_cpu, back)
    assert all(run_ranks(w.load_and_compare, gpu.world, back, gpu.device, want,
                         backend=gpu.backend))


def test_routed_dcp_save_and_load(gpu: GPU, tmp_path: Path) -> None:
    uri = (tmp_path / "routed").as_uri()
    assert all(run_ranks(w.routed_round_trip, gpu.world, uri, gpu.device,
                         backend=gpu.backend))


def test_read_sharing_over_an_nccl_default_group_uses_a_gloo_side_group(
        gpu: GPU, tmp_path: Path) -> None:
    if gpu.world < 2:
        pytest.skip(f"read sharing needs 2 ranks, one GPU each; this machine has {gpu.world}"
                    " (NCCL refuses two ranks on one GPU)")
    backends = run_ranks(w.read_shared_load, gpu.world, str(tmp_path / "ckpt"), gpu.device,
                         backend=gpu.backend)
    assert backends == ["gloo"] * gpu.world


def test_a_device_lost_mid_save_fails_the_save_and_keeps_the_previous_step(
        gpu: GPU, needs_cuda: None, tmp_path: Path) -> None:
    """A device-side assert loses this process's CUDA context between two saves: the
    second save fails loudly, step 1 stays the newest checkpoint, and it loads bit-exact
    on the CPU."""
    root = str(tmp_path / "run")
    ctx = mp.get_context("spawn")  # a CUDA context of its own, lost with the process
    with ctx.Pool(1) as pool:
        error = pool.apply(w.lose_device_mid_save, (root,))
    assert "CUDA" in error or "cuda" in error, error
    ckpt = dcpstore.Checkpointer(root)
    assert ckpt.steps() == [1]
    out = {"w": torch.zeros(1 << 20), "step": 0}
    assert ckpt.load(out) == 1
    assert_state_equal(out["w"], torch.load(os.path.join(tmp_path, "want.pt")))
    assert out["step"] == 1
    ckpt.close()
