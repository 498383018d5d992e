"""Checkpointer, AppState, load_model_weights and export (single process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from stores import GatedBackend
from torch import nn

import dcpstore
from dcpstore.storage import registry
from dcpstore.storage.local import LocalBackend
from dcpstore.testing import assert_state_equal
from dcpstore.training.weights import read_metadata


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def _train(model: nn.Module, optim: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    for i in range(steps):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()


def test_checkpointer_save_latest_load_and_retention(tmp_path: Path) -> None:
    ckpt = dcpstore.Checkpointer(str(tmp_path / "run"), keep_last=2)
    assert ckpt.latest() is None and ckpt.steps() == []
    model, optim, sched = _model()
    for step in range(1, 5):
        _train(model, optim, sched, 1)
        ckpt.save(step, {"app": dcpstore.AppState(model, optim, sched, extra={"step": step})})
    assert ckpt.steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        ".dcpstore-latest.json",
        "step-000000003",
        "step-000000004",
    ]
    m2, o2, s2 = _model(seed=9)
    app = dcpstore.AppState(m2, o2, s2, extra={"step": 0})
    assert ckpt.load({"app": app}) == 4
    assert app.extra["step"] == 4
    assert s2.state_dict() == sched.state_dict()
    assert_state_equal(m2.state_dict(), model.state_dict())
    assert_state_equal(o2.state_dict()["state"], optim.state_dict()["state"])


def test_incomplete_step_is_not_latest(tmp_path: Path) -> None:
    ckpt = dcpstore.Checkpointer(str(tmp_path))
    ckpt.save(1, {"w": torch.ones(2)})
    crashed = tmp_path / "step-000000002"
    crashed.mkdir()
    (crashed / "__0_0.0123456789abcdef.distcp").write_bytes(b"partial")
    assert ckpt.latest() == 1 and ckpt.steps() == [1]
    with pytest.raises(dcpstore.IncompleteCheckpointError):
        ckpt.load({"w": torch.zeros(2)}, step=2)


def test_load_without_checkpoint_is_clear(tmp_path: Path) -> None:
    with pytest.raises(dcpstore.CheckpointNotFoundError, match="no committed checkpoint"):
        dcpstore.Checkpointer(str(tmp_path)).load({"w": torch.zeros(1)})


def test_bad_checkpointer_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        dcpstore.Checkpointer(str(tmp_path), keep_last=0)
    with pytest.raises(ValueError, match="async_mode"):
        dcpstore.Checkpointer(str(tmp_path), async_mode="later")  # type: ignore[arg-type]


def test_async_save_visible_only_when_committed(tmp_path: Path) -> None:
    dcpstore.register_backend("gated", GatedBackend, clobber=True)
    try:
        GatedBackend.gate.clear()
        ckpt = dcpstore.Checkpointer(f"gated:/{tmp_path}", keep_last=1, async_mode="thread")
        GatedBackend.gate.set()
        ckpt.save(1, {"w": torch.ones(3)})
        ckpt.wait()
        GatedBackend.gate.clear()
        ckpt.save(2, {"w": torch.full((3,), 2.0)})  # returns after staging
        assert ckpt.latest() == 1, "an async save must not be visible before it commits"
        GatedBackend.gate.set()
        ckpt.wait()
        assert ckpt.steps() == [2]
        out = {"w": torch.zeros(3)}
        assert ckpt.load(out) == 2 and torch.equal(out["w"], torch.full((3,), 2.0))
    finally:
        GatedBackend.gate.set()
        registry._reset_for_tests()


def test_failed_async_save_is_reported_and_leaves_nothing(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self) -> Any:
            raise RuntimeError("cannot serialize")

    ckpt = dcpstore.Checkpointer(str(tmp_path), keep_last=1, async_mode="thread")
    ckpt.save(1, {"w": torch.ones(2), "o": 1})
    ckpt.wait()
    try:
        ckpt.save(2, {"w": torch.zeros(2), "o": Unpicklable()})
    except RuntimeError:
        pass  # staging may already fail; either way nothing may be committed
    else:
        with pytest.raises(dcpstore.CheckpointSaveError, match="step 2"):
            ckpt.wait()
    assert ckpt.steps() == [1]
    assert (
        not any((tmp_path / "step-000000002").glob("*"))
        if (tmp_path / "step-000000002").exists()
        else True
    )
    out: dict[str, Any] = {"w": torch.zeros(2), "o": 0}
    ckpt.load(out)
    assert torch.equal(out["w"], torch.ones(2)) and out["o"] == 1


def test_load_model_weights_from_dcp_and_torch_file(tmp_path: Path) -> None:
    model, optim, sched = _model()
    _train(model, optim, sched, 2)
    dcpstore.Checkpointer(str(tmp_path / "run")).save(7, {"app": dcpstore.AppState(model, optim)})
    fresh, _, _ = _model(seed=5)
    dcpstore.load_model_weights(fresh, str(tmp_path / "run" / "step-000000007"))
    assert_state_equal(fresh.state_dict(), model.state_dict())

    torch.save(model.state_dict(), tmp_path / "weights.pt")
    other, _, _ = _model(seed=6)
    dcpstore.load_model_weights(other, str(tmp_path / "weights.pt"))
    assert_state_equal(other.state_dict(), model.state_dict())

    bigger = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3), nn.Linear(3, 1))
    with pytest.raises(dcpstore.CheckpointMismatchError, match="3.weight"):
        dcpstore.load_model_weights(bigger, str(tmp_path / "run" / "step-000000007"))
    dcpstore.load_model_weights(bigger, str(tmp_path / "run" / "step-000000007"), strict=False)
    assert torch.equal(bigger[0].weight, model[0].weight)


def test_export_torch_and_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = {"a": torch.randn(10, 3), "b": {"c": torch.arange(6).to(torch.bfloat16)}, "n": 5}
    dcpstore.save(state, tmp_path / "c", files_per_rank=2)
    n = dcpstore.export(str(tmp_path / "c"), str(tmp_path / "out.pt"))
    assert n == (tmp_path / "out.pt").stat().st_size
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b.c"], state["b"]["c"])
    assert loaded["n"] == 5
    dcpstore.export(
        str(tmp_path / "c"), str(tmp_path / "out.safetensors"), "safetensors", batch_bytes=64
    )
    st = load_file(str(tmp_path / "out.safetensors"))
    assert set(st) == {"a", "b.c"}
    assert torch.equal(st["a"], state["a"]) and torch.equal(st["b.c"], state["b"]["c"])
    with pytest.raises(ValueError, match="format"):
        dcpstore.export(str(tmp_path / "c"), str(tmp_path / "x"), "onnx")  # type: ignore[arg-type]


def test_weights_helpers_close_their_readers(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend the weight helpers open is closed (thread pools, clients), and each
    call reads through one reader."""
    model, optim, _sched = _model()
    ckpt = tmp_path / "run" / "step-000000001"
    dcpstore.Checkpointer(str(tmp_path / "run")).save(1, {"app": dcpstore.AppState(model, optim)})
    opened: list[LocalBackend] = []
    closed: list[LocalBackend] = []
    real_init, real_close = LocalBackend.__init__, LocalBackend.close

    def init(self: LocalBackend, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        opened.append(self)

    def close(self: LocalBackend) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(LocalBackend, "__init__", init)
    monkeypatch.setattr(LocalBackend, "close", close)
    read_metadata(str(ckpt))
    dcpstore.load_model_weights(_model(seed=3)[0], str(ckpt))
    dcpstore.export(str(ckpt), str(tmp_path / "out.safetensors"), "safetensors", batch_bytes=64)
    # read_metadata: 1 reader; load_model_weights: 1; export: 1 reader + the output
    assert len(opened) == 4
    assert all(any(b is c for c in closed) for b in opened)


def test_checkpointer_splits_writer_reader_and_backend_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(TypeError, match=r"Checkpointer\(.*unknown option.*bogus"):
        dcpstore.Checkpointer(str(tmp_path), bogus=1)
    monkeypatch.setenv("DCPSTORE_FILE_FILES_PER_RANK", "4")  # not a backend option: ignored
    ckpt = dcpstore.Checkpointer(str(tmp_path), files_per_rank=2, verify=True,
                                 max_concurrency=2, fsync=False)
    root_options = ckpt._root.backend.options
    assert root_options.max_concurrency == 2 and root_options.fsync is False
    state = {"a": torch.randn(64), "b": torch.randn(64), "c": torch.randn(8)}
    ckpt.save(1, state)
    assert len(list((tmp_path / "step-000000001").glob("*.distcp"))) == 2
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ckpt.load(out) == 1
    assert_state_equal(out, state)
