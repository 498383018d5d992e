"""Rank functions reproducing the seeds' own checkpoint call patterns through dcpstore.

None of the three systems can share this environment (docs/integrations/README.md says
why), so each pattern is rebuilt here with plain torch, following the system's own code:

- PhysicsNeMo ``save_checkpoint`` / ``load_checkpoint`` in distributed mode: full state
  gathered with the DCP state-dict helpers, rank 0 writes ``{Class}.{mp_rank}.{epoch}.pt``
  (``.mdlus``, a tar archive holding ``model.pt``, for physicsnemo Modules) and
  ``checkpoint.{mp_rank}.{epoch}.pt``; loading picks the newest epoch and scatters with
  ``broadcast_from_rank0``; ``load_model_weights`` of a ``.mdlus`` / ``.pt`` file. Here the
  files go through a dcpstore backend instead of fsspec.
- AReaL: a DCP ``Stateful`` wrapper over model and optimizer saved with
  ``dcp.save({"dcp": state}, ...)`` into one recover directory that every recovery save
  replaces, plus a pickled recover-info object; here the writer is dcpstore's (an atomic
  overwrite) and the recover info is put after the DCP save committed.
- Megatron-Bridge ``fsdp_dtensor``: ``iter_<7 digits>`` directories written with
  ``dcp.save(storage_writer=factory(dir))`` where the MSC feature flag picks the factory,
  and ``latest_checkpointed_iteration.txt`` written by rank 0 afterwards; here dcpstore is
  the factory.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hf_workers import full_state
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

import dcpstore

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8))
    if dist.get_world_size() > 1:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    torch.manual_seed(1000 + dist.get_rank())
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optim.step()
        optim.zero_grad()


# -- PhysicsNeMo ----------------------------------------------------------------------------


def _mdlus(state: dict[str, Any]) -> bytes:
    """A ``.mdlus``-shaped archive: a tar holding ``model.pt``."""
    payload = io.BytesIO()
    torch.save(state, payload)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("model.pt")
        info.size = payload.getbuffer().nbytes
        payload.seek(0)
        tar.addfile(info, payload)
    return out.getvalue()


def _mdlus_state(data: bytes) -> Any:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.extractfile("model.pt")
        assert member is not None
        return torch.load(io.BytesIO(member.read()), weights_only=True)


def physicsnemo_save_checkpoint(path: str, model: nn.Module, optim: torch.optim.Optimizer,
                                epoch: int | None = None) -> int:
    """PhysicsNeMo's distributed ``save_checkpoint``: gather, then rank 0 writes."""
    store = dcpstore.open_backend(path)
    if epoch is None:  # "the next available index"
        epochs = [int(i.key.split(".")[-2]) for i in store.list("checkpoint.0.")]
        epoch = max(epochs, default=-1) + 1
    model_sd, optim_sd = get_state_dict(model, optim, options=FULL)
    if dist.get_rank() == 0:
        # a plain torch module's weights: "{Class}.{mp_rank}.{epoch}.pt" (a physicsnemo
        # Module's would be a ".mdlus" archive, see save_mdlus)
        buf = io.BytesIO()
        torch.save(model_sd, buf)
        store.put(f"Sequential.0.{epoch}.pt", buf.getvalue())
        buf = io.BytesIO()
        torch.save({"optimizer_state_dict": optim_sd, "epoch": epoch,
                    "metadata": {"loss": 0.5}}, buf)
        store.put(f"checkpoint.0.{epoch}.pt", buf.getvalue())
    dist.barrier()
    return epoch


def physicsnemo_load_checkpoint(path: str, model: nn.Module,
                                optim: torch.optim.Optimizer) -> int:
    """PhysicsNeMo's ``load_checkpoint(epoch=None)``: the newest epoch, scattered from rank 0."""
    store = dcpstore.open_backend(path)
    epoch = max(int(i.key.split(".")[-2]) for i in store.list("checkpoint.0."))
    model_sd: Any = {}
    optim_sd: Any = {}
    if dist.get_rank() == 0:
        model_sd = torch.load(io.BytesIO(store.get(f"Sequential.0.{epoch}.pt")),
                              weights_only=True)
        optim_sd = torch.load(io.BytesIO(store.get(f"checkpoint.0.{epoch}.pt")),
                              weights_only=True)["optimizer_state_dict"]
    set_model_state_dict(model, model_sd, options=SCATTER)
    set_optimizer_state_dict(model, optim, optim_sd, options=SCATTER)
    return epoch


def save_mdlus(file_uri: str, model: nn.Module) -> None:
    """What ``physicsnemo.core.Module.save`` leaves: a tar archive holding ``model.pt``."""
    model_sd = get_state_dict(model, [], options=FULL)[0]
    if dist.get_rank() == 0:
        parent, _, name = file_uri.rpartition("/")
        dcpstore.open_backend(parent).put(name, _mdlus(model_sd))
    dist.barrier()


def physicsnemo_load_model_weights(model: nn.Module, file_uri: str) -> None:
    """PhysicsNeMo's ``load_model_weights`` of a ``.mdlus`` or ``.pt`` file."""
    parent, _, name = file_uri.rpartition("/")
    state: Any = {}
    if dist.get_rank() == 0:
        data = dcpstore.open_backend(parent).get(name)
        state = (_mdlus_state(data) if name.endswith(".mdlus")
                 else torch.load(io.BytesIO(data), weights_only=True))
    set_model_state_dict(model, state, options=SCATTER)


