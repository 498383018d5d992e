"""Megatron on a GPU, through its own checkpoint code, on dcpstore (one rank per GPU, NCCL).

The parts of Megatron that need CUDA (docs/integrations/megatron.md): the forward pass,
``DistributedDataParallel``, ``get_megatron_optimizer``'s distributed optimizer, and
Megatron-FSDP. Each run is saved, resumed into a fresh model bit-exact, trains on to the
same loss, and is resharded onto CPU ranks. Runs where megatron-core and megatron-fsdp are
installed (the GPU check carries them: docs/gpu.md). Rank functions: megatron_gpu_workers.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import GPU
from mp import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("megatron_fsdp", reason="megatron-fsdp is not installed")

import megatron_gpu_workers as w  # after the skips: it imports the seed workers
from megatron_workers import VOCAB, load_model_tp

import dcpstore


@pytest.fixture(autouse=True)
def _deterministic_cublas(monkeypatch: pytest.MonkeyPatch, needs_cuda: None) -> None:
    # cuBLAS reductions in a fixed order, so that two processes train to the same bits
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    wrong = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not wrong, f"{what}: {wrong}"


def _resume_matches(saved: dict[str, Any], resumed: dict[str, Any]) -> None:
    _assert_same(resumed["state"], saved["state"], "resumed state")
    assert resumed["next_loss"] == saved["next_loss"], (resumed["next_loss"], saved)


def test_ddp_distributed_optimizer_dist_checkpointing(gpu: GPU, tmp_path: Path) -> None:
    """GPTModel in Megatron's DDP with the distributed optimizer, trained on the GPU, saved
    by ``dist_checkpointing.save`` (torch_dist) with ``DcpstoreFeature``; resumed on the GPU
    bit-exact, and the model loaded on 2 CPU ranks at tensor parallelism 2."""
    uri, want = tmp_path / "iter_0000002", tmp_path / "want.pt"
    uri.mkdir()  # a local directory: Megatron checks that it exists
    saved = run_ranks(w.ddp_save, gpu.world, str(uri), str(want), backend=gpu.backend)[0]
    assert "DistributedOptimizer" in saved["inner"], saved["inner"]
    assert all(0 < loss < 10 for loss in saved["losses"]), saved["losses"]  # it trained
    assert any(k.endswith(".exp_avg") for k in saved["state"]), sorted(saved["state"])[:5]
    files = {o.key for o in dcpstore.open_backend(str(uri)).list()}
    assert {".metadata", "metadata.json"} <= files, files
    assert any(k.startswith(".dcpstore-") for k in files), files  # dcpstore wrote it

    resumed = run_ranks(w.ddp_resume, gpu.world, str(uri), backend=gpu.backend)[0]
    assert resumed["iteration"] == 2
    assert saved["steps"] == [2.0] and resumed["persisted_steps"] == [2.0], resumed
    _resume_matches(saved, resumed)  # model, moments, and the loss of the next step

    on_cpu = run_ranks(load_model_tp, 2, str(uri))  # TP 1 on the GPU -> TP 2 on the CPU
    assert on_cpu[0]["tp_shape"] == (VOCAB // 2, 16)
    _assert_same(on_cpu[0]["tensors"], torch.load(want), "TP 2 on the CPU")


def test_megatron_fsdp_dtensor_state(gpu: GPU, tmp_path: Path) -> None:
    """A GPTModel under Megatron-FSDP: its optimizer states are DTensors; saved with plain
    DCP and dcpstore's writer (Megatron-Bridge's fsdp_dtensor save), resumed bit-exact, and
    every tensor loaded resharded onto 2 CPU ranks."""
    uri, want = str(tmp_path / "fsdp_dtensor"), str(tmp_path / "want.pt")
    saved = run_ranks(w.fsdp_save, gpu.world, uri, want, backend=gpu.backend)[0]
    assert saved["plain_moments"] == [], saved["plain_moments"]
    assert saved["moments"] > 0, sorted(saved["state"])[:8]
    assert dcpstore.open_backend(uri).exists(".metadata")

    resumed = run_ranks(w.fsdp_resume, gpu.world, uri, backend=gpu.backend)[0]
    _resume_matches(saved, resumed)

    keys = run_ranks(w.load_resharded, 2, uri, want)[0]
    assert any(".exp_avg" in k for k in keys) and any(k.startswith("model.") for k in keys)
