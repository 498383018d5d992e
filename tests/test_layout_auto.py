"""The automatic data-file layout (``files_per_rank=None``, the default).

On object stores each rank's bytes are cut into files of about the backend's preferred
object size, each stored with one request and, on a same-world-size load, read back
with one GET; counted at the HTTP level through a proxy in front of moto and
fake-gcs-server. An explicit ``files_per_rank`` still decides, and local disk keeps one
file per rank.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stores import Store
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from typing_extensions import Buffer

import dcpstore
from dcpstore.dcp import layout
from dcpstore.dcp.packing import _item_nbytes, _pack_items, _split_items
from dcpstore.dcp.writer import Writer
from dcpstore.storage.backend import BackendOptions, ObjectInfo, Upload
from dcpstore.storage.options import AUTO_MAX_FILES, WriterOptions, resolve_options
from dcpstore.testing import MemoryBackend
from dcpstore.testing.faultproxy import FaultPlan, FaultProxy, RequestInfo

MiB = 1024 * 1024
TENSORS = 12  # of 1 MiB each

# S3: single PutObject up to 8 MiB -> files of up to 7.5 MiB: 7 + 5 tensors.
# GCS: single request below one 4 MiB part -> files of up to 3.75 MiB: 4 x 3 tensors.
STORE_OPTIONS = {
    "s3": {"part_size": 5 * MiB, "multipart_threshold": 8 * MiB},
    "gcs": {"part_size": 4 * MiB},
}
AUTO_FILES = {"s3": 2, "gcs": 4}


def _state(value: float) -> dict[str, Any]:
    return {f"t{i:02d}": torch.full((MiB // 4,), value + i, dtype=torch.float32)
            for i in range(TENSORS)}


def _blank() -> dict[str, Any]:
    return {f"t{i:02d}": torch.zeros(MiB // 4, dtype=torch.float32) for i in range(TENSORS)}


def _data_file(name: str) -> bool:
    return name.endswith(layout.DATA_SUFFIX)


class _Requests:
    """A plan that injects nothing and records every request naming a data file."""

    def __init__(self) -> None:
        self.seen: list[RequestInfo] = []

    def plan(self) -> FaultPlan:
        def match(info: RequestInfo) -> bool:
            if _data_file(info.object_name):
                self.seen.append(info)
            return False

        return FaultPlan(match=match)

    def take(self) -> Counter[str]:
        """Requests on data files by method, since the last call."""
        out = Counter(info.method for info in self.seen)
        self.seen.clear()
        return out


def _save_and_load(store: Store, proxy: FaultProxy, requests: _Requests,
                   **writer: Any) -> tuple[int, Counter[str], Counter[str]]:
    """Save, then load at the same world size, through ``proxy``: the data files made,
    the requests on them while saving and while loading."""
    opts = store.via(proxy.endpoint_url).options
    uri = store.uri("layout")
    requests.take()
    dcpstore.save(_state(1.0), uri, **writer, **opts)
    saved = requests.take()
    files = sorted(f for f in store.files(uri) if _data_file(f))
    out = _blank()
    dcpstore.load(out, uri, **opts)
    loaded = requests.take()
    for key, value in _state(1.0).items():
        assert torch.equal(out[key], value), key
    assert store.uploads(uri) == []
    return len(files), saved, loaded


@pytest.mark.parametrize("store", ["moto", "gcs"], indirect=True)
def test_auto_layout_one_request_per_object(store: Store) -> None:
    assert store.upstream is not None
    requests = _Requests()
    with FaultProxy(store.upstream, requests.plan()) as proxy:
        files, saved, loaded = _save_and_load(store, proxy, requests)
        assert files == AUTO_FILES[store.kind]
        # one upload request per data file: no multipart create/complete, no parts,
        # no compose, no deletes of temporary parts
        assert sum(saved.values()) == files, saved
        # a same-world-size load reads each file with one whole-object GET
        assert loaded == Counter(GET=files), loaded

        # an explicit files_per_rank still decides: one 12 MiB file, a multipart /
        # composite upload (it is over the single-request size), read back in one GET
        files, saved, loaded = _save_and_load(store, proxy, requests, files_per_rank=1)
        assert files == 1
        assert sum(saved.values()) >= 3, saved
        assert loaded == Counter(GET=1), loaded

        files, saved, _ = _save_and_load(store, proxy, requests, files_per_rank=3)
        assert files == 3


@pytest.mark.parametrize("store", ["moto"], indirect=True)
def test_auto_layout_sends_an_announced_file_in_one_put(store: Store) -> None:
    """A tensor chunk over the preferred size gets a file of its own; the writer
    announces its size, so up to part_size x max_concurrency it is one PutObject, and
    only a larger one is a multipart upload."""
    assert store.upstream is not None
    requests = _Requests()
    # single PutObject up to 8 MiB unannounced, up to 5 MiB x 2 = 10 MiB announced
    opts = {"part_size": 5 * MiB, "multipart_threshold": 8 * MiB, "max_concurrency": 2}
    with FaultProxy(store.upstream, requests.plan()) as proxy:
        via = {**store.via(proxy.endpoint_url).options, **opts}
        for mib, single in ((9, True), (12, False)):
            uri = store.uri(f"announced-{mib}")
            state = {"big": torch.full((mib * MiB // 4,), 1.5), "small": torch.ones(8)}
            requests.take()
            dcpstore.save(state, uri, **via)
            saved = requests.take()
            files = sorted(f for f in store.files(uri) if _data_file(f))
            assert len(files) == 2, files  # the big chunk alone, the small one beside
            if single:
                assert saved == Counter(PUT=2), saved
            else:  # create + 3 parts (8 MiB buffer, 4 MiB) + complete; the small file
                assert saved["POST"] == 2 and saved["PUT"] == 3, saved
            out = {"big": torch.zeros(mib * MiB // 4), "small": torch.zeros(8)}
            dcpstore.load(out, uri, **via)
            assert torch.equal(out["big"], state["big"])
            assert torch.equal(out["small"], state["small"])


class _WindowedMemory(MemoryBackend):
    """An in-memory store that asks for files of 1 MiB and whose uploads hold their
    announced size until they end: records the most held at once."""

    def __init__(self, location: str, options: BackendOptions | None = None) -> None:
        super().__init__(location, options)
        self.lock = threading.Lock()
        self.held = self.peak = 0
        self.announced: dict[str, int] = {}

    def preferred_object_size(self) -> int | None:
        return MiB

    def upload_memory(self, size_hint: int | None = None) -> int:
        return max(MiB, size_hint or 0)

    def _open_upload(self, key: str) -> Upload:
        return _HeldUpload(self, key, super()._open_upload(key))


class _HeldUpload(Upload):
    def __init__(self, backend: _WindowedMemory, key: str, inner: Upload) -> None:
        self.backend, self.key, self.inner, self.held = backend, key, inner, 0

    def expect_size(self, nbytes: int) -> None:
        be = self.backend
        with be.lock:
            self.held = be.upload_memory(nbytes)
            be.held += self.held
            be.peak = max(be.peak, be.held)
            be.announced[self.key] = nbytes

    def write(self, data: Buffer) -> int:
        return self.inner.write(data)

    def _end(self) -> None:
        with self.backend.lock:
            self.backend.held -= self.held
            self.held = 0

    def commit(self) -> ObjectInfo:
        try:
            return self.inner.commit()
        finally:
            self._end()

    def abort(self) -> None:
        self.inner.abort()
        self._end()


def test_files_written_at_once_share_the_memory_window() -> None:
    MemoryBackend.create_bucket("window")
    try:
        # window: part_size x max_concurrency = 4 MiB; chunks of 3, 2.5, 2, 1.5 and
        # 1 MiB each get a file (over the 1 MiB preferred size), announced with its size
        backend = _WindowedMemory("window/ckpt", BackendOptions(part_size=MiB,
                                                                max_concurrency=4))
        sizes = [3.0, 2.5, 2.0, 1.5, 1.0, 0.25, 0.25]
        state = {f"t{i}": torch.full((int(mib * MiB) // 4,), float(i))
                 for i, mib in enumerate(sizes)}
        dcp.save(state, storage_writer=Writer(backend), no_dist=True)
        assert 3 * MiB <= backend.peak <= 4 * MiB, backend.peak / MiB
        assert backend.held == 0
        stored = {o.key: o.size for o in backend.list("__")}
        assert set(stored) == set(backend.announced)
        for key, size in stored.items():  # each announcement covers its file
            assert size <= backend.announced[key] < size + 64 * 1024, key
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=dcpstore.Reader(MemoryBackend("window/ckpt")),
                 no_dist=True)
        for key, value in state.items():
            assert torch.equal(out[key], value), key
    finally:
        MemoryBackend.delete_bucket("window")


def test_local_disk_keeps_one_file_per_rank(tmp_path: Path) -> None:
    dcpstore.save(_state(2.0), tmp_path / "c")
    assert len([p for p in (tmp_path / "c").iterdir() if _data_file(p.name)]) == 1


def _item(name: str, nbytes: int, *, of: int | None = None) -> WriteItem:
    """A uint8 tensor item of ``nbytes``: the whole tensor, or this rank's shard of a
    tensor of ``of`` bytes (as DCP plans a DTensor's local shard: ``size`` is the whole
    tensor's, ``chunk.sizes`` the shard's)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData

    return WriteItem(
        index=MetadataIndex(name), type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([nbytes])),
            properties=TensorProperties(dtype=torch.uint8),
            size=torch.Size([nbytes if of is None else of])))


