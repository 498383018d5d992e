"""torchtitan's real CheckpointManager (0.3.0) through ``DcpstoreCheckpointManager``.

The manager is built from its config, as torchtitan's trainer builds it, around a small
FSDP2 model on 2 gloo ranks; the trainer itself is not run (it needs a CUDA device).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_workers import Net, build, full_state
from mp import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer.dcp import CheckpointManager

import dcpstore
from dcpstore.integrations.dcp_routing import MangledURIError
from dcpstore.integrations.torchtitan import DcpstoreCheckpointManager, committed_steps
from dcpstore.testing import assert_state_equal

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
STEPS = 5


class _Optimizers(Stateful):
    """What torchtitan's OptimizersContainer saves: a flattened optimizer state dict."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model = model
        self.optim = optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim, options=_FLAT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state_dict, options=_FLAT)


class _Counter(Stateful):
    """Stands in for the trainer's train_state and the LR schedulers."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def _setup(world_size: int, seed: int) -> tuple[nn.Module, _Optimizers, _Counter, _Counter]:
    model, optim = build(world_size, seed)
    return model, _Optimizers(model, optim), _Counter(), _Counter()


def _manager(folder: str, model: nn.Module, optimizers: _Optimizers, train_state: _Counter,
             lr: _Counter, **config: Any) -> DcpstoreCheckpointManager:
    cfg = DcpstoreCheckpointManager.Config(enable=True, folder=folder, **config)
    return cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                     lr_schedulers=lr, states={"train_state": train_state}, sd_adapter=None,
                     base_folder="")


def _full(model: nn.Module, optimizers: _Optimizers, train_state: _Counter) -> dict[str, Any]:
    return {**full_state(model, optimizers.optim), "train_step": train_state.step}


def _train_and_save(rank: int, world_size: int, folders: list[str]) -> dict[str, Any]:
    """The trainer's loop: a step, maybe_wait_for_staging, save(step, last_step)."""
    out = {}
    for folder in folders:
        model, optimizers, train_state, lr = _setup(world_size, seed=5)
        mgr = _manager(folder, model, optimizers, train_state, lr, interval=1,
                       keep_latest_k=2, async_mode="async", last_save_model_only=False)
        assert not mgr.load(), "a fresh folder has nothing to resume from"
        g = torch.Generator().manual_seed(21 + rank)
        for step in range(1, STEPS + 1):
            model(torch.randn(4, 12, generator=g)).pow(2).mean().backward()
            mgr.maybe_wait_for_staging()
            optimizers.optim.step()
            optimizers.optim.zero_grad()
            train_state.step = step
            assert mgr.save(step, last_step=step == STEPS)
        mgr.maybe_wait_for_saving()
        mgr.close()
        out[folder] = _full(model, optimizers, train_state)
    dist.barrier()
    return out


def _resume(rank: int, world_size: int, folders: list[str]) -> dict[str, Any]:
    """A new run at another world size: load() finds the latest committed step."""
    out = {}
    for folder in folders:
        model, optimizers, train_state, lr = _setup(world_size, seed=77)
        model(torch.randn(2, 12)).sum().backward()
        optimizers.optim.step()  # optimizer state exists, with other values
        optimizers.optim.zero_grad()
        mgr = _manager(folder, model, optimizers, train_state, lr, keep_latest_k=0)
        assert mgr.load()
        mgr.close()
        out[folder] = _full(model, optimizers, train_state)
    return out


def _step_dirs(folder: str) -> list[str]:
    backend = dcpstore.open_backend(folder)
    try:
        return sorted({o.key.partition("/")[0] for o in backend.list()})
    finally:
        backend.close()


@pytest.mark.multiprocess
def test_torchtitan_checkpoint_manager_s3_and_local(s3_root: str, tmp_path: Path) -> None:
    """2 ranks, async_mode="async", keep_latest_k=2, interval 1, 5 steps (the last one a
    sync full save), to SeaweedFS and to a local folder; then resume at world size 1."""
    local = str(tmp_path / "ckpt")
    folders = [f"{s3_root}/titan", local]
    saved = run_ranks(_train_and_save, 2, folders)[0]

    for folder in folders:
        # torchtitan purges after interval saves only (not after the last step), and
        # dcpstore's retention counts committed steps: 1 was deleted when 4 was issued
        assert _step_dirs(folder) == ["step-2", "step-3", "step-4", "step-5"], folder
        assert committed_steps(folder) == [2, 3, 4, 5]
        for step in (2, 5):
            backend = dcpstore.open_backend(f"{folder}/step-{step}")
            assert any(o.key.startswith(".dcpstore-") for o in backend.list()), (folder, step)
            backend.close()

    # a save that never committed (data, no .metadata) must not be picked as the latest
    torn = dcpstore.open_backend(f"{folders[0]}/step-9")
    torn.put("__0_0.deadbeefdeadbeef.distcp", b"partial")
    torn.close()
    os.makedirs(f"{local}/step-9")
    Path(f"{local}/step-9/__0_0.distcp").write_bytes(b"partial")

    resumed = run_ranks(_resume, 1, folders)[0]
    for folder in folders:
        assert resumed[folder]["train_step"] == STEPS
        assert_state_equal(resumed[folder], saved[folder], folder)


