"""Multi-process DCP on the local backend: FSDP2 + AdamW, reshard, sharding guard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_workers import load_fsdp, save_fsdp
from mp import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcpstore
from dcpstore.testing import assert_state_equal

pytestmark = pytest.mark.multiprocess


def test_fsdp2_save_2_load_2_and_1(tmp_path: Path) -> None:
    uri = str(tmp_path / "step-1")
    saved = run_ranks(save_fsdp, 2, uri, {})[0]
    for ws in (2, 1):
        loaded = run_ranks(load_fsdp, ws, uri, {})[0]
        assert_state_equal(loaded["model"], saved["model"])
        assert_state_equal(loaded["optim"], saved["optim"])
    assert len(list((tmp_path / "step-1").glob("__*.distcp"))) == 2


def _save_per_rank_plain(rank: int, world_size: int, uri: str) -> str:
    try:
        dcpstore.save({"buf": torch.zeros(rank + 1)}, uri)
    except dcpstore.ShardingError as exc:
        return str(exc)
    return "saved"


def test_sharding_guard_trips_on_every_rank(tmp_path: Path) -> None:
    uri = str(tmp_path / "bad")
    messages = run_ranks(_save_per_rank_plain, 2, uri)
    for msg in messages:
        assert "'buf'" in msg and "different shapes" in msg
    assert not (tmp_path / "bad" / ".metadata").exists()
    assert not list((tmp_path / "bad").glob("__*")) if (tmp_path / "bad").exists() else True


def _save_plain_optimizer_state(rank: int, world_size: int, uri: str) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    weight = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
    local = weight.to_local().clone()  # the bug: optimizer keeps plain local shards
    state: dict[str, Any] = {"model": {"layer.weight": weight},
                             "optim": {"state": {"layer.weight": {"exp_avg": local}}}}
    try:
        dcp.save(state, storage_writer=dcpstore.get_writer(uri))
    except BaseException as exc:  # DCP wraps it in a CheckpointException carrying ours
        return str(exc)
    return "saved"


def test_sharding_guard_plain_optimizer_state_of_dtensor_param(tmp_path: Path) -> None:
    messages = run_ranks(_save_plain_optimizer_state, 2, str(tmp_path / "fused"))
    for msg in messages:
        assert "optim.state.layer.weight.exp_avg" in msg
        assert "Keep optimizer state as DTensors" in msg


def _async_save(rank: int, world_size: int, uri: str, kind: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    mesh = init_device_mesh("cpu", (world_size,))
    t = distribute_tensor(torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)])
    checkpointer = (AsyncCheckpointerType.PROCESS if kind == "process"
                    else AsyncCheckpointerType.THREAD)
    fut = dcp.async_save({"t": t, "step": 3}, storage_writer=dcpstore.get_writer(uri),
                         async_checkpointer_type=checkpointer)
    result = fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
    del result
    dist.barrier()
    out = {"t": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "step": 0}
    dcpstore.load(out, uri)
    assert torch.equal(out["t"].full_tensor(), torch.arange(64.0).reshape(16, 4))
    assert out["step"] == 3


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_async_save(tmp_path: Path, kind: str) -> None:
    run_ranks(_async_save, 2, str(tmp_path / kind), kind)


def _checkpointer_process_mode(rank: int, world_size: int, root: str) -> list[int]:
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = dcpstore.Checkpointer(root, keep_last=1, async_mode="process")
    for step in (1, 2):
        t = distribute_tensor(torch.full((8, 2), float(step)), mesh, [Shard(0)])
        ckpt.save(step, {"t": t})
    ckpt.wait()
    out = {"t": distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)])}
    assert ckpt.load(out) == 2
    assert torch.equal(out["t"].full_tensor(), torch.full((8, 2), 2.0))
    steps = ckpt.steps()
    ckpt.close()
    return steps


def test_checkpointer_async_process_mode_with_retention(tmp_path: Path) -> None:
    assert run_ranks(_checkpointer_process_mode, 2, str(tmp_path)) == [[2], [2]]
