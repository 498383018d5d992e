"""Rank bodies for tests/integrations/test_lightning.py: real Lightning Trainers, FSDP2
(``ModelParallelStrategy``) on CPU with gloo, launched as spawned processes.

Each rank writes what it saw to ``<out>/<job>-<rank>.json`` and leaves with ``os._exit``
(torch 2.13's gloo can abort at interpreter exit); the test judges a rank by its report.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dcpstore.testing.servers import free_port

__all__ = ["run_job"]


def run_job(job: str, world_size: int, cfg: dict[str, Any], timeout: float = 400
            ) -> list[Any]:
    """Run ``JOBS[job](rank, world_size, cfg)`` on ``world_size`` spawned ranks.

    Returns each rank's value; raises with every failing rank's traceback. A launch whose
    rendezvous port was taken in the meantime (a shared machine) is retried.
    """
    for attempt in range(3):
        try:
            return _run_job_once(job, world_size, cfg, timeout)
        except AssertionError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_job_once(job: str, world_size: int, cfg: dict[str, Any], timeout: float
                  ) -> list[Any]:
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{job}-*.json"):
        old.unlink()
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(job, rank, world_size, port, cfg))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    values, errors = [], []
    for rank in range(world_size):
        report = out / f"{job}-{rank}.json"
        if not report.exists():
            errors.append(f"rank {rank} died or hung (exit code {procs[rank].exitcode})")
            continue
        result = json.loads(report.read_text())
        if result["ok"]:
            values.append(result["value"])
        else:
            errors.append(f"rank {rank}: {result['error']}")
    if errors:
        raise AssertionError(f"job {job}:\n" + "\n".join(errors))
    return values


def _entry(job: str, rank: int, world_size: int, port: int, cfg: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0",
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    os.chdir(cfg["cwd"])  # a mangled path would show up here as ./s3:
    try:
        value = JOBS[job](rank, world_size, cfg)
        result: dict[str, Any] = {"ok": True, "value": value}
    except BaseException as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    Path(cfg["out"], f"{job}-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


# -- the model ---------------------------------------------------------------------------


def _lightning() -> Any:
    import lightning.pytorch as pl

    return pl


def make_model(lr: float = 0.01) -> Any:
    pl = _lightning()

    class Net(pl.LightningModule):  # type: ignore[name-defined]
        def __init__(self, lr: float) -> None:
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.layers(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self) -> DataLoader[Any]:
            g = torch.Generator().manual_seed(1)
            data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
            return DataLoader(data, batch_size=4)

    return Net(lr)


def full_state(trainer: Any, module: Any) -> dict[str, Any]:
    """Model and optimizer state, unsharded (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    return {"model": get_model_state_dict(module, options=options),
            "optim": get_optimizer_state_dict(module, trainer.optimizers[0], options=options)}


def make_recorder(out: str, tag: str, gate: threading.Event | None = None,
                  gate_step: int = -1) -> Any:
    """A callback that records the full state at every save and at the start of training
    (after a resume), and opens ``gate`` once training reached ``gate_step``."""
    pl = _lightning()

    class Recorder(pl.Callback):  # type: ignore[name-defined]
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
            state = full_state(trainer, module)
            if trainer.global_rank == 0:
                torch.save(state, Path(out, f"saved-{trainer.global_step}.pt"))

        def on_train_start(self, trainer: Any, module: Any) -> None:
            state = full_state(trainer, module)
            if trainer.global_rank == 0:
                torch.save({"global_step": trainer.global_step, **state},
                           Path(out, f"start-{tag}.pt"))

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if gate is not None and trainer.global_step >= gate_step:
                gate.set()

    return Recorder()


def trainer(root: str, world_size: int, callbacks: list[Any], strategy: Any = None,
            **kwargs: Any) -> Any:
    from dcpstore.integrations.lightning import DcpstoreModelParallelStrategy

    pl = _lightning()
    return pl.Trainer(
        accelerator="cpu", devices=world_size, num_nodes=1,
        strategy=strategy or DcpstoreModelParallelStrategy(data_parallel_size=world_size,
                                                           tensor_parallel_size=1),
        default_root_dir=root, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, **kwargs)


def checkpoint_cb(dirpath: str) -> Any:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2,
                           save_last=True, every_n_train_steps=2)


def _patch_writer(wrap: Callable[[str, Any], None]) -> None:
    """Let a test reach into every writer the integration makes."""
    import dcpstore
    import dcpstore.dcp.api

    for module in (dcpstore, dcpstore.dcp.api):  # dcpstore.save looks it up in dcpstore.dcp.api
        real = module.get_writer

        def get_writer(uri: Any, *, _real: Any = real, **options: Any) -> Any:
            writer = _real(uri, **options)
            wrap(str(uri), writer)
            return writer

        setattr(module, "get_writer", get_writer)  # noqa: B010


# -- jobs --------------------------------------------------------------------------------


