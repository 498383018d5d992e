"""Rank functions of tests/seeds/test_physicsnemo.py: PhysicsNeMo's own models and its own
``physicsnemo.utils`` checkpoint functions, on gloo ranks (tests/mp.py), after the one import
``import dcpstore.integrations.physicsnemo``.

Each rank first calls :func:`adopt_process_group` (the test-only CPU shim, see below) and
then ``DistributedManager.initialize()`` as a PhysicsNeMo training script does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import dcpstore.integrations.physicsnemo  # noqa: F401  the user's one change

#: The learning-rate schedule every run uses: StepLR(step_size=2, gamma=0.5).
STEP_SIZE, GAMMA = 2, 0.5


def adopt_process_group() -> None:
    """Test-only shim for ``DistributedManager.initialize()`` on the CPU.

    PhysicsNeMo 2.2.2 (``distributed/manager.py:590``) calls
    ``init_process_group(..., device_id=torch.device("cpu"))``; torch 2.14 refuses that with
    ``ValueError: init_process_group device_id parameter must be an accelerator with an
    index`` and PhysicsNeMo catches only ``TypeError`` (test_distributed_manager_on_cpu
    pins the error). Here the launcher (tests/mp.py) has made the gloo group already, so
    the manager adopts it; elsewhere a CPU ``device_id`` is dropped.
    """
    original = dist.init_process_group
    if getattr(original, "_dcpstore_shim", False):
        return

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            return
        device = kwargs.get("device_id")
        if device is not None and torch.device(device).type == "cpu":
            kwargs.pop("device_id")
        original(*args, **kwargs)

    init._dcpstore_shim = True  # type: ignore[attr-defined]
    dist.init_process_group = init


def _manager() -> Any:
    from physicsnemo.distributed import DistributedManager

    adopt_process_group()
    DistributedManager.initialize()
    manager = DistributedManager()
    assert manager.distributed and str(manager.device) == "cpu", manager.device
    return manager


def fno(seed: int) -> torch.nn.Module:
    """A small PhysicsNeMo FNO (2-D, spectral convolutions)."""
    from physicsnemo.models.fno import FNO

    torch.manual_seed(seed)
    return FNO(in_channels=2, out_channels=1, decoder_layers=1, decoder_layer_size=8,
               dimension=2, latent_channels=8, num_fno_layers=2, num_fno_modes=4, padding=2)


def fno_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(4, 2, 16, 16, generator=g), torch.randn(4, 1, 16, 16, generator=g)


def fully_connected(seed: int) -> torch.nn.Module:
    from physicsnemo.models.mlp import FullyConnected

    torch.manual_seed(seed)
    return FullyConnected(in_features=8, layer_size=32, out_features=4, num_layers=3)


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def full_state(model: torch.nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Model and optimizer state as full tensors keyed by FQN (the same at every world
    size and mesh), for bit-exact comparison (collective)."""
    out: dict[str, Any] = {"model": _full(dict(model.state_dict()))}
    if optimizer is not None:
        out["optim"] = _full(get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True)))
    return out


def _trainer(model: torch.nn.Module, x: Any, y: Any) -> tuple[Any, Any, Any]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE, gamma=GAMMA)

    def step() -> float:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        # a ShardTensor loss (not a DTensor subclass) holds this rank's part until gathered
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return float(value.item())

    return optimizer, scheduler, step


def fno_save(rank: int, world: int, root: str, bad_root: str) -> dict[str, Any]:
    """FSDP2 FNO on ``world`` ranks: epochs 1, 2, 3 through PhysicsNeMo's save_checkpoint."""
    from physicsnemo.utils import save_checkpoint
    from torch.distributed.fsdp import fully_shard

    from dcpstore.errors import ShardingError

    manager = _manager()
    mesh = manager.initialize_mesh((world,), ("ddp",))
    model = fno(0)
    fully_shard(model, mesh=mesh)
    x, y = fno_data()
    optimizer, scheduler, step = _trainer(model, x, y)
    states: dict[int, Any] = {}
    losses = {}
    for epoch in (1, 2, 3):
        losses[epoch] = step()
        save_checkpoint(root, models=model, optimizer=optimizer, scheduler=scheduler,
                        epoch=epoch, metadata={"loss": losses[epoch], "run": "fno"})
        states[epoch] = full_state(model, optimizer)
    scheduler_state = dict(scheduler.state_dict())
    next_loss = step()
    # a plain tensor that differs between ranks beside the FSDP2 model: refused at save
    per_rank = torch.nn.Linear(3, 2 + rank)
    refused = ""
    try:
        save_checkpoint(bad_root, models=[model, per_rank], epoch=1)
    except ShardingError as exc:
        refused = str(exc)
    shards = {name: (tuple(p.to_local().shape), tuple(p.shape))
              for name, p in model.named_parameters()}
    if rank:
        return {"refused": refused, "shards": shards}
    return {"states": states, "losses": losses, "next_loss": next_loss,
            "scheduler": scheduler_state, "refused": refused, "shards": shards}


