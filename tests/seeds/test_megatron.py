"""Megatron-Core 0.19.2 ``dist_checkpointing`` (``torch_dist``) for real, on dcpstore URIs.

Runs in .venv-seeds/megatron (``make test-seeds SEED_SYSTEMS=megatron``). A tiny GPTModel
(local layer spec) with tensor parallelism 2 on 2 gloo ranks and its Adam state are saved
with Megatron's own ``dist_checkpointing.save`` to SeaweedFS (``s3://``) and through an MSC
profile over it (``msc://``), with ``DcpstoreFeature`` enabled, then loaded at tensor
parallelism 1 on 1 rank with ``dist_checkpointing.load``: model and optimizer bit-exact.
Rank functions: megatron_workers.py. See docs/integrations/megatron.md.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from megatron_workers import VOCAB, fsdp_dtensor_plain_optimizer_state, load_tp1, save_tp2
from mp import run_ranks
from stores import BUCKET, MSC_PROFILE, write_store_msc_config

import dcpstore
from dcpstore.errors import BackendNotFoundError
from dcpstore.integrations.dcp_routing import MangledURIError
from dcpstore.integrations.megatron import DcpstoreFeature
from dcpstore.testing.servers import S3Server, isolate_env

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def s3_env(seaweedfs_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
           tmp_path: Path) -> S3Server:
    """SeaweedFS through the environment alone (ranks inherit it): the S3 backend's
    endpoint, and an MSC profile over the same bucket."""
    msc_config = write_store_msc_config(tmp_path / "msc.yaml", seaweedfs_s3)
    isolate_env(monkeypatch, extra={**seaweedfs_s3.env(), "MSC_CONFIG": msc_config,
                                    "DCPSTORE_S3_ENDPOINT_URL": seaweedfs_s3.endpoint_url})
    return seaweedfs_s3


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        assert not value.isnan().any(), f"{what}: {key} was not fully covered by the shards"
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{what}: {key}"


def test_gpt_tp2_saves_to_s3_and_msc_and_resumes_at_tp1(s3_env: S3Server) -> None:
    run = f"megatron-{uuid.uuid4().hex[:8]}/iter_0000002"
    uris = [f"s3://{BUCKET}/{run}", f"msc://{MSC_PROFILE}/msc-{run}"]
    saved = run_ranks(save_tp2, 2, uris, timeout=240)
    assert saved[0]["tensors"].keys() == saved[1]["tensors"].keys()
    want = saved[0]["tensors"]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in want), sorted(want)[:5]
    assert saved[0]["tp_shape"] == (VOCAB // 2, 16), saved[0]["tp_shape"]  # TP=2 shards

    files = {o.key for o in dcpstore.open_backend(uris[0]).list()}
    assert {".metadata", "metadata.json"} <= files, files
    assert any(k.startswith(".dcpstore-") for k in files), files  # dcpstore's manifest
    assert any(k.startswith("__1_") for k in files), files  # rank 1 wrote its shards
    assert b'"torch_dist"' in dcpstore.open_backend(uris[0]).get("metadata.json")
    assert dcpstore.open_backend(uris[1]).exists(".metadata")

    for uri in uris:
        loaded = run_ranks(load_tp1, 1, uri, timeout=240)[0]
        assert loaded["tp_shape"] == (VOCAB, 16)  # one rank holds the whole table
        assert loaded["iteration"] == 3
        assert loaded["step"] == saved[0]["step"] == 2.0
        _assert_same(loaded["tensors"], want, uri)


def test_plain_per_rank_optimizer_state_is_refused_naming_the_key(s3_env: S3Server) -> None:
    uri = f"s3://{BUCKET}/megatron-{uuid.uuid4().hex[:8]}/fsdp_dtensor/iter_0000001"
    errors = run_ranks(fsdp_dtensor_plain_optimizer_state, 2, uri, timeout=120)
    key = "optimizer.state.module.decoder.layers.0.mlp.linear_fc1.weight.exp_avg"
    assert "ShardingError" in errors[0] and key in errors[0], errors[0]
    assert errors[1] != "saved", errors[1]
    assert not dcpstore.open_backend(uri).exists(".metadata")  # nothing committed


def test_uri_the_flag_cannot_serve_is_refused_not_written_locally(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.dist_checkpointing.strategies import torch as strategies
    from megatron.core.msc_utils import maybe_msc

    monkeypatch.chdir(tmp_path)
    original = strategies.TorchDistSaveShardedStrategy.save
    DcpstoreFeature.enable()
    try:
        assert DcpstoreFeature.is_enabled()
        with pytest.raises(MangledURIError):
            maybe_msc.Path(str(Path("s3://bucket/run/iter_0000001")))
        with pytest.raises(BackendNotFoundError):
            maybe_msc.open("nosuchscheme://bucket/run/metadata.json", "w")
        with pytest.raises(MangledURIError):
            strategies.TorchDistSaveShardedStrategy().save({}, "s3:/bucket/run")
    finally:
        DcpstoreFeature.disable()
    assert not DcpstoreFeature.is_enabled()
    assert strategies.TorchDistSaveShardedStrategy.save is original
    assert list(tmp_path.iterdir()) == []  # no stray ./s3: or ./nosuchscheme: directory