def _byte_item(name: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)


def test_pack_items_fills_files_up_to_the_preferred_size() -> None:
    items = [_item(f"a{i}", 3) for i in range(5)] + [_item("big", 20), _byte_item("b0"),
                                                      _byte_item("b1")]
    files = _pack_items(items, capacity=10, max_files=AUTO_MAX_FILES)
    sizes = sorted(sum(_item_nbytes(i) for i in f) for f in files)
    # the item larger than a file alone; 5 x 3 bytes into files of at most 10
    assert sizes == [6, 9, 20]
    assert sorted(i.index.fqn for f in files for i in f) == sorted(i.index.fqn for i in items)
    # too many files needed: spread evenly over max_files instead
    files = _pack_items([_item(f"c{i}", 10) for i in range(9)], capacity=10, max_files=3)
    assert [sum(_item_nbytes(i) for i in f) for f in files] == [30, 30, 30]
    # only byte items: one file
    assert len(_pack_items([_byte_item("x"), _byte_item("y")], 10, 4)) == 1
    assert _pack_items([], 10, 4) == []


def test_pack_items_counts_a_shard_by_its_own_bytes() -> None:
    # 8 ranks' worth of a 32-byte tensor each: every rank holds 4-byte shards, so four
    # of them fill one 16-byte file (counted by the whole tensor, each shard would look
    # 32 bytes, over the file size, and get a file of its own: W times the files and
    # requests the layout means to make)
    shards = [_item(f"s{i}", 4, of=32) for i in range(8)]
    assert [_item_nbytes(i) for i in shards] == [4] * 8
    files = _pack_items(shards, capacity=16, max_files=AUTO_MAX_FILES)
    assert [sum(_item_nbytes(i) for i in f) for f in files] == [16, 16]


