"""DCP routing: plain ``dcp.save(checkpoint_id=uri)`` / ``dcp.load`` / ``dcp.async_save``
go through dcpstore when ``DCPSTORE_DCP_ROUTING=1`` or ``enable()`` says so."""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsdp_workers import build, full_state, load_into, sharded_state, train
from mp import run_ranks
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import dcpstore
from dcpstore.integrations import dcp_routing
from dcpstore.integrations.dcp_routing import (
    DcpRoutingUnsupportedError,
    MangledURIError,
)
from dcpstore.testing import assert_state_equal


def _manifests(uri: str) -> list[str]:
    backend = dcpstore.open_backend(uri)
    try:
        return [o.key for o in backend.list() if o.key.startswith(".dcpstore-")]
    finally:
        backend.close()


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Routing on in this process for one test (environment left alone)."""
    monkeypatch.delenv(dcp_routing.ENV_VAR, raising=False)
    dcp_routing.enable(propagate=False)
    yield dcp_routing
    dcp_routing.disable()


# -- rank functions (run in spawned processes) ----------------------------------------


def _save_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """2 ranks: plain dcp.save and dcp.async_save by checkpoint_id, routing enabled."""
    dcp_routing.enable(propagate=False)
    model, optim = build(world_size, seed=3)
    train(model, optim, 2, seed=11, batch=4)
    dcp.save(sharded_state(model, optim), checkpoint_id=f"{root}/step-2")
    first = full_state(model, optim)
    train(model, optim, 1, seed=11, batch=4)
    future = dcp.async_save(sharded_state(model, optim), checkpoint_id=f"{root}/step-3")
    future.result()
    return {"step-2": first, "step-3": full_state(model, optim)}


def _load_ranks(rank: int, world_size: int, root: str, step: str) -> dict[str, Any]:
    """Any world size: plain dcp.load by checkpoint_id into a fresh FSDP2 model."""
    dcp_routing.enable(propagate=False)
    model, optim = build(world_size, seed=99)
    train(model, optim, 1, seed=11, batch=4)  # optimizer state exists, with other values
    load_into(model, optim, checkpoint_id=f"{root}/{step}")
    return full_state(model, optim)


# -- tests ------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_fsdp2_plain_dcp_save_to_s3_routed(s3_root: str) -> None:
    """2 gloo ranks, FSDP2, routing enabled in each rank: dcp.save and dcp.async_save by
    checkpoint_id land on SeaweedFS through dcpstore, and load bit-exact at world size 1.
    (The ranks fork from a preloaded server, so the .pth start-up path is tested with a
    fresh interpreter below.)"""
    saved = run_ranks(_save_ranks, 2, s3_root)[0]
    for step in ("step-2", "step-3"):
        assert _manifests(f"{s3_root}/{step}"), f"{step} was not written by dcpstore"
    loaded = run_ranks(_load_ranks, 1, s3_root, "step-2")[0]
    assert_state_equal(loaded, saved["step-2"], "step-2")
    loaded = run_ranks(_load_ranks, 1, s3_root, "step-3")[0]
    assert_state_equal(loaded, saved["step-3"], "step-3")


_SCRIPT = """
import sys
assert "dcpstore" not in sys.modules, "the .pth hook imported dcpstore at start-up"
import torch, torch.distributed.checkpoint as dcp
dcp.save({"w": torch.arange(6.0)}, checkpoint_id=sys.argv[1] + "/sync")
dcp.async_save({"w": torch.arange(6.0) * 2}, checkpoint_id=sys.argv[1] + "/async").result()
for name, factor in (("sync", 1), ("async", 2)):
    out = {"w": torch.zeros(6)}
    dcp.load(out, checkpoint_id=sys.argv[1] + "/" + name)
    assert torch.equal(out["w"], torch.arange(6.0) * factor)
