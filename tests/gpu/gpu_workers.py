"""Rank functions of the GPU suite (importable by the ranks the launcher forks).

Each builds the tests' small FSDP2 model (:mod:`fsdp_workers`) on ``device`` (``"cuda"``:
the rank's current GPU), trains it, and checks a save/load path bit-exact against the
state gathered before the save. Values are compared on the CPU.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_workers import build, full_state, sharded_state, train
from torch.distributed.checkpoint.state_dict import set_state_dict

import dcpstore
from dcpstore.testing import assert_state_equal

__all__ = [
    "checkpointer_round_trip",
    "load_and_compare",
    "lose_device_mid_save",
    "read_shared_load",
    "routed_round_trip",
    "save_and_reload",
]


def _local_devices(state: Any) -> set[str]:
    """The device types of every tensor (a DTensor's local shard) in ``state``."""
    out: set[str] = set()
    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", state)
        out.add(local.device.type)
    elif isinstance(state, dict):
        for v in state.values():
            out |= _local_devices(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            out |= _local_devices(v)
    return out


def _optimizer_tensors_on(state: dict[str, Any], device: str) -> None:
    """The model's and the optimizer's moments live on ``device`` (the AdamW ``step``
    counters are CPU scalars by torch's design)."""
    model = _local_devices(state["model"])
    moments = _local_devices({k: {n: v for n, v in s.items() if n != "step"}
                              for k, s in state["optim"]["state"].items()})
    assert model == {device} and moments == {device}, (model, moments)


def _set(model: Any, optim: Any, state: dict[str, Any]) -> None:
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def save_and_reload(rank: int, world: int, uri: str, device: str) -> dict[str, Any] | None:
    """Train, ``dcpstore.save`` the sharded model and optimizer, load into a model built
    from another seed: the gathered state is bit-exact, the loaded tensors stay on
    ``device``, and both models train on identically. Returns rank 0's saved state."""
    model, optim = build(world, seed=1, device=device)
    train(model, optim, steps=2)
    state = sharded_state(model, optim)
    _optimizer_tensors_on(state, device)
    dcpstore.save(state, uri)
    want = full_state(model, optim)

    model2, optim2 = build(world, seed=99, device=device)
    state2 = sharded_state(model2, optim2)
    dcpstore.load(state2, uri)
    _optimizer_tensors_on(state2, device)  # loaded in place, on the device
    _set(model2, optim2, state2)
    assert_state_equal(full_state(model2, optim2), want)
    assert train(model, optim, 2, seed=11) == train(model2, optim2, 2, seed=11)
    return want if rank == 0 else None


def load_and_compare(rank: int, world: int, uri: str, device: str,
                     want: dict[str, Any]) -> bool:
    """Load ``uri`` into a fresh sharded model on ``device``; compare with ``want`` (rank
    0's gathered state)."""
    model, optim = build(world, seed=99, device=device)
    state = sharded_state(model, optim)
    dcpstore.load(state, uri)
    _optimizer_tensors_on(state, device)
    _set(model, optim, state)
    got = full_state(model, optim)  # gathered on rank 0 alone
    if rank == 0:
        assert_state_equal(got, want)
    return True


def routed_round_trip(rank: int, world: int, uri: str, device: str) -> bool:
    """Plain ``dcp.save`` / ``dcp.load`` by checkpoint id, routed to dcpstore."""
    from dcpstore.integrations import dcp_routing
    from dcpstore.tools.verify import verify_checkpoint

    model, optim = build(world, seed=1, device=device)
    train(model, optim, steps=1)
    with dcp_routing.routing():
        dcp.save(sharded_state(model, optim), checkpoint_id=uri)
        want = full_state(model, optim)
        model2, optim2 = build(world, seed=99, device=device)
        state = sharded_state(model2, optim2)
        dcp.load(state, checkpoint_id=uri)
    _set(model2, optim2, state)
    assert_state_equal(full_state(model2, optim2), want)
    if rank == 0:  # dcpstore wrote it: its manifest verifies every byte
        report = verify_checkpoint(uri)
        assert report.ok, report
    return True


def checkpointer_round_trip(rank: int, world: int, root: str, device: str, mode: str | None,
                            local_tier: str | None) -> dict[str, Any]:
    """``Checkpointer`` saves of GPU state in ``mode``: the state modified right after
    ``save`` returns never reaches the checkpoint; a fresh model resumes bit-exact
    (from the local tier when there is one, then from the root alone)."""
    from dcpstore.dcp.staging import StagingOptions

    staging = StagingOptions(use_pinned_memory=True, use_async_staging=True) if mode else None
    tier = local_tier  # the node's disk: one directory for the ranks of one host
    model, optim = build(world, seed=1, device=device)
    ckpt = dcpstore.Checkpointer(root, async_mode=mode,  # type: ignore[arg-type]
                                 staging=staging, keep_last=2, local_tier=tier)
    wants = {}
    for step in (1, 2):
        train(model, optim, steps=1)
        wants[step] = full_state(model, optim)
        ckpt.save(step, {"app": dcpstore.AppState(model, optim)})
        with torch.no_grad():  # queued on the GPU right after save returned
            for p in model.parameters():
                p.add_(1.0)
    ckpt.wait()
    assert ckpt.steps() == [1, 2], ckpt.steps()

    model2, optim2 = build(world, seed=99, device=device)
    assert ckpt.load({"app": dcpstore.AppState(model2, optim2)}) == 2
    where = ckpt.last_load["where"]
    assert_state_equal(full_state(model2, optim2), wants[2])
    stager_allocations = ckpt.stager.allocations if ckpt.stager is not None else 0
    ckpt.close()
    if tier is not None:  # the root alone, as after losing the node's disk
        import shutil

        dist.barrier()
        if rank == 0:
            shutil.rmtree(tier)
        dist.barrier()
        ckpt = dcpstore.Checkpointer(root, local_tier=tier)
        model3, optim3 = build(world, seed=98, device=device)
        assert ckpt.load({"app": dcpstore.AppState(model3, optim3)}, step=1) == 1
        assert ckpt.last_load["where"] == "remote"
        assert_state_equal(full_state(model3, optim3), wants[1])
        ckpt.close()
    return {"where": where, "stager_allocations": stager_allocations}


def read_shared_load(rank: int, world: int, uri: str, device: str) -> str:
    """A load whose reads the ranks share; returns the backend of the group that moved
    the shared bytes (a gloo side group when the default group is NCCL)."""
    from dcpstore.dcp import read_share

    model, optim = build(world, seed=1, device=device)
    train(model, optim, steps=1)
    dcpstore.save(sharded_state(model, optim), uri)
    want = full_state(model, optim)
    model2, optim2 = build(world, seed=99, device=device)
    state = sharded_state(model2, optim2)
    seen: list[str] = []
    original = read_share.share_context

    def spy(reader: Any) -> Any:
        ctx = original(reader)
        if ctx is not None:
            seen.append(str(dist.get_backend(ctx.group)))
        return ctx

    read_share.share_context = spy  # type: ignore[assignment]
    try:
        dcpstore.load(state, uri, broadcast_reads=True)
    finally:
        read_share.share_context = original  # type: ignore[assignment]
    _set(model2, optim2, state)
    assert_state_equal(full_state(model2, optim2), want)
    assert seen, "the load did not share its reads"
    return seen[0]


def lose_device_mid_save(root: str) -> str:
    """In a process of its own: a committed step 1, then a CUDA context lost to a
    device-side assert, then step 2's save. Returns the error step 2 raised."""
    state = {"w": torch.randn(1 << 20, device="cuda"), "step": 1}
    ckpt = dcpstore.Checkpointer(root)
    ckpt.save(1, state)
    torch.save(state["w"].cpu(), os.path.join(os.path.dirname(root), "want.pt"))
    # an out-of-range index trips a device-side assert: the process's context is lost
    with contextlib.suppress(RuntimeError):
        torch.zeros(4, device="cuda")[torch.tensor([1 << 30], device="cuda")].sum().item()
    try:
        ckpt.save(2, state)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("the save of a lost device's tensors succeeded")