def _in_plan_order(files: list[list[WriteItem]], items: list[WriteItem]) -> bool:
    order = [i.index.fqn for i in items]
    return all([i.index.fqn for i in f] == sorted((i.index.fqn for i in f), key=order.index)
               for f in files)


def test_packing_keeps_the_plan_order_inside_every_file() -> None:
    # sizes that largest-first placement would reorder: 0.weight, 0.bias, 1.weight, ...
    items: list[WriteItem] = []
    for layer, nbytes in enumerate([6, 9, 2, 7, 4]):
        items += [_item(f"{layer}.weight", nbytes), _item(f"{layer}.bias", 1)]
    items.append(_byte_item("extra"))
    for files in (_pack_items(items, capacity=12, max_files=AUTO_MAX_FILES),
                  _pack_items(items, capacity=12, max_files=2),  # spread evenly instead
                  _split_items(items, 3)):
        assert len(files) > 1
        assert sorted(i.index.fqn for f in files for i in f) == sorted(
            i.index.fqn for i in items)
        assert _in_plan_order(files, items), [[i.index.fqn for i in f] for f in files]


def test_automatic_layout_writes_neighbouring_keys_in_plan_order() -> None:
    # through a save with files of about 1 MiB: inside each data file, the offsets rise
    # in the state dict's order
    MemoryBackend.create_bucket("order")
    try:
        sizes = [0.5, 2.0, 0.25, 1.5, 1.0, 0.75]
        state = {f"{n}.weight": torch.full((int(mib * MiB) // 4,), float(n))
                 for n, mib in enumerate(sizes)}
        backend = _WindowedMemory("order/ckpt", BackendOptions(part_size=MiB,
                                                               max_concurrency=4))
        dcp.save(state, storage_writer=Writer(backend), no_dist=True)
        metadata = dcpstore.Reader(MemoryBackend("order/ckpt")).read_metadata()
        per_file: dict[str, list[tuple[int, str]]] = {}
        for index, info in metadata.storage_data.items():
            per_file.setdefault(info.relative_path, []).append((info.offset, index.fqn))
        assert len(per_file) > 1
        order = list(state)
        for path, placed in per_file.items():
            keys = [fqn for _, fqn in sorted(placed)]
            assert keys == sorted(keys, key=order.index), (path, keys)
    finally:
        MemoryBackend.delete_bucket("order")


@pytest.mark.parametrize("store", ["moto"], indirect=True)
def test_s3torchconnector_optimized_reader_streams_neighbours_once(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """s3torchconnector's DCP reader (``dcp_optimized``: one ranged GET per run of
    neighbouring needed items in a file) loads a checkpoint written with dcpstore's
    automatic S3 layout, and neighbouring keys are neighbours in the files: loading
    consecutive layers takes one GET per data file that holds them (largest-first
    placement inside a file split each weight from its bias: more GETs)."""
    # (installed in the development venv, where moto runs; not in the torch matrix's)
    s3tc = pytest.importorskip("s3torchconnector")
    from s3torchconnector.dcp import S3StorageReader

    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    sizes = [0.25, 1.5, 0.5, 2.0, 0.75, 1.25, 0.25, 1.0]  # MiB, so that sizes reorder
    state = {}
    for n, mib in enumerate(sizes):
        state[f"{n}.weight"] = torch.full((int(mib * MiB) // 4,), float(n))
        state[f"{n}.bias"] = torch.full((64,), -float(n))
    uri = store.uri("s3tc")
    dcpstore.save(state, uri, **{**store.options, **STORE_OPTIONS["s3"]})
    metadata = dcpstore.get_reader(uri, **store.options).read_metadata()
    file_of = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    assert len(set(file_of.values())) > 1
    assert store.upstream is not None
    requests = _Requests()
    with FaultProxy(store.upstream, requests.plan()) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)  # the CRT's endpoint
        for keys in ([k for k in state if k.startswith(("1.", "2.", "3."))],
                     [k for k in state if k.startswith(("4.", "5."))], list(state)):
            out = {k: torch.zeros_like(state[k]) for k in keys}
            reader = S3StorageReader(
                region=store.region or "us-east-1", path=uri,
                s3client_config=s3tc.S3ClientConfig(force_path_style=True),
                reader_constructor=s3tc.S3ReaderConstructor.dcp_optimized(max_gap_size=0))
            requests.take()
            dcp.load(out, storage_reader=reader, no_dist=True)
            for k in keys:
                assert torch.equal(out[k], state[k]), k
            assert requests.take()["GET"] == len({file_of[k] for k in keys}), keys


def test_files_per_rank_option_values() -> None:
    def resolve(query: dict[str, str]) -> Any:
        return resolve_options(WriterOptions, scheme="file", explicit={}, query=query,
                               environ={}).files_per_rank

    assert WriterOptions().files_per_rank is None
    assert resolve({"files_per_rank": "auto"}) is None
    assert resolve({"files_per_rank": "4"}) == 4
    with pytest.raises(ValueError, match="files_per_rank"):
        dcpstore.get_writer("file:///tmp/x", files_per_rank=0)
