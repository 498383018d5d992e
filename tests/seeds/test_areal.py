"""AReaL 1.0 (``requirements/seeds/areal.txt``, torch 2.10) saving and recovering through its
own code on SeaweedFS with ``dcpstore.integrations.areal`` (docs/integrations/areal.md).

Runs in ``.venv-seeds/areal`` only (``make test-seeds-run SEED_SYSTEMS=areal``). The rank
functions are in ``areal_workers.py``: AReaL's ``FSDPEngine`` on a tiny Qwen2 (2 gloo ranks,
CPU), its SFT ``train_batch``, ``RecoverHandler.dump`` twice (the second replaces the recover
checkpoint), then a new run whose ``check_if_auto_recover`` and ``RecoverHandler.load`` read
everything back from the store, and a 1-rank ``FSDPEngine.load`` of the same checkpoint.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from areal_workers import EXPERIMENT, TRIAL, recover_run, reshard_run, save_run
from mp import run_ranks
from stores import S3_TEST_BUCKET

import dcpstore
from dcpstore.errors import BackendNotFoundError
from dcpstore.integrations import areal as dcpstore_areal
from dcpstore.integrations.dcp_routing import MangledURIError
from dcpstore.testing.servers import S3Server, isolate_env

pytestmark = pytest.mark.multiprocess

RECOVER_INFO = {"step_info.json", "saver_info.json", "evaluator_info.json",
                "stats_logger_info.json", "checkpoint_info.json", "dataloader_info.pkl"}


@pytest.fixture
def s3_root(seaweedfs_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix on SeaweedFS, reachable through the environment alone (the ranks
    inherit it); no developer ``AWS_*`` / ``DCPSTORE_*`` variable leaks in."""
    isolate_env(monkeypatch, extra={**seaweedfs_s3.env(), "USER": "areal",
                                    "DCPSTORE_S3_ENDPOINT_URL": seaweedfs_s3.endpoint_url,
                                    # AReaL torch.compiles its logprob gather: ~90 s of
                                    # inductor on 2 CPU cores at the first step; eager here
                                    "TORCHDYNAMO_DISABLE": "1"})
    return f"s3://{S3_TEST_BUCKET}/areal-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def areal_enabled() -> Iterator[None]:
    with dcpstore_areal.enabled():
        yield


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str = "") -> None:
    """Bit-exact equality of two nested state dicts (tensors by ``torch.equal``)."""
    assert got.keys() == want.keys(), (where, sorted(got), sorted(want))
    for key, value in want.items():
        path = f"{where}.{key}" if where else str(key)
        if isinstance(value, dict):
            assert_same(got[key], value, path)
        elif isinstance(value, torch.Tensor):
            assert isinstance(got[key], torch.Tensor), path
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), path
        else:
            assert got[key] == value, path


