"""Multi-process (gloo, CPU, 127.0.0.1) FSDP2 save/load ranks for the S3 backend tests.

The functions here run in spawned rank processes, so they live in an importable module.
``run_ranks(fn, world_size, *args)`` starts the ranks and returns what each returned.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from mp import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcpstore

__all__ = ["fsdp_load", "fsdp_save", "run_ranks"]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Net(nn.Module):
    """A small MLP whose layers FSDP2 shards (odd sizes: uneven shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 40)
        self.blocks = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40))
        self.out = nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.out(x)


def _build(world_size: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model, options=_FULL),
            "optim": get_optimizer_state_dict(model, optim, options=_FULL)}


def fsdp_save(rank: int, world_size: int, uri: str, options: dict[str, Any],
              reference: str) -> dict[str, Any]:
    """Train one step of an FSDP2 model + AdamW, save it with dcpstore to ``uri``; rank 0
    writes the full (unsharded) state to ``reference``. Returns the rank's S3 requests."""
    model, optim = _build(world_size, seed=1)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 12, generator=g)
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    writer = dcpstore.get_writer(uri, **options)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
    full = _full_state(model, optim)
    if rank == 0:
        torch.save(full, reference)
    backend = writer.backend
    return {"requests": backend.request_counts, "coordinator": writer.is_coordinator}


def fsdp_load(rank: int, world_size: int, uri: str, options: dict[str, Any],
              reference: str) -> dict[str, Any]:
    """Load ``uri`` into a freshly initialized FSDP2 model + AdamW at this world size and
    compare the full state with ``reference`` bit for bit (on rank 0)."""
    model, optim = _build(world_size, seed=2)  # different init: the load must overwrite it
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    reader = dcpstore.get_reader(uri, **options)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    full = _full_state(model, optim)
    mismatches: list[str] = []
    compared = 0
    if rank == 0:
        expected = torch.load(reference, weights_only=True)
        _compare(full, expected, "", mismatches)
        compared = sum(1 for _ in _tensors(expected))
    return {"mismatches": mismatches, "tensors_compared": compared,
            "bytes_read": reader.bytes_read, "bytes_needed": reader.bytes_needed}


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _compare(actual: Any, expected: Any, path: str, out: list[str]) -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or actual.dtype != expected.dtype \
                or actual.shape != expected.shape:
            out.append(f"{path}: {actual!r} vs {expected!r}")
        elif not torch.equal(actual.view(-1).view(torch.uint8) if actual.numel() else actual,
                             expected.view(-1).view(torch.uint8) if expected.numel()
                             else expected):
            out.append(f"{path}: values differ")
    elif isinstance(expected, dict):
        if set(actual) != set(expected):
            out.append(f"{path}: keys {sorted(map(str, actual))} vs "
                       f"{sorted(map(str, expected))}")
            return
        for k in expected:
            _compare(actual[k], expected[k], f"{path}.{k}", out)
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            out.append(f"{path}: length {len(actual)} vs {len(expected)}")
            return
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _compare(a, e, f"{path}[{i}]", out)
    elif actual != expected:
        out.append(f"{path}: {actual!r} != {expected!r}")
