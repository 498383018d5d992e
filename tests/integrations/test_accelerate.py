"""HF Accelerate ``save_state`` / ``load_state`` with FSDP2 sharded state through dcpstore.

Two launches: 2 ranks train, save with automatic naming and ``total_limit`` to SeaweedFS,
fail one save, resume bit-exact, and save explicit checkpoints to S3 and to a local path;
then 1 rank loads both explicit checkpoints (another world size) and must see the same
model, optimizer, scheduler and custom-object state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from hf_workers import accelerate_load, accelerate_save, assert_same
from mp import run_ranks

import dcpstore
from dcpstore.integrations.accelerate import (
    COMMIT_MARKER,
    check_uri,
    is_committed,
    join_uri,
    list_checkpoints,
)

pytestmark = pytest.mark.multiprocess


def test_uri_helpers_refuse_mangled_uris() -> None:
    assert join_uri("s3://b/run?part_size=8MiB", "checkpoints", "checkpoint_3") == (
        "s3://b/run/checkpoints/checkpoint_3?part_size=8MiB")
    assert join_uri("/tmp/run/", "checkpoint_1") == "/tmp/run/checkpoint_1"
    for bad in ("s3:/bucket/run", "./s3:/bucket/run", "gs:/b/x", "msc:/profile/x"):
        with pytest.raises(dcpstore.InvalidURIError, match="collapsed"):
            check_uri(bad)
    assert check_uri(Path("/tmp/x")) == "/tmp/x"


def test_accelerate_fsdp2_s3_and_local(s3_root: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a mangled URI would show up here as ./s3:
    run = f"{s3_root}/accelerate"
    explicit = [f"{run}/explicit", str(tmp_path / "local" / "explicit")]

    saved = run_ranks(accelerate_save, 2, f"{run}/project", explicit, timeout=400)
    assert "injected failure" in saved[1]["failed"], saved[1]["failed"]
    assert "rank 1" in saved[0]["failed"], saved[0]["failed"]  # rank 0 learns of rank 1's
    assert not (tmp_path / "s3:").exists()
    for uri in explicit:
        assert is_committed(uri)
    # the local checkpoint is DCP's own layout: torch's reader loads its metadata
    local_model = tmp_path / "local" / "explicit" / "pytorch_model_fsdp_0"
    meta = dcp.FileSystemReader(str(local_model)).read_metadata()
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)
    assert (tmp_path / "local" / "explicit" / COMMIT_MARKER).is_file()
    root = f"{run}/project/checkpoints"
    assert [n for n, _ in list_checkpoints(root, "checkpoint_")] == [1, 2]

    loaded = run_ranks(accelerate_load, 1, explicit, timeout=400)[0]
    for state in loaded:
        want = saved[0]["state"]
        assert_same({k: state[k] for k in ("model", "optim", "sched", "counter")},
                    {k: want[k] for k in ("model", "optim", "sched", "counter")}, "reshard")


def test_uncommitted_directories_are_not_checkpoints(tmp_path: Path) -> None:
    from dcpstore.integrations.accelerate import latest_checkpoint, require_committed

    root = tmp_path / "run"
    (root / "checkpoint_1").mkdir(parents=True)
    (root / "checkpoint_1" / COMMIT_MARKER).write_text("{}")
    (root / "checkpoint_2").mkdir()
    (root / "checkpoint_2" / "scheduler.bin").write_bytes(b"x")  # a save that never finished
    assert latest_checkpoint(str(root), "checkpoint_") == f"{root}/checkpoint_1"
    with pytest.raises(dcpstore.IncompleteCheckpointError, match="did not finish"):
        require_committed(f"{root}/checkpoint_2")
    with pytest.raises(dcpstore.CheckpointNotFoundError):
        require_committed(f"{root}/checkpoint_9")