def job_s3_fit_and_async_resume(rank: int, world_size: int, cfg: dict[str, Any]) -> Any:
    """Fit 1 (sync) to S3 with top-k and last; fit 2 resumes from "last" with async saves:
    the first (step 8) is held until training has gone on past it, the second (step 10)
    fails on rank 1 in the background."""
    from lightning.pytorch.loggers import CSVLogger

    from dcpstore.integrations.lightning import DcpstoreModelParallelStrategy

    root, out = cfg["root"], cfg["out"]
    ckpt_dir = f"{root}/ckpt"
    t1 = trainer(root, world_size, [make_recorder(out, "fit1"), checkpoint_cb(ckpt_dir)],
                 max_steps=6)
    assert isinstance(t1.logger, CSVLogger), type(t1.logger)
    t1.fit(make_model())
    log_dir = t1.logger.log_dir

    gate = threading.Event()
    held: list[str] = []

    def hold_first_async_save(uri: str, writer: Any) -> None:
        if "step=10" in uri and rank == 1:
            def broken(plan: Any, planner: Any) -> Any:
                raise OSError("injected: the store went away during the async save of step 10")

            writer.write_data = broken
        if held or "step=8" not in uri:
            return
        held.append(uri)
        write_data = writer.write_data

        def gated(plan: Any, planner: Any) -> Any:
            if not gate.wait(60):
                raise RuntimeError("training did not go on while the async save streamed")
            return write_data(plan, planner)

        writer.write_data = gated

    _patch_writer(hold_first_async_save)
    strategy = DcpstoreModelParallelStrategy(data_parallel_size=world_size,
                                             tensor_parallel_size=1, async_save=True)
    t2 = trainer(root, world_size, [make_recorder(out, "fit2", gate, gate_step=9),
                                    checkpoint_cb(ckpt_dir)], strategy=strategy, max_steps=10)
    try:
        t2.fit(make_model(), ckpt_path="last")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = ""
    return {"log_dir": log_dir, "ckpt_path": t2.ckpt_path, "held": held,
            "gate_opened": gate.is_set(), "error": error}


def job_resume_one_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> Any:
    """Resume at world size 1 from an explicit URI; then a mangled URI must be refused."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import dcpstore

    t = trainer(cfg["root"], world_size, [make_recorder(cfg["out"], "one-rank")],
                max_steps=cfg["step"] + 1, logger=False, enable_checkpointing=False)
    t.fit(make_model(), ckpt_path=cfg["ckpt"])

    mangled = ModelCheckpoint(dirpath=Path(cfg["root"] + "/mangled"), every_n_train_steps=1)
    t = trainer(cfg["root"], world_size, [mangled], max_steps=1, logger=False)
    try:
        t.fit(make_model())
    except dcpstore.InvalidURIError as exc:
        refused = str(exc)
    else:
        refused = ""
    return {"refused": refused, "cwd": sorted(os.listdir("."))}


def job_local_failed_save(rank: int, world_size: int, cfg: dict[str, Any]) -> Any:
    """Fit to a local path; the save at step 6 fails on rank 1; then resume from "last"."""
    root, out = cfg["root"], cfg["out"]
    ckpt_dir = f"{root}/ckpt"

    failed: list[str] = []

    def fail_step_6(uri: str, writer: Any) -> None:
        if "step=6" not in uri or rank != 1 or failed:
            return
        failed.append(uri)

        def broken(plan: Any, planner: Any) -> Any:
            raise OSError("injected: the disk went away during the save of step 6")

        writer.write_data = broken

    _patch_writer(fail_step_6)
    t1 = trainer(root, world_size, [make_recorder(out, "fit1"), checkpoint_cb(ckpt_dir)],
                 max_steps=8, logger=False)
    try:
        t1.fit(make_model())
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = ""
    listing = sorted(os.listdir(ckpt_dir))
    last = Path(ckpt_dir, "last.ckpt").read_text()
    from lightning.pytorch.callbacks import ModelCheckpoint

    # a second callback keeps only "last", every step: steps with no top-k save get a
    # hidden full copy, which goes when "last" moves on
    last_only = ModelCheckpoint(dirpath=f"{root}/last-only", save_top_k=0, save_last=True,
                                every_n_train_steps=1)
    t2 = trainer(root, world_size, [make_recorder(out, "fit2"), checkpoint_cb(ckpt_dir),
                                    last_only], max_steps=6, logger=False)
    hidden: list[Any] = []

    def watch(uri: str, writer: Any) -> None:
        """Each save's target, and what the last-only directory held when it started."""
        if rank == 0:
            there = Path(root, "last-only")
            hidden.append([Path(uri).name, sorted(os.listdir(there)) if there.exists() else None])

    _patch_writer(watch)
    t2.fit(make_model(), ckpt_path="last")
    return {"error": error, "listing": listing, "last": last, "ckpt_path": t2.ckpt_path,
            "hidden_saves": hidden}


def job_resumed_run(rank: int, world_size: int, cfg: dict[str, Any]) -> Any:
    """One run of docs/integrations/lightning.md's example (async saves, top-2 by step,
    save_last, ``fit(ckpt_path="last")``) up to ``cfg["max_steps"]``; the test launches it
    again, in new processes, for each resumed run."""
    from dcpstore.integrations.lightning import DcpstoreModelParallelStrategy

    root, out = cfg["root"], cfg["out"]
    strategy = DcpstoreModelParallelStrategy(data_parallel_size=world_size,
                                             tensor_parallel_size=1, async_save=True)
    t = trainer(root, world_size, [make_recorder(out, cfg["tag"]), checkpoint_cb(f"{root}/ckpt")],
                strategy=strategy, max_steps=cfg["max_steps"], logger=False)
    t.fit(make_model(), ckpt_path="last")
    return {"ckpt_path": t.ckpt_path, "global_step": t.global_step}


JOBS: dict[str, Callable[[int, int, dict[str, Any]], Any]] = {
    "s3_fit_and_async_resume": job_s3_fit_and_async_resume,
    "resume_one_rank": job_resume_one_rank,
    "local_failed_save": job_local_failed_save,
    "resumed_run": job_resumed_run,
}
