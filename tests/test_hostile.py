"""Hostile checkpoints: no code runs and nothing outside the checkpoint is touched.

An attacker who can write to the bucket can rewrite every object of a checkpoint
consistently (data files, the manifest with matching CRC32Cs, ``.metadata``), so these
checkpoints pass integrity checks; what must stop them is the loader itself. On the
local disk and on S3 (moto) this file proves:

- ``.metadata`` carrying a pickle that would create a marker file (``os.system``,
  ``builtins.exec``, ``subprocess.call``, the same nested inside a ``storage_data``
  entry, a ``torch.load(..., weights_only=False)`` of a second file, and torch.save's
  persistent ids) is refused with ``UnsafeCheckpointError`` by ``dcpstore.load``,
  ``dcp.load``, ``verify``, ``inspect``, ``cp``, and skipped by ``gc``; the marker is
  never created (each payload is first shown to create it under plain ``pickle``);
  only ``allow_unsafe_metadata=True`` runs it;
- a non-tensor item holding such a payload is refused by default (``weights_only``)
  and runs only with ``allow_pickle=True``; an ``io.BytesIO`` entry is refused by
  default and with ``allow_pickle=True`` comes back as inert bytes;
- a tensor item replaced by a malicious pickle is refused, even with
  ``allow_pickle=True``, on the staged and on the read-into-destination path;
- path traversal in any stored name (``../x``, absolute, ``a/../../b``, backslashes,
  empty, NUL) in ``.metadata``'s ``storage_data``, in the manifest's file list and in
  the save id (which names the manifest) is refused by load, verify, inspect and cp,
  ignored by gc, and harmless to an overwriting save; a sentinel object outside the
  checkpoint is intact afterwards, and every key that reached a storage primitive
  (local paths, S3 keys, Azure blob names) stayed inside the checkpoint root.

Complements ``tests/test_api.py`` (the basic local cases).
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import io
import os
import pickle
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcpstore_s3 import S3Store
from stores import Store
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

import dcpstore
from dcpstore.dcp import layout
from dcpstore.dcp.manifest import FileRecord, Manifest, Payload, crc32c
from dcpstore.dcp.safe_pickle import safe_loads
from dcpstore.storage.local import LocalStore
from dcpstore.storage.uri import validate_key
from dcpstore.tools.ops import copy_checkpoint, gc, inspect_checkpoint, verify_checkpoint

try:
    from dcpstore_azure import AzureBlobStore
except ImportError:  # the Azure plugin is optional (its store's tests skip without it)
    AzureBlobStore = None

SENTINEL = b"sentinel: must survive every hostile checkpoint"


# -- payloads ----------------------------------------------------------------------------


class Call:
    """Pickles as ``fn(*args)``: unpickling it calls ``fn``."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn = fn
        self.args = args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


