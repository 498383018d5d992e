"""Rank functions reproducing Megatron-Bridge's ``fsdp_dtensor`` checkpoint layout through
dcpstore, with plain torch.

Megatron-Bridge 0.6 cannot be imported here (it imports TransformerEngine unconditionally;
docs/integrations/megatron.md), so its layout is rebuilt following its own code:
``iter_<7 digits>`` directories written with ``dcp.save(storage_writer=factory(dir))``, where
the MSC feature flag picks the factory, and ``latest_checkpointed_iteration.txt`` written by
rank 0 afterwards; here dcpstore is the factory. PhysicsNeMo, Megatron-Core and AReaL run for
real in tests/seeds/.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hf_workers import full_state
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import dcpstore


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8))
    if dist.get_world_size() > 1:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    torch.manual_seed(1000 + dist.get_rank())
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optim.step()
        optim.zero_grad()


TRACKER = "latest_checkpointed_iteration.txt"


def megatron_save(save_dir: str, iteration: int, model: nn.Module,
                  optim: torch.optim.Optimizer) -> None:
    """``fsdp_dtensor`` save: DCP through the writer factory, then the tracker file."""
    name = f"{save_dir.rstrip('/')}/iter_{iteration:07d}"
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optimizer": optim_sd, "iteration": iteration}
    # where Megatron picks msc.torch.MultiStorageFileSystemWriter when the MSC feature flag
    # is on, dcpstore is the factory
    dcp.save(state, storage_writer=dcpstore.get_writer(name))
    if dist.get_rank() == 0:
        dcpstore.open_backend(save_dir).put(TRACKER, str(iteration).encode(), atomic=True)
    dist.barrier()


def megatron_load(load_dir: str, model: nn.Module, optim: torch.optim.Optimizer) -> int:
    iteration = int(dcpstore.open_backend(load_dir).get(TRACKER).decode())
    name = f"{load_dir.rstrip('/')}/iter_{iteration:07d}"
    model_sd, optim_sd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd, "iteration": 0}
    dcp.load(state, storage_reader=dcpstore.get_reader(name))
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    assert state["iteration"] == iteration
    return iteration


# -- the two launches -------------------------------------------------------------------------


def bridge_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """2 ranks, FSDP2: two iterations saved; returns the full state after the last."""
    model, optim = _model(2)
    for iteration in (10, 20):
        _train(model, optim, 1)
        megatron_save(root, iteration, model, optim)
    return full_state(model, optim)


def bridge_load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Another world size: the iteration the tracker names, into a fresh model; and the
    weights alone with dcpstore's helper."""
    model, optim = _model(7)
    out: dict[str, Any] = {"iteration": megatron_load(root, model, optim),
                           "state": full_state(model, optim)}
    fresh, _ = _model(9)
    dcpstore.load_model_weights(fresh, root + "/iter_0000020")
    out["weights"] = full_state(fresh, torch.optim.Adam(fresh.parameters()))["model"]
    return out
