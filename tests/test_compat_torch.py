"""dcpstore <-> torch's FileSystemWriter/FileSystemReader, both ways, bit-exact."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore.testing import assert_state_equal, many_dtypes_state


def _zeros_like(state: dict) -> dict:
    out: dict = {}
    for k, v in state.items():
        if hasattr(v, "contiguous"):
            out[k] = v.contiguous().clone().zero_() if v.numel() else v.clone()
        elif isinstance(v, dict):
            out[k] = _zeros_like(v)
        else:
            out[k] = None
    return out


def test_dcpstore_checkpoint_loads_with_torch_filesystem_reader(tmp_path: Path) -> None:
    state = many_dtypes_state(seed=3)
    dcpstore.save(state, tmp_path / "c")
    out = _zeros_like(state)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")), no_dist=True)
    assert_state_equal(out, state)


def test_torch_filesystem_writer_checkpoint_loads_with_dcpstore(tmp_path: Path) -> None:
    state = many_dtypes_state(seed=4)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "t")), no_dist=True)
    out = _zeros_like(state)
    dcp.load(out, storage_reader=dcpstore.get_reader(tmp_path / "t"), no_dist=True)
    assert_state_equal(out, state)
    # no manifest: loads unverified, and says so only at DEBUG
    assert not list((tmp_path / "t").glob(".dcpstore-*"))


def test_torch_multi_file_checkpoint_loads(tmp_path: Path) -> None:
    state = many_dtypes_state(seed=5)
    writer = dcp.FileSystemWriter(str(tmp_path / "m"), thread_count=3, single_file_per_rank=False)
    dcp.save(state, storage_writer=writer, no_dist=True)
    out = _zeros_like(state)
    dcpstore.load(out, tmp_path / "m")
    assert_state_equal(out, state)


def test_dcpstore_multi_file_loads_with_torch(tmp_path: Path) -> None:
    state = many_dtypes_state(seed=6)
    dcpstore.save(state, tmp_path / "f", files_per_rank=3)
    assert len(list((tmp_path / "f").glob("__0_*.distcp"))) == 3
    out = _zeros_like(state)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "f")), no_dist=True)
    assert_state_equal(out, state)