def _payloads(marker: Path, scratch: Path) -> dict[str, Any]:
    """Objects whose unpickling creates ``marker``, one per technique."""
    second_stage = scratch / f"stage2-{uuid.uuid4().hex[:6]}.pt"
    torch.save(Call(os.system, f"touch {marker}"), second_stage)
    return {
        "os_system": Call(os.system, f"touch {marker}"),
        "exec": Call(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "subprocess": Call(subprocess.call, ["touch", str(marker)]),
        # torch.load of another file with weights_only=False, as an old loader would
        "torch_load": Call(functools.partial(torch.load, weights_only=False),
                           str(second_stage)),
    }


def _assert_live(payload: bytes, marker: Path) -> None:
    """The payload really runs code under plain pickle (so refusing it matters)."""
    pickle.loads(payload)
    assert marker.exists(), "the payload did not create its marker under plain pickle"
    marker.unlink()


class _Storage:
    """Stands for a tensor storage in :class:`_PersistentIds`."""


class _PersistentIds(pickle.Pickler):
    """A pickle like torch.save's ``data.pkl``: storages as persistent ids."""

    def persistent_id(self, obj: Any) -> Any:
        return ("storage", "FloatStorage", "0", "cpu", 4) if isinstance(obj, _Storage) else None


# -- stores ------------------------------------------------------------------------------


def _ckpt(store: Store) -> str:
    """The checkpoint under attack: ``<store>/root/ckpt`` (the sentinel is beside root)."""
    return f"{store.root}/root/ckpt"


def _sentinel(store: Store) -> bytes:
    backend = store.backend()
    try:
        return backend.get("sentinel")
    finally:
        backend.close()


def _keys_outside_root(store: Store) -> list[str]:
    backend = store.backend()
    try:
        return sorted(o.key for o in backend.list() if not o.key.startswith("root/"))
    finally:
        backend.close()


@pytest.fixture(autouse=True)
def _guarded_sentinel(store: Store) -> Iterator[None]:
    """A sentinel object outside the checkpoint root; intact after every test."""
    backend = store.backend()
    backend.put("sentinel", SENTINEL)
    backend.close()
    yield
    assert _sentinel(store) == SENTINEL


@pytest.fixture
def spy(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every key that reaches a storage primitive (local paths, S3 keys, Azure blob
    names); the test fails if one was unsafe or resolved outside its backend's root. It
    hooks the local, S3 and Azure backends' key-to-path functions (Azure: its blob
    client per key, and its batch delete), so on GCS and MSC it watches nothing (the
    sentinel and ``_exercise``'s checks still run there)."""
    seen: list[str] = []
    escaped: list[str] = []
    local_path = LocalStore._path
    s3_physical = S3Store._physical

    def check(key: str, inside: bool) -> None:
        seen.append(key)
        try:
            validate_key(key)
        except dcpstore.UnsafeKeyError:
            inside = False
        if not inside:
            escaped.append(key)

    def checked_path(self: LocalStore, key: str) -> str:
        path = local_path(self, key)
        root = os.path.realpath(self.location)
        check(key, os.path.realpath(path).startswith(root + os.sep))
        return path

    def checked_physical(self: S3Store, key: str) -> str:
        physical = s3_physical(self, key)
        check(key, physical.startswith(self.root) and ".." not in physical.split("/"))
        return physical

    monkeypatch.setattr(LocalStore, "_path", checked_path)
    monkeypatch.setattr(S3Store, "_physical", checked_physical)
    if AzureBlobStore is not None:
        azure_blob, azure_delete = AzureBlobStore._blob, AzureBlobStore.delete

        def azure_check(self: Any, key: str) -> None:
            name = self.root + key  # the blob name the plugin sends
            check(key, name.startswith(self.root) and ".." not in name.split("/"))

        def checked_blob(self: Any, key: str) -> Any:
            azure_check(self, key)
            return azure_blob(self, key)

        def checked_delete(self: Any, keys: Any) -> None:
            for key in keys:
                azure_check(self, key)
            azure_delete(self, keys)

        monkeypatch.setattr(AzureBlobStore, "_blob", checked_blob)
        monkeypatch.setattr(AzureBlobStore, "delete", checked_delete)
    yield seen
    if store.kind in ("local", "s3", "azure"):
        assert seen, "no storage request was observed"
    assert escaped == [], f"keys outside the checkpoint root reached storage: {escaped}"


# -- forging -----------------------------------------------------------------------------


def _save(store: Store, state: dict[str, Any] | None = None) -> Metadata:
    state = state if state is not None else {"w": torch.randn(8), "b": torch.randn(1024)}
    dcpstore.save(state, _ckpt(store), overwrite=True, **store.options)
    backend = store.backend(_ckpt(store))
    try:
        md = safe_loads(backend.get(".metadata"))
    finally:
        backend.close()
    assert isinstance(md, Metadata)
    return md


def _save_id(md: Metadata) -> str:
    assert md.storage_meta is not None and isinstance(md.storage_meta.save_id, str)
    return md.storage_meta.save_id


def _forge(store: Store, metadata_bytes: bytes, *, save_id: str | None = None,
           data: dict[str, bytes] | None = None, md: Metadata | None = None,
           extra_files: dict[str, FileRecord] | None = None,
           payloads: dict[str, dict[int, Payload]] | None = None) -> None:
    """Rewrite the checkpoint as an attacker with write access would: data files, a
    manifest whose CRC32Cs match them and ``.metadata``, all consistent."""
    backend = store.backend(_ckpt(store))
    try:
        files: dict[str, FileRecord] = {}
        if save_id is not None:
            old = Manifest.from_bytes(backend.get(layout.manifest_key(save_id)))
            files = dict(old.files)
        for name, blob in (data or {}).items():
            assert md is not None
            items = sorted((i.offset, i.length, crc32c(blob[i.offset:i.offset + i.length]))
                           for i in (md.storage_data or {}).values() if i.relative_path == name)
            files[name] = FileRecord(len(blob), crc32c(blob), items,
                                     (payloads or {}).get(name, {}))
            backend.put(name, blob)
        if save_id is not None:
            manifest = Manifest(save_id, 1, files,
                                metadata=FileRecord(len(metadata_bytes), crc32c(metadata_bytes)))
            doc = manifest.to_bytes()
            if extra_files:  # keys Manifest itself would never write
                import json

                parsed = json.loads(doc)
                parsed["files"].update({k: v.to_json() for k, v in extra_files.items()})
                doc = json.dumps(parsed).encode()
            backend.put(layout.manifest_key(save_id), doc)
        backend.put(".metadata", metadata_bytes)
    finally:
        backend.close()


def _load_error(store: Store, dest: dict[str, Any], **options: Any) -> BaseException:
    with pytest.raises(dcpstore.DcpstoreError) as info:
        dcpstore.load(dest, _ckpt(store), **store.options, **options)
    return info.value


def _dcp_load_error(store: Store, dest: dict[str, Any]) -> BaseException:
    with pytest.raises((CheckpointException, dcpstore.DcpstoreError)) as info:
        dcp.load(dest, storage_reader=dcpstore.get_reader(_ckpt(store), **store.options),
                 no_dist=True)
    return info.value


def _dcp_failure(exc: BaseException) -> str:
    """What ``dcp.load`` reports. DCP turns a failed ``read_metadata`` into an
    ``AssertionError`` quoting the reader's error, so the message is what counts."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    return f"{type(exc).__name__}: {exc}"


# -- hostile .metadata -------------------------------------------------------------------


@pytest.mark.parametrize("technique", ["os_system", "exec", "subprocess", "torch_load",
                                       "nested_in_storage_data"])
def test_hostile_metadata_never_runs(store: Store, technique: str, tmp_path: Path,
                                     spy: list[str]) -> None:
    marker = tmp_path / f"pwned-{technique}"
    probe = tmp_path / f"probe-{technique}"
    md = _save(store)
    if technique == "nested_in_storage_data":
        first = next(iter(md.storage_data))
        live = dataclasses.replace(md)
        live.storage_data = {**md.storage_data, first: _payloads(probe, tmp_path)["os_system"]}
        _assert_live(pickle.dumps(live), probe)
        md.storage_data = {**md.storage_data, first: _payloads(marker, tmp_path)["os_system"]}
        payload = pickle.dumps(md)
    else:
        _assert_live(pickle.dumps(_payloads(probe, tmp_path)[technique]), probe)
        payload = pickle.dumps(_payloads(marker, tmp_path)[technique])
    _forge(store, payload, save_id=_save_id(md))

    dest = {"w": torch.zeros(8), "b": torch.zeros(1024)}
    err = _load_error(store, dest)
    assert isinstance(err, dcpstore.UnsafeCheckpointError), err
    assert ".metadata" in str(err) and "refusing" in str(err)
    assert "refusing to load it" in _dcp_failure(_dcp_load_error(store, dest))
    for op in (verify_checkpoint, inspect_checkpoint):
        with pytest.raises(dcpstore.UnsafeCheckpointError):
            op(_ckpt(store), **store.options)
    with pytest.raises(dcpstore.UnsafeCheckpointError):
        copy_checkpoint(_ckpt(store), f"{store.root}/copy", src_options=store.options,
                        dst_options=store.options)
    gc(f"{store.root}/root", min_age=0, **store.options)  # skips what it cannot read
    assert not marker.exists()
    assert torch.equal(dest["w"], torch.zeros(8))  # nothing was loaded

    # an overwriting save replaces it without running it
    dcpstore.save({"w": torch.ones(8), "b": torch.ones(1024)}, _ckpt(store), overwrite=True,
                  **store.options)
    assert not marker.exists()
    out = {"w": torch.zeros(8), "b": torch.zeros(1024)}
    dcpstore.load(out, _ckpt(store), **store.options)
    assert torch.equal(out["w"], torch.ones(8))
    assert _keys_outside_root(store) == ["sentinel"]


def test_only_the_explicit_opt_in_runs_hostile_metadata(store: Store, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-opt-in"
    md = _save(store)
    _forge(store, pickle.dumps(_payloads(marker, tmp_path)["os_system"]),
           save_id=_save_id(md))
    _load_error(store, {"w": torch.zeros(8)})
    assert not marker.exists()
    with pytest.raises(dcpstore.IntegrityError, match="not DCP Metadata"):
        dcpstore.load({"w": torch.zeros(8)}, _ckpt(store), allow_unsafe_metadata=True,
                      **store.options)
    assert marker.exists()  # the opt-in is what changes it


def test_persistent_ids_in_metadata_refused(store: Store) -> None:
    md = _save(store)
    buf = io.BytesIO()
    _PersistentIds(buf, protocol=2).dump({"weight": _Storage()})
    _forge(store, buf.getvalue(), save_id=_save_id(md))
    err = _load_error(store, {"w": torch.zeros(8)})
    assert isinstance(err, dcpstore.UnsafeCheckpointError) and "persistent ids" in str(err)
    with pytest.raises(dcpstore.UnsafeCheckpointError):
        verify_checkpoint(_ckpt(store), **store.options)


def test_torch_save_archive_as_metadata_refused(store: Store, tmp_path: Path) -> None:
    """``.metadata`` replaced by a ``torch.save`` archive of a payload: not a pickle to
    the restricted unpickler; refused as damaged, nothing runs."""
    marker = tmp_path / "pwned-archive"
    md = _save(store)
    buf = io.BytesIO()
    torch.save(Call(os.system, f"touch {marker}"), buf)
    _forge(store, buf.getvalue(), save_id=_save_id(md))
    with pytest.raises((dcpstore.IntegrityError, dcpstore.UnsafeCheckpointError)):
        dcpstore.load({"w": torch.zeros(8)}, _ckpt(store), **store.options)
    assert not marker.exists()


# -- hostile items -----------------------------------------------------------------------


def test_hostile_object_item_runs_only_with_allow_pickle(store: Store, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-item"
    state = {"w": torch.randn(8), "extra": Call(os.system, f"touch {marker}")}
    dcpstore.save(state, _ckpt(store), **store.options)  # pickling does not run it
    assert not marker.exists()
    err = _load_error(store, {"w": torch.zeros(8), "extra": None})
    assert isinstance(err, dcpstore.UnsafeCheckpointError)
    assert "'extra'" in str(err) and "allow_pickle=True" in str(err)
    failure = _dcp_failure(_dcp_load_error(store, {"w": torch.zeros(8), "extra": None}))
    assert failure.startswith("UnsafeCheckpointError") and "'extra'" in failure
    assert not marker.exists()
    dcpstore.load({"w": torch.zeros(8), "extra": None}, _ckpt(store), allow_pickle=True,
                  **store.options)
    assert marker.exists()  # the opt-in is what changes it


def test_bytesio_item_with_payload(store: Store, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-bytesio"
    buf = io.BytesIO()
    torch.save(Call(os.system, f"touch {marker}"), buf)
    blob = buf.getvalue()
    dcpstore.save({"w": torch.randn(8), "extra": io.BytesIO(blob)}, _ckpt(store),
                  **store.options)
    err = _load_error(store, {"w": torch.zeros(8), "extra": None})
    assert isinstance(err, dcpstore.UnsafeCheckpointError) and "'extra'" in str(err)
    assert not marker.exists()
    out: dict[str, Any] = {"w": torch.zeros(8), "extra": None}
    dcpstore.load(out, _ckpt(store), allow_pickle=True, **store.options)
    assert isinstance(out["extra"], io.BytesIO) and out["extra"].getvalue() == blob
    assert not marker.exists()  # inert bytes until someone unpickles them


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "into_destination"])
def test_tensor_item_replaced_by_pickle_refused(store: Store, tmp_path: Path,
                                               direct: bool) -> None:
    marker = tmp_path / "pwned-tensor"
    md = _save(store)
    (name,) = {i.relative_path for i in md.storage_data.values()}
    backend = store.backend(_ckpt(store))
    original = backend.get(name)
    backend.close()
    buf = io.BytesIO()
    # padded past 64 + 4096 bytes, so the manifest can claim a payload inside it
    torch.save(Call(os.system, f"touch {marker} # {'x' * 5000}"), buf)
    evil = buf.getvalue()
    # "b" (1024 floats) becomes the payload; "w" stays a real tensor after it
    entries = {idx.fqn: (idx, info) for idx, info in md.storage_data.items()}
    w_idx, w_info = entries["w"]
    b_idx, _ = entries["b"]
    w_bytes = original[w_info.offset:w_info.offset + w_info.length]
    blob = evil + w_bytes
    md.storage_data = {b_idx: _StorageInfo(name, 0, len(evil)),
                       w_idx: _StorageInfo(name, len(evil), len(w_bytes))}
    payloads = {name: {0: Payload(64, 4096)}} if direct else None  # "its floats are at 64"
    _forge(store, pickle.dumps(md), save_id=_save_id(md), data={name: blob},
           md=md, payloads=payloads)
    assert verify_checkpoint(_ckpt(store), **store.options).ok  # consistent, as forged

    for allow_pickle in (False, True):
        dest = {"w": torch.zeros(8), "b": torch.zeros(1024)}
        err = _load_error(store, dest, allow_pickle=allow_pickle)
        assert "'b'" in str(err) and "posix.system" in str(err), err  # weights_only said no
        if not direct:  # the direct path reports it as undecodable (IntegrityError)
            assert isinstance(err, dcpstore.UnsafeCheckpointError), err
        assert not marker.exists()


# -- path traversal --------------------------------------------------------------------


def _bad_names(store: Store) -> dict[str, str]:
    absolute = (str(Path(store.root) / "sentinel") if store.name == "local"
                else "/" + store.root.split("://", 1)[1] + "/sentinel")
    return {
        "dotdot": "../../sentinel",
        "absolute": absolute,
        "inner_dotdot": "a/../../../sentinel",
        "backslash": "..\\..\\sentinel",
        "empty": "",
        "nul": "__0_0.distcp\x00../../sentinel",
        # well formed, but no reference the save made (only recorded ones may leave)
        "sibling": "../other-step/__0_0.distcp",
    }


def _exercise(store: Store, md: Metadata, expected: type[BaseException]) -> None:
    """Load, dcp.load, verify, inspect, cp must refuse; gc must leave the outside alone;
    an overwriting save must succeed; the sentinel must be intact."""
    dest = {"w": torch.zeros(8), "b": torch.zeros(1024)}
    with pytest.raises(expected):
        dcpstore.load(dest, _ckpt(store), **store.options)
    assert torch.equal(dest["w"], torch.zeros(8))
    assert "object key" in _dcp_failure(_dcp_load_error(store, dest))
    for op in (verify_checkpoint, inspect_checkpoint):
        with pytest.raises(expected):
            op(_ckpt(store), **store.options)
    copy = f"{store.root}/root/copy"
    with pytest.raises(expected):
        copy_checkpoint(_ckpt(store), copy, src_options=store.options, dst_options=store.options)
    backend = store.backend(copy)
    assert backend.list() == []  # nothing was written for it
    backend.close()
    gc(f"{store.root}/root", min_age=0, **store.options)
    assert _sentinel(store) == SENTINEL
    dcpstore.save({"w": torch.ones(8), "b": torch.ones(1024)}, _ckpt(store), overwrite=True,
                  **store.options)
    assert _sentinel(store) == SENTINEL
    assert _keys_outside_root(store) == ["sentinel"]


@pytest.mark.parametrize("bad", ["dotdot", "absolute", "inner_dotdot", "backslash", "empty",
                                 "nul", "sibling"])
def test_traversal_in_storage_data(store: Store, bad: str, spy: list[str]) -> None:
    md = _save(store)
    name = _bad_names(store)[bad]
    first = next(iter(md.storage_data))
    info = md.storage_data[first]
    md.storage_data = {**md.storage_data, first: _StorageInfo(name, info.offset, info.length)}
    _forge(store, pickle.dumps(md), save_id=_save_id(md))
    _exercise(store, md, dcpstore.UnsafeKeyError)


@pytest.mark.parametrize("bad", ["dotdot", "absolute", "inner_dotdot", "backslash", "empty",
                                 "nul", "sibling"])
def test_traversal_in_manifest(store: Store, bad: str, spy: list[str]) -> None:
    md = _save(store)
    raw = pickle.dumps(md)
    _forge(store, raw, save_id=_save_id(md),
           extra_files={_bad_names(store)[bad]: FileRecord(len(SENTINEL), crc32c(SENTINEL))})
    _exercise(store, md, dcpstore.UnsafeKeyError)


@pytest.mark.parametrize("save_id", ["dcpstore-../../../sentinel", "dcpstore-/../../x",
                                     "dcpstore-a\\..\\..\\x"])
def test_traversal_in_save_id(store: Store, save_id: str, spy: list[str]) -> None:
    """The save id in ``.metadata`` names the manifest object: it is a stored path too."""
    md = _save(store)
    assert md.storage_meta is not None
    md.storage_meta.save_id = save_id
    _forge(store, pickle.dumps(md))
    _exercise(store, md, dcpstore.UnsafeKeyError)
