"""PyTorch Lightning (2.6) with ``DcpstoreModelParallelStrategy``: real Trainers, FSDP2 on
2 CPU ranks with gloo, checkpoints on SeaweedFS (S3) and on a local path.

Three rank launches in all (each runs one or two ``fit`` calls):

- S3, 2 ranks: ``default_root_dir`` and ``ModelCheckpoint(dirpath=...)`` on ``s3://``, top-k,
  save_last; then ``fit(ckpt_path="last")`` with async saves, the first of which is held
  until training has gone past it;
- S3, 1 rank: resume from an explicit ``s3://`` checkpoint written by 2 ranks; a mangled
  URI is refused;
- local, 2 ranks: a save that fails on one rank leaves the previous checkpoint and "last"
  as they were, and ``fit(ckpt_path="last")`` resumes from it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lightning_workers

import dcpstore
from dcpstore.errors import ConfigurationError
from dcpstore.integrations import lightning as dl


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested state (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _assert_resumed(out: Path, tag: str, step: int) -> None:
    start = torch.load(out / f"start-{tag}.pt", weights_only=True)
    saved = torch.load(out / f"saved-{step}.pt", weights_only=True)
    assert start.pop("global_step") == step
    assert saved["optim"]["state"], "the optimizer state is empty: nothing was compared"
    _assert_same(saved, start, tag)


def _names(root: str) -> list[str]:
    """Immediate children of ``root`` (a dcpstore URI), listed through dcpstore."""
    backend = dcpstore.open_backend(root)
    try:
        return sorted({o.key.split("/", 1)[0] for o in backend.list()})
    finally:
        backend.close()


def _committed(uri: str) -> bool:
    backend = dcpstore.open_backend(uri)
    try:
        return backend.exists(".metadata")
    finally:
        backend.close()


def test_mangled_uris_are_refused(tmp_path: Path) -> None:
    for bad in (Path("s3://bucket/run"), "s3:/bucket/run", "gs:/bucket/run",
                "./s3:/bucket/run", str(tmp_path / "s3:" / "bucket")):
        with pytest.raises(dcpstore.InvalidURIError, match="mangled|collapsed"):
            dl.checked_uri(bad)
    assert dl.checked_uri("s3://bucket/run") == "s3://bucket/run"
    assert dl.checked_uri(str(tmp_path / "run")) == str(tmp_path / "run")


def test_fsspec_goes_through_dcpstore(s3_root: str) -> None:
    """What ModelCheckpoint and CSVLogger ask of a filesystem, on S3, without s3fs."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    fs = get_filesystem(s3_root)
    assert isinstance(fs, dl.DcpstoreFileSystem)
    # only Lightning's lookups changed: fsspec (and s3fs users elsewhere) are untouched
    assert fsspec.get_filesystem_class("s3") is not dl.DcpstoreFileSystem
    assert not isinstance(get_filesystem(s3_root, anon=False), dl.DcpstoreFileSystem)
    assert not fs.exists(s3_root)
    fs.makedirs(f"{s3_root}/logs/v0", exist_ok=True)  # no object; a directory for this process
    assert fs.isdir(f"{s3_root}/logs/v0") and fs.ls(f"{s3_root}/logs/v0") == []
    with fs.open(f"{s3_root}/logs/metrics.csv", "w", newline="") as f:
        f.write("a,b\n")
    with fs.open(f"{s3_root}/logs/metrics.csv", "a", newline="") as f:
        f.write("1,2\n")
    with fs.open(f"{s3_root}/logs/metrics.csv", "r") as f:
        assert f.read() == "a,b\n1,2\n"
    backend = dcpstore.open_backend(f"{s3_root}/ck/step-1.ckpt")
    backend.put(".metadata", b"x")
    backend.put("__0_0.distcp", b"y")
    backend.close()
    assert fs.ls(s3_root, detail=False) == [f"{s3_root}/ck", f"{s3_root}/logs"]
    assert fs.isdir(f"{s3_root}/ck/step-1.ckpt") and fs.isfile(f"{s3_root}/logs/metrics.csv")
    assert fs.modified(f"{s3_root}/ck/step-1.ckpt").year >= 2024
    with pytest.raises(IsADirectoryError):
        fs.rm(f"{s3_root}/ck/step-1.ckpt")
    fs.rm(f"{s3_root}/ck/step-1.ckpt", recursive=True)
    assert not fs.exists(f"{s3_root}/ck")
    with pytest.raises(FileNotFoundError):
        fs.ls(f"{s3_root}/ck")