def stray_dirs(root: Path) -> list[str]:
    """What AReaL left in the ranks' working directories (should be nothing)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_save_recover_and_reshard_on_s3(s3_root: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model_dir, cwd = str(tmp_path / "tiny-qwen2"), tmp_path / "cwd"
    guard_uri = f"{s3_root}/guarded"
    saved = run_ranks(save_run, 2, s3_root, model_dir, str(cwd), guard_uri, timeout=280)

    # what the store holds: AReaL's recover info and one committed recover checkpoint
    # (the second dump replaced the first: one manifest, one data file per rank)
    save_root = f"checkpoints/areal/{EXPERIMENT}/{TRIAL}"
    keys = {o.key for o in dcpstore.open_backend(s3_root).list()}
    info_keys = {k.rsplit("/", 1)[1] for k in keys if k.startswith(f"{save_root}/recover_info/")}
    assert info_keys == RECOVER_INFO
    ckpt = sorted(k.rsplit("/", 1)[1] for k in keys
                  if k.startswith(f"{save_root}/default/recover_checkpoint/"))
    assert ckpt[0].startswith(".dcpstore-") and ckpt[1] == ".metadata", ckpt
    assert len(ckpt) == 4 and all(n.endswith(".distcp") for n in ckpt[2:]), ckpt
    assert not any(k.startswith(f"{s3_root.split('/', 3)[3]}/hf") for k in keys)
    # nothing local, in any rank's working directory or here
    assert stray_dirs(cwd) == ["rank0", "rank1"]
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))

    first = saved[0]
    assert first["auto_recover_before"] is False
    assert [s["batches"] for s in saved] == [[[0, 1], [2, 3]], [[8, 9], [10, 11]]]
    for rank in (0, 1):
        assert "weight_format='hf'" in saved[rank]["hf_error"]
        assert saved[rank]["guard_is_sharding_error"], saved[rank].get("guard_error")
        assert "per_rank_stat" in saved[rank]["guard_error"]
    assert not dcpstore.open_backend(guard_uri).exists(".metadata")
    want = first["state"]
    assert want["optim"]["state"], "the optimizer state is empty: no step was taken"

    # a new run on 2 ranks: auto-recover finds it on the store; RecoverHandler.load
    recovered = run_ranks(recover_run, 2, s3_root, model_dir, str(cwd / "recover"),
                          timeout=280)
    for rank, out in enumerate(recovered):
        assert out["auto_recover"] is True
        assert (out["global_step"], out["next_step"], out["stats_step"]) == (1, 2, 2)
        assert out["next_batch"] == saved[rank]["next_batch"]
    assert recovered[0]["saver_state"] == first["saver_state"]
    with pytest.raises(AssertionError):  # the new engine started elsewhere
        assert_same(recovered[0]["before"], want["model"])
    assert_same(recovered[0]["state"], want)
    assert stray_dirs(cwd / "recover") == ["rank0", "rank1"]

    # reshard: the 2-rank checkpoint into a 1-rank FSDPEngine
    resharded = run_ranks(reshard_run, 1, s3_root, model_dir, str(cwd / "one"), timeout=280)
    assert_same(resharded[0]["state"], want)
    assert stray_dirs(cwd / "one") == ["rank0"]


def test_bad_input_never_lands_on_local_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             areal_enabled: None) -> None:
    from areal.utils.recover import RecoverInfo, check_if_auto_recover
    from areal.utils.saver import Saver
    from areal_workers import recover_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("USER", "areal")
    # a scheme no dcpstore backend serves: an error, not a local "hdfs:" directory
    with pytest.raises(BackendNotFoundError, match="hdfs"):
        Saver.get_recover_checkpoint_path(EXPERIMENT, TRIAL, "hdfs://cluster/run")
    with pytest.raises(BackendNotFoundError, match="hdfs"):
        check_if_auto_recover(recover_config("hdfs://cluster/run"))
    # a URI that lost a slash (pathlib): refused before anything is made
    with pytest.raises(MangledURIError, match="s3://bucket/run"):
        Saver.get_save_root(EXPERIMENT, TRIAL, str(Path("s3://bucket/run")))
    with pytest.raises(MangledURIError):
        RecoverInfo.load("s3:/bucket/run/recover_info")
    assert list(tmp_path.iterdir()) == []


def test_enable_binds_only_while_enabled(tmp_path: Path) -> None:
    import areal.engine.fsdp_engine as fsdp_engine
    import areal.utils.recover as recover
    import areal.utils.saver as saver
    import torch.distributed.checkpoint as dcp

    with dcpstore_areal.enabled():
        assert dcpstore_areal.is_enabled()
        assert recover.os is not os and saver.os is not os and fsdp_engine.dcp is not dcp
        # local paths keep AReaL's own file I/O
        recover.os.makedirs(str(tmp_path / "local" / "dir"), exist_ok=True)
        with recover.open(str(tmp_path / "local" / "f.json"), "w") as f:
            f.write("{}")
        assert (tmp_path / "local" / "f.json").read_text() == "{}"
    assert not dcpstore_areal.is_enabled()
    assert recover.os is os and saver.os is os and fsdp_engine.dcp is dcp
    assert "open" not in vars(recover)
    assert fsdp_engine.FSDPEngine.save.__name__ == "save"
    assert not hasattr(fsdp_engine.FSDPEngine.save, "__wrapped__")


def test_recover_info_round_trip_on_s3(s3_root: str, areal_enabled: None,
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AReaL's own ``RecoverInfo`` dumped and loaded back without torch.distributed, and a
    failed write stores nothing."""
    from areal.api import StepInfo
    from areal.utils.recover import RecoverInfo
    from areal.utils.recover import open as recover_open  # type: ignore[attr-defined]

    monkeypatch.chdir(tmp_path)
    info = RecoverInfo(last_step_info=StepInfo(epoch=1, epoch_step=3, global_step=7,
                                               steps_per_epoch=4),
                       saver_info={"a": 1}, evaluator_info={}, stats_logger_info={"s": 2},
                       dataloader_info={"idx": 5}, checkpoint_info={"c": [1, 2]})
    info.dump(f"{s3_root}/recover_info")
    assert RecoverInfo.load(f"{s3_root}/recover_info") == info
    with pytest.raises(RuntimeError), recover_open(f"{s3_root}/broken.json", "w") as f:
        f.write("{half")
        raise RuntimeError("interrupted")
    assert not dcpstore.open_backend(s3_root).exists("broken.json")
    with pytest.raises(FileNotFoundError):
        RecoverInfo.load(f"{s3_root}/nothing-here")
    assert list(tmp_path.iterdir()) == []
