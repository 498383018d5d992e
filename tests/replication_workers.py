"""Rank functions of tests/test_replication.py: two "hosts" on one machine, each rank
with a local tier of its own (a node-local disk each)."""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

import dcpstore
from dcpstore.training import replication


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def save_with_a_full_disk(rank: int, world: int, root: str, tiers: str) -> dict[str, Any]:
    """Rank 0's disk refuses the copy of rank 1's files: the replication fails loudly on
    every rank, and the step is committed locally and at the root all the same."""
    if rank == 0:
        def full(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if path.endswith(".replica.tmp"):
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return open(path, mode, *args, **kwargs)

        replication.open = full  # type: ignore[attr-defined]
    tier = os.path.join(tiers, f"host{rank}")
    with dcpstore.Checkpointer(root, local_tier=tier) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.wait()
        copied = ckpt.last_replication
        steps = [(int(s), s.where) for s in ckpt.steps()]
    assert copied is not None
    out = {"errors": copied.errors, "received": copied.files_received, "steps": steps,
           "leftovers": [n for n in os.listdir(os.path.join(tier, "step-000000001"))
                         if n.endswith(".tmp")]}
    loaded = {k: torch.zeros_like(v) for k, v in _state(1).items()}
    with dcpstore.Checkpointer(root, local_tier=tier) as again:
        again.load(loaded)
        out["where"] = again.last_load["where"]
    out["equal"] = all(torch.equal(loaded[k], v) for k, v in _state(1).items())
    return out