def test_s3_save_topk_last_async_and_resume_at_one_rank(s3_root: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg: dict[str, Any] = {"root": s3_root, "out": str(out), "cwd": str(tmp_path)}
    reports = lightning_workers.run_job("s3_fit_and_async_resume", 2, cfg)
    report = reports[0]
    ckpt = f"{s3_root}/ckpt"

    # fit 2 resumed from "last" = step 6 of fit 1, bit-exact (model and AdamW state)
    assert report["ckpt_path"] == f"{ckpt}/last.ckpt"
    _assert_resumed(out, "fit2", 6)
    # its first async save was held until training reached step 9: saves ran in the background
    assert report["held"] == [f"{ckpt}/epoch=0-step=8.ckpt"] and report["gate_opened"]

    # its second async save (step 10) failed on rank 1 in the background: fit raised at the
    # end, nothing of step 10 is left, "last" still names step 8
    assert "async checkpoint save failed" in report["error"], report["error"]
    assert "injected" in report["error"]
    # top-k 2 by step: 2 and 4 deleted (4 only after step 8 committed); 6 kept (step 10,
    # whose commit its deletion waited for, never committed)
    assert _names(ckpt) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    for name in ("epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"):
        assert _committed(f"{ckpt}/{name}")
    backend = dcpstore.open_backend(ckpt)
    pointer = json.loads(backend.get("last.ckpt"))
    keys = [o.key for o in backend.list()]
    backend.close()
    assert pointer["target"] == "epoch=0-step=8.ckpt" and pointer["global_step"] == 8
    assert not any(k.endswith("meta.pt") for k in keys), "Lightning's meta.pt is in the checkpoint"
    # the CSV logs went to S3 through dcpstore, nothing to a local ./s3: directory
    assert report["log_dir"].startswith(f"{s3_root}/lightning_logs/")
    assert "metrics.csv" in " ".join(o.key for o in dcpstore.open_backend(s3_root).list())
    assert not (tmp_path / "s3:").exists()

    # resume at world size 1 from the async step-8 checkpoint that 2 ranks wrote
    cfg.update(step=8, ckpt=f"{ckpt}/epoch=0-step=8.ckpt")
    (one,) = lightning_workers.run_job("resume_one_rank", 1, cfg)
    _assert_resumed(out, "one-rank", 8)
    assert "mangled URI" in one["refused"]
    assert "s3:" not in one["cwd"]


def test_local_failed_save_keeps_previous_and_last(tmp_path: Path) -> None:
    out = tmp_path / "out"
    root = tmp_path / "run"
    cfg = {"root": str(root), "out": str(out), "cwd": str(tmp_path)}
    report, _ = lightning_workers.run_job("local_failed_save", 2, cfg)
    # the save of step 6 failed on rank 1: fit stopped with that error
    assert "injected" in report["error"]
    # step 6 left nothing; step 4 and the "last" pointer to it are intact
    assert report["listing"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert json.loads(report["last"])["target"] == "epoch=0-step=4.ckpt"
    # fit(ckpt_path="last") resumed from step 4, bit-exact, and went on to save step 6
    assert report["ckpt_path"] == str(root / "ckpt" / "last.ckpt")
    _assert_resumed(out, "fit2", 4)
    ckpt = root / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert (ckpt / "epoch=0-step=6.ckpt" / ".metadata").is_file()
    assert not (ckpt / "epoch=0-step=6.ckpt" / "meta.pt").exists()
    assert json.loads((ckpt / "last.ckpt").read_text())["target"] == "epoch=0-step=6.ckpt"
    # the last-only callback: step 5 had no top-k save, so "last" got a hidden full copy
    # (the only save before step 6's); at step 6 "last" moved to the top-k checkpoint and
    # the hidden copy was deleted
    (copy5, before5), (top6, before6) = report["hidden_saves"]
    assert copy5.startswith(".dcpstore-last-5-") and before5 is None
    assert top6 == "epoch=0-step=6.ckpt" and before6 == [copy5, "last.ckpt"]
    last_only = root / "last-only"
    assert sorted(p.name for p in last_only.iterdir()) == ["last.ckpt"]
    pointer = json.loads((last_only / "last.ckpt").read_text())
    assert pointer["target"] == str(ckpt / "epoch=0-step=6.ckpt"), pointer


def test_resumed_runs_leave_top_k_and_last_only(s3_root: str, tmp_path: Path) -> None:
    """Three runs of the docs' example (async saves, top-2 by step, save_last,
    ``fit(ckpt_path="last")``), each in new processes: the checkpoint a run resumed from is
    deleted when save_top_k evicts it, so each run leaves the top 2 and "last", nothing else."""
    out = tmp_path / "out"
    ckpt = f"{s3_root}/ckpt"
    runs = [(4, ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]),
            (8, ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]),
            (12, ["epoch=1-step=10.ckpt", "epoch=1-step=12.ckpt"])]
    previous = 0
    for n, (max_steps, top2) in enumerate(runs, 1):
        cfg = {"root": s3_root, "out": str(out), "cwd": str(tmp_path), "tag": f"run{n}",
               "max_steps": max_steps}
        report, _ = lightning_workers.run_job("resumed_run", 2, cfg)
        assert report["global_step"] == max_steps
        if previous:
            # resumed from "last", bit-exact
            assert report["ckpt_path"] == f"{ckpt}/last.ckpt"
            _assert_resumed(out, f"run{n}", previous)
        assert _names(ckpt) == [*top2, "last.ckpt"], f"after run {n}"
        for name in top2:
            assert _committed(f"{ckpt}/{name}")
        backend = dcpstore.open_backend(ckpt)
        pointer = json.loads(backend.get("last.ckpt"))
        backend.close()
        assert pointer["target"] == top2[-1] and pointer["global_step"] == max_steps
        previous = max_steps
    assert not (tmp_path / "s3:").exists()


