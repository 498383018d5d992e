"""torch's save-plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) with the
dcpstore writer, on 2 gloo ranks: repeated saves reuse the plan yet each gets a fresh
save id (an overwrite included), the coordinator's sharding guard is skipped while the
plan is unchanged and runs again when it changes, and every checkpoint loads back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp import run_ranks
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcpstore
from dcpstore.dcp import layout
from dcpstore.dcp import writer as writer_module
from dcpstore.dcp.metadata_io import load_metadata
from dcpstore.storage.local import LocalBackend

pytestmark = pytest.mark.multiprocess


def _state(mesh: Any, value: float, *, extra: bool = False) -> dict[str, Any]:
    full = torch.arange(64.0).reshape(16, 4) + value
    state: dict[str, Any] = {"w": distribute_tensor(full, mesh, [Shard(0)]),
                             "norm": torch.full((4,), value), "step": int(value)}
    if extra:
        state["bias"] = torch.full((3,), -value)
    return state


def _cached_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    guard_runs: list[int] = []
    real_guard = writer_module.check_global_plan

    def counting_guard(summaries: Any) -> None:
        guard_runs.append(len(summaries))
        real_guard(summaries)

    writer_module.check_global_plan = counting_guard
    planner = DefaultSavePlanner(enable_plan_caching=True)
    usable: list[bool] = []
    real_local = writer_module.Writer.prepare_local_plan

    def noting_local(self: Any, plan: SavePlan) -> SavePlan:
        usable.append(plan.usable)
        return real_local(self, plan)

    writer_module.Writer.prepare_local_plan = noting_local  # type: ignore[method-assign]
    saves = [("a", 1.0, False, False), ("b", 2.0, False, False),  # the same plan again
             ("a", 3.0, False, True),                              # ... overwriting "a"
             ("c", 4.0, True, False),                              # the plan changes
             ("d", 5.0, True, False)]                              # and is reused
    ids: dict[str, str] = {}
    for name, value, extra, overwrite in saves:
        writer = dcpstore.get_writer(os.path.join(root, name), overwrite=overwrite)
        dcp.save(_state(mesh, value, extra=extra), storage_writer=writer, planner=planner)
        ids[f"{name}@{value}"] = writer.save_id
    # a changed plan with per-rank plain state: the guard runs again and refuses it
    bad = {"w": _state(mesh, 6.0)["w"], "buf": torch.zeros(rank + 1)}
    refused = ""
    try:
        dcp.save(bad, storage_writer=dcpstore.get_writer(os.path.join(root, "e")),
                 planner=planner)
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        refused = str(exc)
    loaded = {}
    for name, extra in {n: e for n, _, e, _ in saves}.items():
        target = _state(mesh, -100.0, extra=extra)
        dcpstore.load(target, os.path.join(root, name))
        w = target["w"]
        assert isinstance(w, DTensor)
        loaded[name] = {"w": w.full_tensor(), "norm": target["norm"], "step": target["step"],
                        **({"bias": target["bias"]} if extra else {})}
    # load_model_weights: the coordinator alone reads the keys, every rank gets them
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(16, 4))
    model.norm = torch.nn.Parameter(torch.zeros(4))
    dcpstore.load_model_weights(model, os.path.join(root, "b"))
    weights = {"w": model.w.detach().clone(), "norm": model.norm.detach().clone()}
    return {"ids": ids, "guard_runs": guard_runs, "usable": usable, "refused": refused,
            "loaded": loaded, "weights": weights}


def test_plan_caching_reuses_the_plan_with_a_fresh_save_id(tmp_path: Path) -> None:
    root = str(tmp_path)
    results = run_ranks(_cached_saves, 2, root)
    rank0, rank1 = results
    # torch's cache was really used: unchanged local plans arrived unusable
    assert rank1["usable"] == [True, False, False, True, False, True]
    # the guard ran for the first plan and each changed one, never for a cached one
    assert rank0["guard_runs"] == [2, 2, 2] and rank1["guard_runs"] == []
    assert "'buf'" in rank0["refused"] and "different shapes" in rank0["refused"]
    assert not (tmp_path / "e" / ".metadata").exists()

    for rank in results:
        assert torch.equal(rank["weights"]["w"], torch.arange(64.0).reshape(16, 4) + 2.0)
        assert torch.equal(rank["weights"]["norm"], torch.full((4,), 2.0))

    # every save had its own id, the same on both ranks, and the store agrees
    assert rank0["ids"] == rank1["ids"]
    assert len(set(rank0["ids"].values())) == 5
    for name, value in (("a", 3.0), ("b", 2.0), ("c", 4.0), ("d", 5.0)):
        backend = LocalBackend(str(tmp_path / name))
        metadata, _ = load_metadata(backend)
        save_id = rank0["ids"][f"{name}@{value}"]
        assert layout.save_id_of_metadata(metadata) == save_id
        files = sorted(p.name for p in (tmp_path / name).glob("__*"))
        assert len(files) == 2 and {layout.save_id_of(f) for f in files} == {save_id}
        for got in (rank0["loaded"][name], rank1["loaded"][name]):
            assert torch.equal(got["w"], torch.arange(64.0).reshape(16, 4) + value)
            assert torch.equal(got["norm"], torch.full((4,), value))
            assert got["step"] == int(value)
            if name in ("c", "d"):
                assert torch.equal(got["bias"], torch.full((3,), -value))
