"""Rank functions of the resharding matrix (save at N ranks, load at M)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from mp import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpstore
from dcpstore.testing import assert_state_equal

SAVE_STEP = 2
MORE_STEPS = 3
#: saved placement -> placement used when loading (Shard(0) vs Shard(1) / Replicate)
PLACEMENTS = {
    "s0": (Shard(0), Shard(1)),
    "s1": (Shard(1), Replicate()),
    "rep": (Replicate(), Shard(0)),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 30)
        self.hidden = nn.Linear(30, 30)
        self.out = nn.Linear(30, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def _model(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.hidden, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    # the same global batch on every rank: training is independent of the world size
    x = torch.randn(32, 12, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def _dtensors(world: int, which: int) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (world,))
    base = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10)
    return {
        name: distribute_tensor(
            base * (i + 1) if which == 0 else torch.zeros(7, 10), mesh, [placements[which]]
        )
        for i, (name, placements) in enumerate(PLACEMENTS.items())
    }


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    m, o = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    # at world size 1 these may alias the live parameters: copy before training goes on
    return _clone({"model": m, "optim": o})


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def save_run(rank: int, world: int, root: str, options: dict[str, Any]) -> dict[str, Any] | None:
    model, optim = _model(world, seed=0)
    for step in range(1, SAVE_STEP + 1):
        _step(model, optim, step)
    ckpt = dcpstore.Checkpointer(root, **options)
    ckpt.save(SAVE_STEP, {"app": dcpstore.AppState(model, optim), "dt": _dtensors(world, 0)})
    full = _full(model, optim)
    losses = [_step(model, optim, s) for s in range(SAVE_STEP + 1, SAVE_STEP + MORE_STEPS + 1)]
    return {"state": full, "losses": losses} if rank == 0 else None


def load_run(rank: int, world: int, roots: list[str], options: dict[str, Any]) -> list[Any] | None:
    out = []
    for root in roots:
        model, optim = _model(world, seed=1234)
        ckpt = dcpstore.Checkpointer(root, **options)
        dts = _dtensors(world, 1)
        step = ckpt.load({"app": dcpstore.AppState(model, optim), "dt": dts})
        full = _full(model, optim)
        dt_full = {k: v.full_tensor() for k, v in dts.items()}
        losses = [_step(model, optim, s) for s in range(step + 1, step + MORE_STEPS + 1)]
        out.append({"state": full, "losses": losses, "dt": dt_full, "step": step})
    return out if rank == 0 else None


#: world sizes saved at / loaded at
SAVE_SIZES = (1, 2, 4)
LOAD_SIZES = (1, 2, 3, 4)


def run_matrix(
    root: str,
    options: dict[str, Any],
    save_sizes: tuple[int, ...] = SAVE_SIZES,
    load_sizes: tuple[int, ...] = LOAD_SIZES,
) -> None:
    roots = [f"{root}/saved-at-{n}" for n in save_sizes]
    reference = [
        run_ranks(save_run, n, r, options)[0] for n, r in zip(save_sizes, roots, strict=True)
    ]
    base = torch.arange(70, dtype=torch.float32).reshape(7, 10)
    for m in load_sizes:
        results = run_ranks(load_run, m, roots, options)[0]
        for n, ref, got in zip(save_sizes, reference, results, strict=True):
            where = f"saved at {n} ranks, loaded at {m}"
            assert got["step"] == SAVE_STEP, where
            assert_state_equal(got["state"], ref["state"], where)
            for i, name in enumerate(PLACEMENTS):
                assert torch.equal(got["dt"][name], base * (i + 1)), f"{where}: {name}"
            torch.testing.assert_close(
                torch.tensor(got["losses"]),
                torch.tensor(ref["losses"]),
                rtol=1e-5,
                atol=1e-7,
                msg=where,
            )




# -- reshard reads: only the payload blocks each rank needs -------------------------------

BIG = (4096, 512)  # 8 MiB of float32


def _big(world: int, placement: Any, fill: bool) -> DTensor:
    mesh = init_device_mesh("cpu", (world,))
    full = (torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG) if fill
            else torch.zeros(BIG))
    return distribute_tensor(full, mesh, [placement])


def save_big(rank: int, world: int, uri: str) -> None:
    dcpstore.save({"rows": _big(world, Shard(0), True)}, uri)


def load_big(rank: int, world: int, uri: str) -> dict[str, Any]:
    state = {"rows": _big(world, Shard(0), False)}
    reader = dcpstore.get_reader(uri)
    dcp.load(state, storage_reader=reader)
    expected = torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG)
    return {
        "exact": all(torch.equal(v.full_tensor(), expected) for v in state.values()),
        "bytes_read": reader.bytes_read,
        "bytes_needed": reader.bytes_needed,
        "local_bytes": sum(v.to_local().nbytes for v in state.values()),
        "items_partial": reader.items_partial,
        "items_direct": reader.items_direct,
    }
