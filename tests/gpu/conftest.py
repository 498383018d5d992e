"""The GPU suite (``make test-gpu``): dcpstore's CUDA and NCCL paths on real GPUs.

Every test here skips with one reason, "no CUDA device", on a machine without one. On a
GPU machine the ranks of a test are one per GPU over an NCCL default group (one rank on
one GPU); tests that need more ranks than GPUs say so in their skip reason.

``DCPSTORE_GPU_SUITE_ON_CPU=1`` runs the same tests on the CPU over gloo, with 2 ranks:
a way to debug the suite's own logic without a GPU (the CUDA-only checks then skip).
It proves nothing about CUDA; the suite's results on a GPU are in ``docs/gpu.md``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

ON_CPU = os.environ.get("DCPSTORE_GPU_SUITE_ON_CPU") == "1"
HAVE_CUDA = torch.cuda.is_available()
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_CUDA or ON_CPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@dataclasses.dataclass(frozen=True)
class GPU:
    """Where the suite's ranks run.

    Attributes:
        device: ``"cuda"`` (``"cpu"`` in the CPU dry run).
        backend: The default process group's backend: ``"nccl"`` (``"gloo"``).
        world: Ranks of a multi-rank test: one per GPU (2 in the CPU dry run).
    """

    device: str
    backend: str
    world: int

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@pytest.fixture(scope="session")
def gpu() -> GPU:
    if ON_CPU and not HAVE_CUDA:
        return GPU("cpu", "gloo", 2)
    return GPU("cuda", "nccl", torch.cuda.device_count())


@pytest.fixture
def needs_cuda(gpu: GPU) -> None:
    """Skip a CUDA-only check in the CPU dry run."""
    if not gpu.cuda:
        pytest.skip("CUDA-only check (CPU dry run)")
