"""What each rank of a multi-host test runs (``tests/test_multihost.py``), started by
``torchrun`` on hosts made of network namespaces (:mod:`dcpstore.testing.hosts`).

    python -m torch.distributed.run ... tests/multihost_workers.py <op> <json args>

Each rank writes ``<out>/<op>-rank<rank>.json`` (what it saw, its host, its local rank)
and leaves with ``os._exit(0)`` after a clean finish (gloo can abort at interpreter exit).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpstore
from dcpstore.testing.hosts import run_rank_op

#: Rows of each sharded tensor (divisible by 1 to 4 ranks... and by 3).
_ROWS = 96


def full_state(step: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """The whole state of ``step``: what every world size must load back bit-exact."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "layers.0.w": torch.randn(_ROWS, 256 * scale, generator=g),
        "layers.1.w": torch.randn(_ROWS, 128 * scale, generator=g),
        "norm": torch.randn(64, generator=g),  # replicated on every rank
        "step": torch.tensor(float(step)),
    }


def sharded(full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``full`` as this world's DTensors: the layers sharded by rows, the rest whole."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: distribute_tensor(v, mesh, [Shard(0)] if k.startswith("layers") else
                                 [Replicate()]) for k, v in full.items()}


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (distribute_tensor(torch.zeros(v.shape), v.device_mesh, v.placements)
                if isinstance(v, DTensor) else torch.zeros_like(v)) for k, v in state.items()}


def matches(state: dict[str, Any], full: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose local shard differs from ``full``'s."""
    expected = sharded(full)
    bad = []
    for k, v in state.items():
        local = v.to_local() if isinstance(v, DTensor) else v
        want = expected[k].to_local() if isinstance(expected[k], DTensor) else expected[k]
        if not torch.equal(local, want):
            bad.append(k)
    return bad


# -- the operations --------------------------------------------------------------------


def op_save(args: dict[str, Any]) -> dict[str, Any]:
    dcpstore.save(sharded(full_state(args["step"])), args["uri"], **args["options"])
    return {}


def op_load(args: dict[str, Any]) -> dict[str, Any]:
    state = zeros_like(sharded(full_state(args["step"])))
    dcpstore.load(state, args["uri"], **args["options"])
    return {"mismatched": matches(state, full_state(args["step"]))}


def op_checkpointer(args: dict[str, Any]) -> dict[str, Any]:
    """Steps 1..4 through a Checkpointer (``async_mode``, ``keep_last=2``), then a new
    Checkpointer finds the latest and loads it."""
    ckpt = dcpstore.Checkpointer(args["root"], keep_last=2, async_mode=args["mode"],
                                 incremental=args.get("incremental", False),
                                 **args["options"])
    try:
        for step in range(1, 5):
            ckpt.save(step, sharded(full_state(step)))
        ckpt.wait()
    finally:
        ckpt.close()
    again = dcpstore.Checkpointer(args["root"], **args["options"])
    try:
        latest = again.latest()
        steps = again.steps()
        state = zeros_like(sharded(full_state(4)))
        loaded = again.load(state)
    finally:
        again.close()
    return {"latest": latest, "steps": [int(s) for s in steps],
            "loaded": None if loaded is None else int(loaded),
            "mismatched": matches(state, full_state(4))}


def op_killed_save(args: dict[str, Any]) -> dict[str, Any]:
    """Commit step 1, then save a large step 2; the test kills one host during it
    (``<out>/step2-started`` tells it when)."""
    ckpt = dcpstore.Checkpointer(args["root"], async_mode=args["mode"], **args["options"])
    ckpt.save(1, sharded(full_state(1)))
    ckpt.wait()
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args["out"], "step2-started"), "w") as f:
            f.write(str(time.time()))
    ckpt.save(2, sharded(full_state(2, scale=args["scale"])))
    ckpt.wait()
    ckpt.close()
    return {"saved": 2}


def op_tier(args: dict[str, Any]) -> dict[str, Any]:
    """A Checkpointer with a node-local tier (this host's ``DCPSTORE_TEST_TIER``): save
    steps 1 and 2 and drain them (``"save"``), or load the newest (``"load"``)."""
    tier = os.path.join(os.environ["DCPSTORE_TEST_TIER"], args["name"])
    ckpt = dcpstore.Checkpointer(args["root"], local_tier=tier,
                                 local_replicas=args.get("replicas", 1), **args["options"])
    try:
        if args["phase"] == "save":
            for step in (1, 2):
                ckpt.save(step, sharded(full_state(step, args.get("scale", 1))))
            ckpt.wait()
            copied = ckpt.last_replication
            return {"tier": tier, "replication": None if copied is None else vars(copied)}
        full = full_state(2, args.get("scale", 1))
        state = zeros_like(sharded(full))
        loaded = ckpt.load(state)
        return {"loaded": loaded, "where": ckpt.last_load["where"],
                "seconds": ckpt.last_load["seconds"], "mismatched": matches(state, full)}
    finally:
        ckpt.close()


_OPS = {"save": op_save, "load": op_load, "checkpointer": op_checkpointer,
        "killed_save": op_killed_save, "tier": op_tier}


if __name__ == "__main__":
    run_rank_op(_OPS)
