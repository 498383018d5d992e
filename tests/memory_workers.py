"""Rank function of the memory-per-rank test: what each rank of a ``dcp.load`` holds of
the integrity manifest and the chunk index, with and without read sharing."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dcpstore
from dcpstore.dcp import layout
from dcpstore.dcp.metadata_io import load_metadata, read_manifest

__all__ = ["memory_run"]


def _state(tensors: int, fill: bool) -> dict[str, Any]:
    """``tensors`` DTensors sharded over every rank (one chunk per rank each) and one
    plain tensor every rank loads whole."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    rows = 4
    state: dict[str, Any] = {
        f"layer{i}.w": DTensor.from_local(
            torch.arange(rows, dtype=torch.float32) + 100 * i + rows * rank if fill
            else torch.zeros(rows), mesh, [Shard(0)], run_check=False,
            shape=torch.Size((rows * world,)), stride=(1,))
        for i in range(tensors)}
    state["step"] = torch.tensor(7.0 if fill else 0.0)
    return state


class _DroppingPlanner(DefaultLoadPlanner):
    """A planner whose ``finish_plan`` drops ``LoadPlan.storage_data``."""

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(super().finish_plan(central_plan), storage_data=None)


def memory_run(rank: int, world: int, root: str, tensors: int) -> dict[str, Any]:
    """Save, then load three ways; per load, the manifest records and chunk index
    entries this rank holds."""
    dcpstore.save(_state(tensors, True), root)
    backend = dcpstore.open_backend(root)
    metadata, _ = load_metadata(backend)
    full = read_manifest(backend, layout.save_id_of_metadata(metadata, source=root))
    backend.close()
    assert full is not None
    out: dict[str, Any] = {"total_items": full.item_count}
    for phase, options, planner in (
        ("alone", {"broadcast_reads": False}, None),
        ("shared", {"broadcast_reads": True}, None),
        ("dropped", {"broadcast_reads": False}, _DroppingPlanner()),
    ):
        state = _state(tensors, False)
        reader = dcpstore.get_reader(root, **options)
        dcp.load(state, storage_reader=reader, planner=planner)
        expected = _state(tensors, True)
        for key, value in state.items():
            got = value.to_local() if isinstance(value, DTensor) else value
            want = expected[key]
            want = want.to_local() if isinstance(want, DTensor) else want
            assert torch.equal(got, want), (phase, key)
        assert reader.manifest is not None, phase
        out[phase] = {"items": reader.manifest.item_count,
                      "chunks": len(reader._chunks)}
        reader.backend.close()
        dist.barrier()
    return out
