"""Rank functions for multi-process FSDP2 tests (importable by spawned ranks).

Any backend's tests can use them: pass a URI and the backend options.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcpstore

__all__ = ["build", "full_state", "load_fsdp", "save_fsdp"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
        self.head = nn.Linear(64, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.blocks(torch.relu(self.embed(x)))))


def build(world_size: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int = 7) -> list[float]:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().item())
    return losses


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Gathered model + optimizer state (every rank gets it; tensors on CPU)."""
    msd, osd = get_state_dict(
        model,
        optim,
        options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False
        ),
    )
    return {"model": msd, "optim": osd}


def save_fsdp(
    rank: int, world_size: int, uri: str, options: dict[str, Any]
) -> dict[str, Any] | None:
    model, optim = build(world_size, seed=1)
    train(model, optim, steps=2)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcpstore.get_writer(uri, **options))
    full = full_state(model, optim)
    return full if rank == 0 else None


def load_fsdp(
    rank: int, world_size: int, uri: str, options: dict[str, Any]
) -> dict[str, Any] | None:
    model, optim = build(world_size, seed=99)  # different init: everything must come from disk
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=dcpstore.get_reader(uri, **options))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = full_state(model, optim)
    return full if rank == 0 else None