# -- AReaL --------------------------------------------------------------------------------


class DCPState(Stateful):
    """AReaL's ``Stateful`` wrapper: DCP calls these on save and on load."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def areal_dump_recover(recover_dir: str, model: nn.Module, optim: torch.optim.Optimizer,
                       info: dict[str, Any]) -> None:
    """One recovery save: replace the DCP state, then the recover info (rank 0)."""
    dcp.save({"dcp": DCPState(model, optim)},
             storage_writer=dcpstore.get_writer(recover_dir, overwrite=True))
    if dist.get_rank() == 0:
        dcpstore.open_backend(recover_dir).put("recover_info.pkl", pickle.dumps(info),
                                               atomic=True)
    dist.barrier()


def areal_load_recover(recover_dir: str, model: nn.Module,
                       optim: torch.optim.Optimizer) -> dict[str, Any]:
    dcp.load({"dcp": DCPState(model, optim)}, storage_reader=dcpstore.get_reader(recover_dir))
    info: dict[str, Any] = pickle.loads(dcpstore.open_backend(recover_dir).get("recover_info.pkl"))
    return info


# -- Megatron-Bridge fsdp_dtensor --------------------------------------------------------------


TRACKER = "latest_checkpointed_iteration.txt"


def megatron_save(save_dir: str, iteration: int, model: nn.Module,
                  optim: torch.optim.Optimizer) -> None:
    """``fsdp_dtensor`` save: DCP through the writer factory, then the tracker file."""
    name = f"{save_dir.rstrip('/')}/iter_{iteration:07d}"
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optimizer": optim_sd, "iteration": iteration}
    # where Megatron picks msc.torch.MultiStorageFileSystemWriter when the MSC feature flag
    # is on, dcpstore is the factory
    dcp.save(state, storage_writer=dcpstore.get_writer(name))
    if dist.get_rank() == 0:
        dcpstore.open_backend(save_dir).put(TRACKER, str(iteration).encode(), atomic=True)
    dist.barrier()


def megatron_load(load_dir: str, model: nn.Module, optim: torch.optim.Optimizer) -> int:
    iteration = int(dcpstore.open_backend(load_dir).get(TRACKER).decode())
    name = f"{load_dir.rstrip('/')}/iter_{iteration:07d}"
    model_sd, optim_sd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd, "iteration": 0}
    dcp.load(state, storage_reader=dcpstore.get_reader(name))
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    assert state["iteration"] == iteration
    return iteration


# -- the two launches -------------------------------------------------------------------------


def seeds_save(rank: int, world_size: int, roots: dict[str, str]) -> dict[str, Any]:
    """2 ranks, FSDP2: each system saves twice; returns the full state after the last save."""
    out: dict[str, Any] = {}
    model, optim = _model(0)
    _train(model, optim, 2)
    assert physicsnemo_save_checkpoint(roots["physicsnemo"], model, optim) == 0
    _train(model, optim, 1)
    assert physicsnemo_save_checkpoint(roots["physicsnemo"], model, optim) == 1
    save_mdlus(roots["physicsnemo"] + "/weights/FullyConnected.0.1.mdlus", model)
    out["physicsnemo"] = full_state(model, optim)

    model, optim = _model(1)
    for step in (1, 2):
        _train(model, optim, 1)
        areal_dump_recover(roots["areal"], model, optim,
                           {"global_step": step, "epoch": 0, "dataloader": {"idx": 4 * step}})
    out["areal"] = full_state(model, optim)

    model, optim = _model(2)
    for iteration in (10, 20):
        _train(model, optim, 1)
        megatron_save(roots["megatron"], iteration, model, optim)
    out["megatron"] = full_state(model, optim)
    return out


def seeds_load(rank: int, world_size: int, roots: dict[str, str]) -> dict[str, Any]:
    """Another world size: each system resumes its newest checkpoint into a fresh model."""
    out: dict[str, Any] = {}
    model, optim = _model(7)
    assert physicsnemo_load_checkpoint(roots["physicsnemo"], model, optim) == 1
    out["physicsnemo"] = full_state(model, optim)
    for name in ("Sequential.0.1.pt", "weights/FullyConnected.0.1.mdlus"):
        fresh, _ = _model(8)
        physicsnemo_load_model_weights(fresh, f"{roots['physicsnemo']}/{name}")
        out[name] = full_state(fresh, torch.optim.Adam(fresh.parameters()))["model"]

    model, optim = _model(7)
    out["areal_info"] = areal_load_recover(roots["areal"], model, optim)
    out["areal"] = full_state(model, optim)

    model, optim = _model(7)
    out["megatron_iteration"] = megatron_load(roots["megatron"], model, optim)
    out["megatron"] = full_state(model, optim)
    fresh, _ = _model(9)  # weights alone, from a DCP checkpoint, with dcpstore's own helper
    dcpstore.load_model_weights(fresh, roots["megatron"] + "/iter_0000020")
    out["megatron_weights"] = full_state(fresh, torch.optim.Adam(fresh.parameters()))["model"]
    return out