def test_mangled_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Path("s3://b/run")`` became ``s3:/b/run``: refused, no ./s3: directory."""
    monkeypatch.chdir(tmp_path)
    model = Net()
    optimizers = _Optimizers(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(MangledURIError, match="lost a slash"):
        _manager(str(Path(f"s3://bucket/{uuid.uuid4().hex}")), model, optimizers, _Counter(),
                 _Counter(), keep_latest_k=0)
    assert os.listdir(tmp_path) == []


class _Loader(Stateful):
    """Stands in for torchtitan's dataloader: its state is keyed by the data-parallel rank
    (``dataloader.dp_rank_0`` in the checkpoint)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank_0": torch.tensor(self.position)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["dp_rank_0"])


def _model_config() -> CheckpointManager.Config:
    """What a model's config function sets (``llama3_debugmodel``'s checkpoint config)."""
    return CheckpointManager.Config(interval=10, last_save_model_only=False, keep_latest_k=3)


def _docs_run(rank: int, world_size: int, folder: str, steps: int) -> dict[str, int]:
    """One run of the trainer's loop, with ``config.checkpoint`` set as the docs say."""
    checkpoint = DcpstoreCheckpointManager.Config.from_config(
        _model_config(), enable=True, folder=folder, interval=2)
    model, optimizers, train_state, lr = _setup(world_size, seed=3)
    loader = _Loader()
    mgr = checkpoint.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                           lr_schedulers=lr, states={"train_state": train_state},
                           sd_adapter=None, base_folder="")
    resumed = mgr.load()
    first = train_state.step + 1
    for step in range(first, first + steps):
        model(torch.randn(4, 12)).pow(2).mean().backward()
        optimizers.optim.step()
        optimizers.optim.zero_grad()
        train_state.step, loader.position = step, 10 * step
        mgr.save(step, last_step=step == first + steps - 1)
    mgr.close()
    return {"resumed": int(resumed), "first": first, "position": loader.position}


@pytest.mark.multiprocess
def test_docs_snippet_keeps_the_model_configs_fields_and_resumes(tmp_path: Path) -> None:
    """The docs' change (``from_config(config.checkpoint, ...)``) keeps what the model's
    config function set: ``last_save_model_only=False`` survives, so the last step is a
    full checkpoint and a second run resumes from it (with a fresh
    ``DcpstoreCheckpointManager.Config(...)`` torchtitan's default ``True`` made it
    model-only, and run 2 failed with ``Missing key ... dataloader.dp_rank_0``)."""
    folder = str(tmp_path / "ckpt")
    assert run_ranks(_docs_run, 1, folder, 3)[0] == {"resumed": 0, "first": 1, "position": 30}
    assert committed_steps(folder) == [2, 3]
    assert run_ranks(_docs_run, 1, folder, 3)[0] == {"resumed": 1, "first": 4, "position": 60}
    assert committed_steps(folder) == [2, 3, 4, 6]


def test_from_config_copies_every_field_and_applies_the_changes() -> None:
    base = _model_config()
    base.exclude_from_loading = ["lr_scheduler"]
    cfg = DcpstoreCheckpointManager.Config.from_config(base, enable=True, folder="s3://b/r",
                                                       async_mode="async")
    assert type(cfg) is DcpstoreCheckpointManager.Config
    expected = {**dataclasses.asdict(base), "enable": True, "folder": "s3://b/r",
                "async_mode": "async"}
    assert dataclasses.asdict(cfg) == expected
    assert cfg.exclude_from_loading is not base.exclude_from_loading  # not shared
    assert cfg._owner is DcpstoreCheckpointManager
    # validated as torchtitan validates its own config
    with pytest.raises(ValueError, match="at least 2 checkpoint replicas"):
        DcpstoreCheckpointManager.Config.from_config(base, keep_latest_k=1)
    with pytest.raises(TypeError, match="no field no_such_field"):
        DcpstoreCheckpointManager.Config.from_config(base, no_such_field=1)
    # a config with fields dcpstore's lacks: refused rather than silently dropped
    with pytest.raises(TypeError, match="lacks: replica_id"):
        DcpstoreCheckpointManager.Config.from_config(_ExtraConfig(replica_id=3))


@dataclasses.dataclass(kw_only=True, slots=True)
class _ExtraConfig(CheckpointManager.Config):
    """A checkpoint config of another manager, with a field torchtitan's DCP one lacks."""

    replica_id: int = 0


def test_start_up_does_not_destroy_a_purge_thread(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Building the manager starts one purge thread, dcpstore's (deleting through
    dcpstore), and logs nothing about destroying one; closing it does."""
    model = Net()
    optimizers = _Optimizers(model, torch.optim.AdamW(model.parameters()))
    before = set(threading.enumerate())
    with caplog.at_level(logging.INFO):
        mgr = _manager(str(tmp_path / "ckpt"), model, optimizers, _Counter(), _Counter(),
                       keep_latest_k=2)
        started = [t for t in threading.enumerate() if t not in before]
        assert [t.name for t in started] == ["dcpstore-purge"]
        assert mgr.purge_thread is started[0] and started[0].is_alive()
        assert not [r for r in caplog.records if "purge thread" in r.getMessage()]
        mgr.close()
    assert not started[0].is_alive()
    assert [r.getMessage() for r in caplog.records
            if "purge thread" in r.getMessage()] == ["Destroying the purge thread."]
