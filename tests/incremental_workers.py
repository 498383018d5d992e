"""Rank functions of the incremental-checkpoint tests (importable by spawned ranks).

An FSDP2 model with a frozen part (``inp`` and ``blocks.0``: ``requires_grad=False``)
and a trainable part, saved every step by an incremental :class:`~dcpstore.Checkpointer`,
then resumed from every retained step, at the same and at another world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fsdp_workers import Net, full_state, train
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcpstore
from dcpstore.testing import assert_state_equal

__all__ = ["FROZEN", "WideNet", "build_frozen", "load_steps", "save_steps"]

#: Parameter prefixes that do not train.
FROZEN = ("inp.", "blocks.0.")


class WideNet(Net):
    """:class:`Net` with wider layers (shards above the size whose payloads are hashed)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.inp = nn.Linear(self.IN, 96)
        self.blocks = nn.Sequential(nn.Linear(96, 96), nn.Linear(96, 96))
        self.out = nn.Linear(96, 3)


def build_frozen(world_size: int, seed: int) -> tuple[Net, torch.optim.Optimizer]:
    """:class:`WideNet` with :data:`FROZEN` parameters frozen, sharded with FSDP2, and an
    AdamW over the trainable ones."""
    torch.manual_seed(seed)
    model = WideNet()
    for name, param in model.named_parameters():
        if name.startswith(FROZEN):
            param.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2)


def save_steps(rank: int, world_size: int, root: str, steps: int, keep_last: int,
               options: dict[str, Any]) -> dict[str, Any]:
    """Train and save ``steps`` incremental steps; then resume from each retained step.

    Returns (rank 0's values are checked): the gathered state after each step, the
    retained steps, and per retained step an empty string if its resume was bit-exact
    (else the difference).
    """
    model, optim = build_frozen(world_size, seed=1)
    hinted = dcpstore.training.state.frozen_keys({"app": dcpstore.AppState(model, optim,
                                                                  frozen_hint=True)})
    saved: dict[int, dict[str, Any]] = {}
    with dcpstore.Checkpointer(root, incremental=True, keep_last=keep_last,
                               **options) as ckpt:
        for step in range(1, steps + 1):
            train(model, optim, steps=1, seed=step)
            ckpt.save(step, {"app": dcpstore.AppState(model, optim, frozen_hint=True)})
            saved[step] = full_state(model, optim)
        retained = [int(s) for s in ckpt.steps()]
        exact = {}
        for step in retained:
            fresh, fresh_optim = build_frozen(world_size, seed=99)
            train(fresh, fresh_optim, steps=1, seed=99)  # optimizer state to overwrite
            ckpt.load({"app": dcpstore.AppState(fresh, fresh_optim)}, step=step)
            exact[step] = _same(full_state(fresh, fresh_optim), saved[step])
        dist.barrier()
    return {"saved": saved if rank == 0 else None, "retained": retained, "exact": exact,
            "hinted": hinted}


def load_steps(rank: int, world_size: int, root: str, steps: list[int],
               options: dict[str, Any]) -> dict[int, Any] | None:
    """Load each of ``steps`` at this world size; rank 0 returns the gathered states."""
    out = {}
    with dcpstore.Checkpointer(root, **options) as ckpt:
        for step in steps:
            model, optim = build_frozen(world_size, seed=99)
            train(model, optim, steps=1, seed=99)
            ckpt.load({"app": dcpstore.AppState(model, optim)}, step=step)
            out[step] = full_state(model, optim)
    return out if rank == 0 else None


def _same(a: Any, b: Any) -> str:
    """Empty when ``a`` and ``b`` are bit-identical, else where they differ."""
    try:
        assert_state_equal(a, b)
    except AssertionError as exc:
        return str(exc) or "differs"
    return ""
