"""FSDP2 set-up and rank functions for multi-process tests (importable by spawned ranks).

The one small sharded model of the tests (:func:`build`), its training steps, its
sharded and gathered state, and a load into it; any backend's tests use the rank
functions :func:`save_fsdp` / :func:`load_fsdp`: pass a URI and the backend options.
"""

from __future__ import annotations

import copy
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

__all__ = [
    "Net",
    "build",
    "full_state",
    "load_fsdp",
    "load_into",
    "save_fsdp",
    "sharded_state",
    "train",
]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Net(nn.Module):
    """A small MLP whose layers FSDP2 shards (odd sizes: uneven shards)."""

    IN = 12

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(self.IN, 40)
        self.blocks = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40))
        self.out = nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.inp, *self.blocks):
            x = torch.relu(layer(x))
        return self.out(x)


def build(world_size: int, seed: int, device: str = "cpu") -> tuple[Net, torch.optim.Optimizer]:
    """A :class:`Net` seeded with ``seed``, each block and then the root sharded with
    FSDP2 over a 1-D mesh of ``world_size`` ranks on ``device`` (``"cpu"`` or
    ``"cuda"``, the rank's current GPU), and its AdamW."""
    torch.manual_seed(seed)
    model = Net().to(torch.device(device, torch.cuda.current_device())
                     if device == "cuda" else device)
    mesh = init_device_mesh(device, (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int = 7,
          batch: int = 8) -> list[float]:
    """``steps`` optimizer steps on random inputs (seeded per rank, made on the CPU and
    moved to the model's device); the losses."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    device = next(model.parameters()).device
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(batch, Net.IN, generator=g).to(device)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().item())
    return losses


def sharded_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "optim"}``: the sharded state dicts DCP saves and loads in place."""
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Gathered model + optimizer state, on the CPU (rank 0 gets it; the other ranks get
    empty dicts)."""
    msd, osd = get_state_dict(model, optim, options=_FULL)
    # a copy: some values (the optimizer's "step") come back by reference
    return copy.deepcopy({"model": msd, "optim": osd})


def load_into(model: nn.Module, optim: torch.optim.Optimizer, **load_args: Any) -> None:
    """``dcp.load(**load_args)`` into the sharded state of ``model`` and ``optim``."""
    state = sharded_state(model, optim)
    dcp.load(state, **load_args)
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def save_fsdp(
    rank: int, world_size: int, uri: str, options: dict[str, Any]
) -> dict[str, Any] | None:
    model, optim = build(world_size, seed=1)
    train(model, optim, steps=2)
    dcp.save(sharded_state(model, optim), storage_writer=dcpstore.get_writer(uri, **options))
    full = full_state(model, optim)
    return full if rank == 0 else None


def load_fsdp(
    rank: int, world_size: int, uri: str, options: dict[str, Any]
) -> dict[str, Any] | None:
    model, optim = build(world_size, seed=99)  # different init: everything must come from disk
    load_into(model, optim, storage_reader=dcpstore.get_reader(uri, **options))
    full = full_state(model, optim)
    return full if rank == 0 else None