def test_last_keeps_what_it_names_until_it_moves(tmp_path: Path) -> None:
    """save_top_k may evict the checkpoint an earlier run's "last" names before this run's
    "last" has moved on (with a monitored metric, at a resumed run's first save): it is
    deleted only once "last" names another, so "last" never names a deleted checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = tmp_path / "ckpt"
    step4, step6, last = (str(ckpt / name) for name in
                          ("epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"))
    # what the earlier run left: step 4, and "last" naming it
    dcpstore.save({"w": torch.ones(4)}, step4)
    Path(last).write_text(json.dumps({"format": dl.POINTER_FORMAT,
                                      "target": "epoch=0-step=4.ckpt", "global_step": 4}))
    callback = ModelCheckpoint(dirpath=str(ckpt), save_last=True)
    callback.last_model_path = last  # as Lightning restores it from the resumed checkpoint
    strategy = dl.DcpstoreModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    strategy._attach(SimpleNamespace(default_root_dir=str(tmp_path),
                                     checkpoint_callbacks=[callback]))

    def checkpoint() -> dict[str, Any]:
        return {"state_dict": {"w": torch.full((4,), 6.0)}, "global_step": 6, "epoch": 0,
                "loops": {"steps": 6}}

    # what ModelCheckpoint does at step 6: the top-k save, the eviction of step 4, "last"
    strategy.save_checkpoint(checkpoint(), step6)
    strategy.remove_checkpoint(step4)
    assert _committed(step4), "deleted while 'last' named it"
    strategy.save_checkpoint(checkpoint(), last)
    assert json.loads(Path(last).read_text())["target"] == "epoch=0-step=6.ckpt"
    assert sorted(os.listdir(ckpt)) == ["epoch=0-step=6.ckpt", "last.ckpt"]


def test_other_strategies_refuse_dcpstore_uris(s3_root: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With the integration imported, a Trainer whose strategy is not
    DcpstoreModelParallelStrategy is refused a dcpstore URI (default_root_dir, a
    ModelCheckpoint dirpath, ckpt_path) when fit starts, before anything is written: stock
    strategies would put the checkpoints in a local ./s3: and never find "last"."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    monkeypatch.chdir(tmp_path)
    local = str(tmp_path / "run")

    def make(strategy: Any = "auto", root: str = s3_root, callbacks: Any = None) -> Any:
        return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1,
                          default_root_dir=root, callbacks=callbacks,
                          enable_progress_bar=False, enable_model_summary=False)

    fsdp = make(root=local)
    # Lightning refuses FSDPStrategy on CPU when the Trainer is made; put it where the
    # Trainer holds its strategy, as a Trainer on GPUs has it
    fsdp._accelerator_connector.strategy = FSDPStrategy()
    cases = [
        (make(), {}, "default_root_dir", "SingleDeviceStrategy"),
        (make(DDPStrategy(), local, [ModelCheckpoint(dirpath=f"{s3_root}/ckpt")]), {},
         "dirpath", "DDPStrategy"),
        (fsdp, {"ckpt_path": f"{s3_root}/ckpt/last.ckpt"}, "ckpt_path", "FSDPStrategy"),
    ]
    for trainer, kwargs, what, name in cases:
        with pytest.raises(ConfigurationError) as info:
            trainer.fit(lightning_workers.make_model(), **kwargs)
        message = str(info.value)
        assert name in message and what in message, message
        assert "DcpstoreModelParallelStrategy" in message, message
    with pytest.raises(ConfigurationError, match="DcpstoreModelParallelStrategy"):
        make(root=local).save_checkpoint(f"{s3_root}/manual.ckpt")
    # a URI pathlib mangled is refused too (ModelCheckpoint made it ./s3:/...)
    mangled = make(DDPStrategy(), local, [ModelCheckpoint(dirpath=Path(f"{s3_root}/ckpt"))])
    with pytest.raises(dcpstore.InvalidURIError, match="mangled"):
        mangled.fit(lightning_workers.make_model())
    assert os.listdir(tmp_path) == [] and _names(s3_root) == []
