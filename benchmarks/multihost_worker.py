"""What each rank of ``python -m benchmarks.multihost`` runs, started by ``torchrun`` on a
host made of a network namespace (:mod:`dcpstore.testing.hosts`).

    python -m torch.distributed.run ... benchmarks/multihost_worker.py <op> <json args>

Each rank writes ``<out>/<op>-rank<rank>.json`` and leaves with ``os._exit``
(:func:`dcpstore.testing.hosts.run_rank_op`). The state is ``size`` bytes per rank in 4
float32 DTensors sharded by rows, each rank's rows drawn from a seed of (step, rank), so
any world of the same size can check what it loaded without the whole state.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dcpstore
from dcpstore.testing.hosts import run_rank_op

_TENSORS = 4
_COLS = 1024


def _local(step: int, size: int) -> dict[str, torch.Tensor]:
    rows = size // (_TENSORS * _COLS * 4)
    g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    return {f"layer{i}": torch.randn(rows, _COLS, generator=g) for i in range(_TENSORS)}


def _state(step: int, size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False)
            for k, v in _local(step, size).items()}


def _zeros(size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: DTensor.from_local(torch.zeros_like(v), mesh, [Shard(0)], run_check=False)
            for k, v in _local(0, size).items()}


def _which(state: dict[str, Any], size: int, steps: list[int]) -> int | None:
    """The step whose values this rank's shards hold exactly (``None``: none: torn)."""
    for step in steps:
        want = _local(step, size)
        if all(torch.equal(state[k].to_local(), want[k]) for k in want):
            return step
    return None


def _train_step(work: torch.Tensor) -> float:
    """A fixed amount of compute; its duration."""
    started = time.perf_counter()
    for _ in range(8):
        work = torch.tanh(work @ work) * 0.5
    return time.perf_counter() - started


def _tier(args: dict[str, Any]) -> str:
    return os.path.join(os.environ["DCPSTORE_TEST_TIER"], args["name"])


def op_save(args: dict[str, Any]) -> dict[str, Any]:
    """Step 1, then step 2 while training steps run: their times against steps with no
    save in flight, ``save``'s blocked time, and the replication's own figures."""
    size = args["size"]
    ckpt = dcpstore.Checkpointer(args["root"], local_tier=_tier(args), async_mode="thread",
                                 local_replicas=args["replicas"], **args["options"])
    work = torch.randn(256, 256)
    try:
        ckpt.save(1, _state(1, size))
        ckpt.wait()
        quiet = [_train_step(work) for _ in range(args["steps"])]
        dist.barrier()
        state = _state(2, size)
        ckpt.save(2, state)
        blocked = ckpt.last_timings["blocked_s"]
        busy = []
        while ckpt.last_timings.get("durable_s") is None and len(busy) < 10_000:
            busy.append(_train_step(work))
        ckpt.wait()
        copied = ckpt.last_replication
        return {"blocked_s": blocked, "durable_s": ckpt.last_timings["durable_s"],
                "quiet_step_s": statistics.median(quiet),
                "busy_step_s": statistics.median(busy) if busy else None,
                "busy_steps": len(busy),
                "replication": None if copied is None else vars(copied)}
    finally:
        ckpt.close()


def op_load(args: dict[str, Any]) -> dict[str, Any]:
    """Load the newest step (from the tier, or the root with ``tier`` false)."""
    size = args["size"]
    tier = _tier(args) if args["tier"] else None
    ckpt = dcpstore.Checkpointer(args["root"], local_tier=tier, **args["options"])
    try:
        state = _zeros(size)
        dist.barrier()
        loaded = ckpt.load(state)
        return {"loaded": loaded, "where": ckpt.last_load["where"],
                "seconds": ckpt.last_load["seconds"],
                "holds": _which(state, size, [loaded])}
    finally:
        ckpt.close()


def op_killed(args: dict[str, Any]) -> dict[str, Any]:
    """Step 1 committed and drained; then step 2, during which the harness kills a host."""
    size = args["size"]
    ckpt = dcpstore.Checkpointer(args["root"], local_tier=_tier(args), async_mode="thread",
                                 **args["options"])
    ckpt.save(1, _state(1, size))
    ckpt.wait()
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args["out"], "step2-started"), "w") as f:
            f.write(str(time.time()))
    ckpt.save(2, _state(2, size))
    ckpt.wait()
    ckpt.close()
    return {"saved": 2}


def op_resume(args: dict[str, Any]) -> dict[str, Any]:
    """After a kill: the newest step every rank agrees on, and which step's values it got."""
    size = args["size"]
    ckpt = dcpstore.Checkpointer(args["root"], local_tier=_tier(args), **args["options"])
    try:
        state = _zeros(size)
        loaded = ckpt.load(state)
        return {"loaded": loaded, "where": ckpt.last_load["where"],
                "steps": [int(s) for s in ckpt.steps()],
                "holds": _which(state, size, [1, 2])}
    finally:
        ckpt.close()


_OPS = {"save": op_save, "load": op_load, "killed": op_killed, "resume": op_resume}


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_rank_op(_OPS)