def fno_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Fresh FSDP2 FNOs on ``world`` ranks load what :func:`fno_save` wrote."""
    from physicsnemo.utils import load_checkpoint, load_model_weights
    from torch.distributed.fsdp import fully_shard


    manager = _manager()
    mesh = manager.initialize_mesh((world,), ("ddp",))
    x, y = fno_data()
    out: dict[str, Any] = {}

    model = fno(1)
    fully_shard(model, mesh=mesh)
    optimizer, scheduler, step = _trainer(model, x, y)
    meta: dict[str, Any] = {}
    out["epoch"] = load_checkpoint(root, models=model, optimizer=optimizer,
                                   scheduler=scheduler, metadata_dict=meta)
    out["meta"], out["scheduler"] = meta, dict(scheduler.state_dict())
    out["latest"] = full_state(model, optimizer)
    out["next_loss"] = step()

    model2 = fno(2)
    fully_shard(model2, mesh=mesh)
    optimizer2, scheduler2, _ = _trainer(model2, x, y)
    meta2: dict[str, Any] = {}
    out["epoch2"] = load_checkpoint(root, models=model2, optimizer=optimizer2,
                                    scheduler=scheduler2, epoch=2, metadata_dict=meta2)
    out["meta2"], out["state2"] = meta2, full_state(model2, optimizer2)

    model3 = fno(3)
    fully_shard(model3, mesh=mesh)
    # PhysicsNeMo's own model-file name: the weights of epoch 1, from its checkpoint
    load_model_weights(model3, f"{root}/FNO.0.1.mdlus")
    out["weights1"] = full_state(model3)["model"]
    if world == 1:  # a plain model (no FSDP), loaded by this process alone
        plain = fno(4)
        load_model_weights(plain, f"{root}/checkpoint.0.2")
        out["plain2"] = full_state(plain)["model"]
    return out if rank == 0 else {"epoch": out["epoch"], "next_loss": out["next_loss"]}


def shard_tensor_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Domain parallelism: a ShardTensor batch split over a (1, world) mesh's domain axis,
    FullyConnected under FSDP2 on the ddp axis; save, then a fresh model loads it."""
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor, sync_module_over_mesh
    from physicsnemo.utils import load_checkpoint, save_checkpoint
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard


    manager = _manager()
    mesh = manager.initialize_mesh((1, world), ("ddp", "domain"))
    domain = mesh["domain"]
    g = torch.Generator().manual_seed(7)
    full_x, full_y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    x = scatter_tensor(full_x if rank == 0 else None, 0, domain, (Shard(0),))
    y = scatter_tensor(full_y if rank == 0 else None, 0, domain, (Shard(0),))
    assert isinstance(x, ShardTensor) and tuple(x.to_local().shape) == (16 // world, 8)

    def build(seed: int) -> tuple[torch.nn.Module, Any, Any, Any]:
        model = fully_connected(seed)
        sync_module_over_mesh(model, domain)
        fully_shard(model, mesh=mesh["ddp"])
        return (model, *_trainer(model, x, y))

    model, optimizer, scheduler, step = build(0)
    loss = step()
    save_checkpoint(root, models=model, optimizer=optimizer, scheduler=scheduler, epoch=1)
    saved = full_state(model, optimizer)
    next_loss = step()
    model2, optimizer2, scheduler2, step2 = build(9)
    epoch = load_checkpoint(root, models=model2, optimizer=optimizer2, scheduler=scheduler2)
    loaded = full_state(model2, optimizer2)
    return {"loss": loss, "epoch": epoch, "saved": saved, "loaded": loaded,
            "next_loss": next_loss, "next_loss_loaded": step2(),
            "input": type(x).__name__}
