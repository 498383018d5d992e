"""The seam to torch's privates (:mod:`dcpstore.torch_internals`), checked on the running
torch: each name is there and does what dcpstore uses it for. The torch matrix runs this
file on every release dcpstore admits; a release that renames one fails here first."""

from __future__ import annotations

import ast
import io
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mp import run_ranks

import dcpstore
from dcpstore import _version
from dcpstore import torch_internals as ti
from dcpstore.dcp.codec import ViewFile

PACKAGE = Path(dcpstore.__file__).parent


def test_the_floor_is_the_one_pyproject_declares() -> None:
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    floor = ".".join(map(str, ti.TORCH_FLOOR))
    assert f'"torch>={floor}"' in text
    assert ti.torch_version() >= ti.TORCH_FLOOR


@pytest.mark.parametrize("old", ["2.8.0", "2.5.1+cu121", "1.13.1"])
def test_a_torch_below_the_floor_is_refused_by_name(old: str) -> None:
    floor = ".".join(map(str, ti.TORCH_FLOOR))
    with pytest.raises(ImportError, match=rf"needs torch >= {re.escape(floor)}; this is "
                                          rf"torch {re.escape(old)}"):
        ti.check_torch_version(old)
    ti.check_torch_version(f"{floor}.0")
    ti.check_torch_version("3.0.0")


def test_import_dcpstore_checks_the_installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import dcpstore`` refuses an old torch before importing it (the installed
    release's metadata says which it is)."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.4.0")
    with pytest.raises(ImportError, match="needs torch >= "):
        dcpstore._check_torch_floor()  # type: ignore[attr-defined]
    assert _version.release("2.10.0+cu128") == (2, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.int64, torch.bool, torch.uint8, torch.complex64,
                                   torch.float8_e4m3fn])
def test_element_size(dtype: torch.dtype) -> None:
    assert ti.element_size(dtype) == torch.empty((), dtype=dtype).element_size()


