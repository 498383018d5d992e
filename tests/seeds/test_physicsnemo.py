"""PhysicsNeMo 2.2 for real (docs/integrations/physicsnemo.md): its own FNO and FullyConnected
under FSDP2 on 2 gloo ranks, saved and resumed through its own ``physicsnemo.utils``
``save_checkpoint`` / ``load_checkpoint`` / ``load_model_weights`` on ``s3://`` (SeaweedFS),
after the one import ``import dcpstore.integrations.physicsnemo``.

Runs in .venv-seeds/physicsnemo only (``make test-seeds-run SEED_SYSTEMS=physicsnemo``).
It replaces the plain-torch reproduction of PhysicsNeMo's call pattern that
tests/integrations/ held.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mp import preload, run_ranks
from physicsnemo_workers import GAMMA, fno_resume, fno_save, fully_connected, shard_tensor_run
from stores import S3_TEST_BUCKET

import dcpstore
from dcpstore.testing.servers import S3Server, isolate_env

pytestmark = pytest.mark.multiprocess

# every rank imports PhysicsNeMo (4 s): once, in the launcher's forkserver
preload(["physicsnemo", "physicsnemo.models.fno", "physicsnemo.models.mlp",
         "physicsnemo.domain_parallel", "physicsnemo.utils.checkpoint"])


@pytest.fixture
def s3_root(seaweedfs_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ``s3://`` prefix on SeaweedFS, reachable from the environment alone (so the
    ranks reach it too); nothing can go to a real AWS endpoint."""
    isolate_env(monkeypatch, extra={**seaweedfs_s3.env(),
                                    "DCPSTORE_S3_ENDPOINT_URL": seaweedfs_s3.endpoint_url})
    return f"s3://{S3_TEST_BUCKET}/pnemo-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run in an empty directory, to see that nothing is written locally."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def assert_same(got: Any, want: Any, where: str) -> None:
    """Equal bit for bit: tensors with torch.equal (same dtype and shape), the rest with ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), \
            f"{where}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _data_files(uri: str) -> dict[str, int]:
    backend = dcpstore.open_backend(uri)
    try:
        return {o.key: o.size for o in backend.list() if o.key.endswith(".distcp")}
    finally:
        backend.close()


def test_fsdp2_fno_saves_sharded_and_resumes_at_2_and_1_ranks(s3_root: str, in_tmp: Path
                                                              ) -> None:
    root, bad_root = f"{s3_root}/fno", f"{s3_root}/bad"
    saved, other = run_ranks(fno_save, 2, root, bad_root, timeout=240)

    # FSDP2 sharded each parameter over the 2 ranks
    for name, (local, full) in saved["shards"].items():
        assert local[0] + other["shards"][name][0][0] == full[0], name
    # PhysicsNeMo's naming; one committed DCP checkpoint per epoch
    assert dcpstore.integrations.physicsnemo.committed_epochs(root) == [1, 2, 3]
    # each rank streamed its own shards: no rank-0 gather
    files = _data_files(f"{root}/checkpoint.0.3")
    by_rank = {int(re.match(r"__(\d+)_", k).group(1)): n for k, n in files.items()}
    assert sorted(by_rank) == [0, 1], files
    total = sum(by_rank.values())
    assert all(n > 0.3 * total for n in by_rank.values()), by_rank
    # a plain per-rank tensor beside the sharded model is refused at save, by key
    for result in (saved, other):
        assert "'models.Linear." in result["refused"], result["refused"]
    assert not _data_files(bad_root)
    assert not any(in_tmp.iterdir())  # nothing local (no ./s3: directory)

    for world in (2, 1):
        got = run_ranks(fno_resume, world, root, timeout=240)
        first = got[0]
        assert [g["epoch"] for g in got] == [3] * world
        assert first["meta"] == {"loss": saved["losses"][3], "run": "fno"}
        assert_same(first["scheduler"], saved["scheduler"], f"ws{world} scheduler")
        assert first["scheduler"]["last_epoch"] == 3
        assert first["scheduler"]["_last_lr"] == [1e-2 * GAMMA]
        assert_same(first["latest"], saved["states"][3], f"ws{world} epoch 3")
        assert [g["next_loss"] for g in got] == [saved["next_loss"]] * world
        assert first["epoch2"] == 2 and first["meta2"]["loss"] == saved["losses"][2]
        assert_same(first["state2"], saved["states"][2], f"ws{world} epoch 2")
        assert_same(first["weights1"], saved["states"][1]["model"], f"ws{world} weights 1")
        if world == 1:
            assert_same(first["plain2"], saved["states"][2]["model"], "plain weights 2")


def test_shard_tensor_domain_parallel_round_trip(s3_root: str) -> None:
    got = run_ranks(shard_tensor_run, 2, f"{s3_root}/shard", timeout=240)
    for rank, result in enumerate(got):
        assert result["input"] == "ShardTensor"
        assert result["epoch"] == 1
        assert_same(result["loaded"], result["saved"], f"rank {rank}")
        assert result["next_loss_loaded"] == result["next_loss"]
    assert got[0]["next_loss"] == got[1]["next_loss"]


def test_epoch_naming_latest_and_overwrite_in_one_process(s3_root: str, in_tmp: Path) -> None:
    """PhysicsNeMo's index rules, single process (no process group): ``epoch=None`` saves
    at the next index and stores no epoch; an explicit epoch replaces what is there."""
    import physicsnemo.utils as pn
    from physicsnemo.utils import checkpoint as pn_checkpoint

    import dcpstore.integrations.physicsnemo as integration

    assert integration.is_enabled()
    assert pn.save_checkpoint is pn_checkpoint.save_checkpoint
    root = f"{s3_root}/single"
    model = fully_connected(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert pn.load_checkpoint(root, models=model) == 0  # nothing there yet

    def train() -> dict[str, torch.Tensor]:
        optimizer.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    weights = {}
    for epoch in (None, None, 5, None):
        weights[epoch if epoch is not None else len(weights)] = train()
        pn.save_checkpoint(root, models=model, optimizer=optimizer, epoch=epoch,
                           metadata={"i": len(weights)})
    assert integration.committed_epochs(root) == [0, 1, 5, 6]
    fresh = fully_connected(1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    meta: dict[str, Any] = {}
    # latest is index 6, saved with epoch=None: PhysicsNeMo stores no epoch, so 0
    assert pn.load_checkpoint(root, models=fresh, optimizer=fresh_opt, metadata_dict=meta) == 0
    assert meta == {"i": 4}
    assert_same(dict(fresh.state_dict()), weights[3], "index 6")
    assert pn.load_checkpoint(root, models=fresh, epoch=5) == 5
    assert_same(dict(fresh.state_dict()), weights[5], "epoch 5")
    # saving epoch 5 again replaces it (atomically)
    new = train()
    pn.save_checkpoint(root, models=model, epoch=5)
    assert pn.load_checkpoint(root, models=fresh, epoch=5) == 5
    assert_same(dict(fresh.state_dict()), new, "epoch 5 replaced")
    assert pn.load_checkpoint(root, models=fresh, epoch=9) == 0  # no such epoch
    pn.load_model_weights(fresh, root)  # the directory: its latest epoch (5 < 6)
    assert_same(dict(fresh.state_dict()), weights[3], "weights of index 6")
    assert not any(in_tmp.iterdir())


def test_local_paths_keep_physicsnemo_s_own_files(in_tmp: Path) -> None:
    import physicsnemo.utils as pn

    model = fully_connected(0)
    pn.save_checkpoint(str(in_tmp / "ck"), models=model, epoch=1)
    assert sorted(os.listdir(in_tmp / "ck")) == ["FullyConnected.0.1.mdlus", "checkpoint.0.1.pt"]
    # the module's own functions take local paths sharded
    from dcpstore.integrations import physicsnemo as integration

    integration.save_checkpoint(str(in_tmp / "dcp"), models=model, epoch=1)
    assert (in_tmp / "dcp" / "checkpoint.0.1" / ".metadata").is_file()
    fresh = fully_connected(1)
    assert integration.load_checkpoint(str(in_tmp / "dcp"), models=fresh) == 1
    assert_same(dict(fresh.state_dict()), dict(model.state_dict()), "local sharded")


@pytest.mark.parametrize(("uri", "error"), [
    ("gs://bucket/run", "pip install dcpstore-gcs"),  # a scheme whose plugin is missing
    ("az://container/run", "az"),
    ("s3:/bucket/run", "lost a slash"),  # pathlib's mangling of s3://bucket/run
])
def test_unservable_uri_errors_and_writes_nothing_locally(uri: str, error: str, in_tmp: Path,
                                                          s3_root: str) -> None:
    import physicsnemo.utils as pn

    import dcpstore.integrations.physicsnemo  # noqa: F401
    from dcpstore.errors import DcpstoreError

    model = fully_connected(0)
    for call in (lambda: pn.save_checkpoint(uri, models=model, epoch=1),
                 lambda: pn.load_checkpoint(uri, models=model),
                 lambda: pn.load_model_weights(model, f"{uri}/FullyConnected.0.1.mdlus")):
        with pytest.raises(DcpstoreError, match=re.escape(error)):
            call()
    assert not any(in_tmp.iterdir())


def test_distributed_manager_on_cpu_needs_the_shim(tmp_path: Path) -> None:
    """The error the docs quote: PhysicsNeMo's DistributedManager passes a CPU device_id
    that torch 2.14 refuses. When this fails, PhysicsNeMo fixed it: drop the shim."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    code = ("from physicsnemo.distributed import DistributedManager\n"
            "DistributedManager.initialize()\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert ("ValueError: init_process_group device_id parameter must be an accelerator "
            "with an index") in done.stderr, done.stderr[-2000:]


def _free_port() -> int:
    from dcpstore.testing.servers import free_port

    return int(free_port())