"""


def _run_script(args: list[str], routing: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != dcp_routing.ENV_VAR}
    if routing is not None:
        env[dcp_routing.ENV_VAR] = routing
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=240)


def test_env_variable_routes_plain_dcp_without_an_import(tmp_path: Path) -> None:
    """``DCPSTORE_DCP_ROUTING=1 python script.py``: no dcpstore import in the script, yet
    the checkpoint is dcpstore's; without the variable it is torch's."""
    paths = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    assert any((Path(p) / "dcpstore-dcp-routing.pth").is_file() for p in paths), (
        "dcpstore-dcp-routing.pth is not installed in site-packages: reinstall dcpstore "
        "(pip install -e . / pip install .)")
    routed, plain = tmp_path / "routed", tmp_path / "plain"
    proc = _run_script(["-c", _SCRIPT, str(routed)], "1")
    assert proc.returncode == 0, proc.stderr
    for name in ("sync", "async"):
        assert list((routed / name).glob(".dcpstore-*.json")), sorted(os.listdir(routed / name))
    proc = _run_script(["-c", _SCRIPT, str(plain)], None)
    assert proc.returncode == 0, proc.stderr
    for name in ("sync", "async"):
        assert sorted(os.listdir(plain / name)) == [".metadata", "__0_0.distcp"]
    # unset (or "0"): the start-up line neither imports torch nor dcpstore
    probe = "import sys; print('torch' in sys.modules, 'dcpstore' in sys.modules)"
    for value in (None, "0", "1"):
        proc = _run_script(["-c", probe], value)
        assert proc.stdout.split() == ["False", "False"], (value, proc.stdout, proc.stderr)


def test_explicit_writer_and_reader_win(routed: Any, tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0)}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path)), checkpoint_id=tmp_path,
             no_dist=True)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]
    out = {"w": torch.zeros(4)}
    reader = FileSystemReader(str(tmp_path))
    dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(out["w"], state["w"])


def test_routed_local_path_and_file_uri(routed: Any, tmp_path: Path) -> None:
    state = {"w": torch.arange(5.0)}
    for target in (tmp_path / "bare", f"file://{tmp_path}/url"):
        dcp.save(state, checkpoint_id=target, no_dist=True)
        assert _manifests(str(target)), target
        out = {"w": torch.zeros(5)}
        dcp.load(out, checkpoint_id=target, no_dist=True)
        assert torch.equal(out["w"], state["w"])


def test_unserved_scheme_is_left_to_torch(routed: Any) -> None:
    """fsspec's memory:// is no dcpstore scheme: torch's FsspecWriter takes it."""
    state = {"w": torch.arange(3.0)}
    dcp.save(state, checkpoint_id="memory://h6-routing/x", no_dist=True)
    import fsspec

    fs = fsspec.filesystem("memory")
    assert fs.exists("/h6-routing/x/.metadata")
    assert not [p for p in fs.ls("/h6-routing/x", detail=False) if ".dcpstore-" in p]


@pytest.mark.parametrize("mangled", ["s3:/bucket/run/step-1", "gs:/b/x", "file:/tmp/x"])
def test_mangled_uri_fails_loudly(
    routed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mangled: str
) -> None:
    """``Path("s3://b/x")`` is ``s3:/b/x``; routing refuses it instead of writing ./s3:/."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MangledURIError, match=r"lost a slash.*://"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=Path(mangled), no_dist=True)
    with pytest.raises(MangledURIError):
        dcp.load({"w": torch.ones(2)}, checkpoint_id=f"out/{mangled}", no_dist=True)
    assert os.listdir(tmp_path) == []


def test_enable_disable_and_context(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import _storage_utils, state_dict_saver

    monkeypatch.delenv(dcp_routing.ENV_VAR, raising=False)
    original = state_dict_saver._storage_setup
    assert not dcp_routing.is_enabled()
    with dcp_routing.routing():
        assert dcp_routing.is_enabled()
        dcp_routing.enable()  # idempotent
        assert os.environ[dcp_routing.ENV_VAR] == "1"  # children route too
        assert state_dict_saver._storage_setup is not original
    assert not dcp_routing.is_enabled()
    assert dcp_routing.ENV_VAR not in os.environ
    assert state_dict_saver._storage_setup is original is _storage_utils._storage_setup
    assert dcpstore.enable_dcp_routing is dcp_routing.enable


def test_unsupported_torch_internals_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose hook point differs: enable() names the version and enables nothing."""
    from torch.distributed.checkpoint import _storage_utils, state_dict_loader

    monkeypatch.delenv(dcp_routing.ENV_VAR, raising=False)
    version = torch.__version__

    def other_setup(storage: Any, checkpoint_id: Any) -> Any:
        return storage

    # the saver no longer calls the function routing replaces
    monkeypatch.setattr(state_dict_loader, "_storage_setup", other_setup)
    expected = rf"torch {re.escape(version)}.*Routing is NOT"
    with pytest.raises(DcpRoutingUnsupportedError, match=expected):
        dcp_routing.enable()
    assert not dcp_routing.is_enabled()
    assert dcp_routing.ENV_VAR not in os.environ
    monkeypatch.undo()

    # the hook point changed its signature
    monkeypatch.setattr(_storage_utils, "_storage_setup", other_setup)
    with pytest.raises(DcpRoutingUnsupportedError, match=rf"torch {re.escape(version)}"):
        dcp_routing.enable()
    monkeypatch.undo()

    # the hook point is gone
    monkeypatch.delattr(_storage_utils, "_storage_setup")
    with pytest.raises(DcpRoutingUnsupportedError, match="missing"):
        dcp_routing.enable()
    assert not dcp_routing.is_enabled()