def test_tensor_archive_round_trip_through_the_restricted_unpickler() -> None:
    """An archive written without torch.save's CRC32 pass loads with torch.load, and
    the weights-only unpickler refuses anything but tensors and plain data."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    writer = ti.tensor_archive_writer(buf)
    ti.write_tensor_archive(t, writer)
    writer.write_end_of_file()
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True), t)
    assert ti.storage_alignment() >= 1

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (print, ("pwned",))

    with pytest.raises(pickle.UnpicklingError):
        ti.restricted_unpickler(io.BytesIO(pickle.dumps(Evil(), protocol=2))).load()
    plain = pickle.dumps({"a": [1, 2]}, protocol=2)
    assert ti.restricted_unpickler(io.BytesIO(plain)).load() == {"a": [1, 2]}


def test_narrow_tensor_by_index() -> None:
    t = torch.arange(20).reshape(4, 5)
    assert torch.equal(ti.narrow_tensor_by_index(t, [1, 2], [2, 3]), t[1:3, 2:5])


def test_storage_records_and_transforms() -> None:
    info = ti.StorageInfo(relative_path="__0_0.distcp", offset=8, length=16)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 8, 16)
    pickle.loads(pickle.dumps(info))  # it travels in .metadata
    pytest.importorskip("zstandard")
    ext = ti.zstandard_extension()
    writer = ti.StorageWriterTransforms([ext])
    reader = ti.StorageReaderTransforms()
    sink = io.BytesIO()
    out, descriptors = writer.transform_save_stream(
        _fake_write_item(), sink)  # type: ignore[arg-type]
    out.write(b"x" * 4096)
    out.close()
    assert descriptors and len(sink.getvalue()) < 4096
    source = ViewFile(memoryview(sink.getvalue()))  # as the reader's delivery passes it
    back = reader.transform_load_stream(_fake_read_item(), descriptors, source)
    assert back.read() == b"x" * 4096


def _fake_write_item() -> object:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    return WriteItem(index=MetadataIndex("x"), type=WriteItemType.BYTE_IO)


def _fake_read_item() -> object:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("x"),
                    dest_offsets=torch.Size([0]), storage_index=MetadataIndex("x"),
                    storage_offsets=torch.Size([0]), lengths=torch.Size([4096]))


def _dtensor_rank(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    d = distribute_tensor(full, mesh, [Shard(0)])
    local = ti.local_tensor(d)
    assert local.data_ptr() == d.to_local().data_ptr()  # the shard itself, no copy
    copy = ti.dtensor_like(local.clone(), d)
    assert torch.equal(copy.full_tensor(), full)
    assert ti.local_tensor(full) is full
    return dist.get_world_size() == world


def test_dtensor_local_shard_and_wrap() -> None:
    assert run_ranks(_dtensor_rank, 2) == [True, True]


def test_dcp_storage_setup_is_the_routing_hook() -> None:
    import inspect

    module = ti.dcp_storage_setup()
    hook = getattr(module, ti.STORAGE_SETUP_NAME)
    assert list(inspect.signature(hook).parameters) == ti.STORAGE_SETUP_PARAMS


#: What a private torch name looks like in code: an import of a name or module that
#: starts with "_", or an attribute path through one (``torch._utils``, ``x._spec``).
_PRIVATE_ATTRS = {"_local_tensor", "_spec", "_storage_setup"}


def _private_torch_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names = [a.name for a in node.names]
            if any(part.startswith("_") for part in (node.module or "").split(".")) or any(
                    n.startswith("_") for n in names):
                found.append(f"{path.name}:{node.lineno}: from {node.module} import "
                             f"{', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(
                        p.startswith("_") for p in alias.name.split(".")):
                    found.append(f"{path.name}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            chain = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                chain.append(cur.id)
            chain.reverse()
            if (chain[0] == "torch" and any(p.startswith("_") and not p.endswith("__")
                                            for p in chain[1:])) or (
                    node.attr in _PRIVATE_ATTRS):
                found.append(f"{path.name}:{node.lineno}: {'.'.join(chain)}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value in _PRIVATE_ATTRS):
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def test_the_seam_is_the_only_user_of_torch_privates() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "torch_internals.py":
            offenders += _private_torch_uses(path)
    assert offenders == [], "\n".join(offenders)
    # and the check does see them
    assert _private_torch_uses(PACKAGE / "torch_internals.py")


def test_metadata_is_written_in_the_form_every_release_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.15 pickles a sixth TensorProperties field (strides) that 2.14 and older
    cannot unpack; dcpstore's .metadata keeps the five every release reads."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    props = TensorProperties.create_from_tensor(torch.zeros(2, 3, dtype=torch.bfloat16))
    md = Metadata({"w": TensorStorageMetadata(props, torch.Size([2, 3]), [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))])})
    raw = ti.portable_metadata_bytes(md)

    seen: list[int] = []
    original = TensorProperties.__setstate__

    def five_fields_only(self: TensorProperties, state: tuple[object, ...]) -> None:
        seen.append(len(state))
        assert len(state) == 5, "an older torch unpacks exactly 5"
        original(self, state)

    monkeypatch.setattr(TensorProperties, "__setstate__", five_fields_only)
    back = pickle.loads(raw)
    assert seen == [5]
    got = back.state_dict_metadata["w"].properties
    assert (got.dtype, got.layout, got.requires_grad, got.pin_memory) == (
        torch.bfloat16, props.layout, False, False)


def test_group_timeout_is_the_one_the_group_was_made_with() -> None:
    """Side groups inherit it (a dead peer host must fail them as soon as the world)."""
    from datetime import timedelta

    import torch.distributed as dist

    from dcpstore.testing.servers import free_port
    from dcpstore.torch_internals import group_timeout

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=42))
    try:
        assert group_timeout() == timedelta(seconds=42)
        side = dist.new_group(backend="gloo", timeout=group_timeout())
        assert group_timeout(side) == timedelta(seconds=42)
    finally:
        dist.destroy_process_group()
