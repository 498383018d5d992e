"""The conformance suite every backend passes (in the style of fsspec's abstract tests).

Use it from a backend's test module::

    from dcpstore.testing import BackendConformance

    class TestMyStore(BackendConformance):
        @pytest.fixture
        def checkpoint_uri(self, my_server):          # a fresh, empty location per test
            return f"mystore://bucket/{uuid.uuid4().hex}"

        @pytest.fixture
        def backend_options(self, my_server):         # options for open_backend/get_writer
            return {"endpoint_url": my_server.url}

Class attributes tune expectations where stores legitimately differ.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore import layout
from dcpstore.backend import Backend, ReadRange

__all__ = ["BackendConformance", "assert_state_equal", "many_dtypes_state"]


def many_dtypes_state(seed: int = 0) -> dict[str, Any]:
    """A state dict exercising every tensor kind DCP must round-trip, plus objects."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(33, 7, generator=g),
        "f64": torch.randn(5, dtype=torch.float64, generator=g),
        "f16": torch.randn(4, 4, generator=g).half(),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "bool": torch.rand(10, generator=g) > 0.5,
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "view_t": base.t(),
        "view_slice": base[1:4, ::2],
        "nested": {"w": torch.arange(12.0).reshape(3, 4), "step": 7},
        "obj": {"name": "run7", "lr": 3e-4, "milestones": [1, 2, 3]},
        "text": "hello",
    }


def _empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous())
        elif isinstance(v, dict):
            out[k] = _empty_like_state(v)
        else:
            out[k] = None
    return out


def assert_state_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Bit-exact comparison of nested state (tensors compared by bytes, dtype, shape)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        a = actual.detach().contiguous().view(-1)
        e = expected.detach().contiguous().view(-1)
        if a.numel():
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                               e.view(torch.uint8) if e.dtype != torch.bool else e), path
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{path}: keys {set(actual)} != {set(expected)}"
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}" if path else k)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _payload(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


class BackendConformance:
    """Abstract test-suite for backends. Override ``checkpoint_uri`` (and
    ``backend_options`` when the backend needs options, e.g. an endpoint)."""

    #: Local files are visible under their unique name while being written.
    uploads_visible_before_commit: bool = False

    # -- fixtures a backend test overrides -----------------------------------------------

    @pytest.fixture
    def checkpoint_uri(self) -> str:
        raise NotImplementedError("override the checkpoint_uri fixture")

    @pytest.fixture
    def backend_options(self) -> dict[str, Any]:
        return {}

    # -- fixtures the suite provides -------------------------------------------------------

    @pytest.fixture
    def backend(self, checkpoint_uri: str, backend_options: dict[str, Any]) -> Iterator[Backend]:
        be = dcpstore.open_backend(checkpoint_uri, **backend_options)
        yield be
        be.close()

    def writer(self, uri: str, options: dict[str, Any], **kw: Any) -> dcpstore.Writer:
        return dcpstore.get_writer(uri, **options, **kw)

    def reader(self, uri: str, options: dict[str, Any], **kw: Any) -> dcpstore.Reader:
        return dcpstore.get_reader(uri, **options, **kw)

    # -- object-level contract -----------------------------------------------------------

    def test_put_get_roundtrip(self, backend: Backend) -> None:
        backend.put("small.bin", b"hello world")
        assert backend.get("small.bin") == b"hello world"
        assert backend.stat("small.bin").size == 11
        assert backend.exists("small.bin")

    def test_atomic_put_replaces(self, backend: Backend) -> None:
        backend.put("m", b"old", atomic=True)
        backend.put("m", b"new!", atomic=True)
        assert backend.get("m") == b"new!"
        assert [o.key for o in backend.list()] == ["m"]

    def test_missing_key_is_file_not_found(self, backend: Backend) -> None:
        with pytest.raises(FileNotFoundError):
            backend.get("nope")
        with pytest.raises(FileNotFoundError):
            backend.stat("nope")
        assert not backend.exists("nope")
        with pytest.raises(FileNotFoundError):
            list(backend.read_ranges([ReadRange("nope", 0, 4)]))

    def test_list_and_delete(self, backend: Backend) -> None:
        for key in ("a/1", "a/2", "b/1", "c"):
            backend.put(key, key.encode())
        assert [o.key for o in backend.list()] == ["a/1", "a/2", "b/1", "c"]
        assert [o.key for o in backend.list("a/")] == ["a/1", "a/2"]
        assert {o.key: o.size for o in backend.list("b")} == {"b/1": 3}
        backend.delete(["a/1", "c", "does-not-exist"])
        assert [o.key for o in backend.list()] == ["a/2", "b/1"]

    def test_stream_roundtrip_multipart(self, backend: Backend) -> None:
        part = backend.options.part_size
        data = _payload(2 * part + 12345)
        with backend.open_upload("big.distcp") as up:
            pos = 0
            rng = random.Random(3)
            while pos < len(data):
                step = rng.choice([1, 17, 4096, part // 3, part + 5])
                up.write(memoryview(data)[pos : pos + step])
                pos += step
            info = up.commit()
        assert info.size == len(data)
        assert backend.stat("big.distcp").size == len(data)
        assert backend.get("big.distcp") == data

    def test_small_stream_roundtrip(self, backend: Backend) -> None:
        with backend.open_upload("tiny") as up:
            up.write(b"abc")
            up.write(bytearray(b"def"))
            up.commit()
        assert backend.get("tiny") == b"abcdef"

    def test_empty_stream(self, backend: Backend) -> None:
        up = backend.open_upload("empty")
        assert up.commit().size == 0
        assert backend.get("empty") == b""

    def test_aborted_upload_leaves_nothing(self, backend: Backend) -> None:
        part = backend.options.part_size
        up = backend.open_upload("aborted.distcp")
        up.write(_payload(part + 10))
        if not self.uploads_visible_before_commit:
            assert not backend.exists("aborted.distcp")
        up.abort()
        up.abort()  # idempotent
        assert not backend.exists("aborted.distcp")
        assert backend.list_uploads() == []

    def test_failed_write_leaves_nothing(self, backend: Backend) -> None:
        with pytest.raises(RuntimeError, match="serializer"), backend.open_upload("f") as up:
            up.write(b"x" * 1000)
            raise RuntimeError("serializer broke")
        assert not backend.exists("f")

    def test_read_ranges(self, backend: Backend) -> None:
        data = _payload(300_000, seed=5)
        backend.put("r", data)
        ranges = [ReadRange("r", 0, 10), ReadRange("r", 299_990, 10), ReadRange("r", 5, 0),
                  ReadRange("r", 1000, 123_456)] + [ReadRange("r", i * 997, 513) for i in range(40)]
        got = dict(backend.read_ranges(ranges))
        assert sorted(got) == list(range(len(ranges)))
        for i, r in enumerate(ranges):
            assert bytes(got[i]) == data[r.offset : r.offset + r.length]

    def test_read_ranges_into_buffers(self, backend: Backend) -> None:
        data = _payload(4096, seed=6)
        backend.put("r", data)
        bufs = [memoryview(bytearray(100)), memoryview(bytearray(50))]
        list(backend.read_ranges([ReadRange("r", 0, 100), ReadRange("r", 4046, 50)], bufs))
        assert bytes(bufs[0]) == data[:100] and bytes(bufs[1]) == data[4046:]

    def test_scatter_read(self, backend: Backend) -> None:
        """One range filled into several buffers in order (reads into tensors)."""
        data = _payload(1_000_000, seed=7)
        backend.put("s", data)
        sizes = [3, 0, 700_000, 1, 99_996]
        bufs = [memoryview(bytearray(n)) for n in sizes]
        done = list(backend.read_ranges([ReadRange("s", 200_000, sum(sizes))], [bufs]))
        assert [i for i, _ in done] == [0]
        assert b"".join(bytes(b) for b in bufs) == data[200_000 : 200_000 + sum(sizes)]
        with pytest.raises(ValueError):
            list(backend.read_ranges([ReadRange("s", 0, 10)], [[memoryview(bytearray(9))]]))

    def test_read_past_end_fails(self, backend: Backend) -> None:
        backend.put("short", b"0123456789")
        with pytest.raises((OSError, EOFError)):
            list(backend.read_ranges([ReadRange("short", 5, 100)]))

    @pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b", "a//b", "./x", ""])
    def test_unsafe_keys_refused(self, backend: Backend, key: str) -> None:
        with pytest.raises(dcpstore.UnsafeKeyError):
            backend.put(key, b"x")
        with pytest.raises(dcpstore.UnsafeKeyError):
            backend.get(key)

    def test_picklable(self, backend: Backend) -> None:
        backend.put("p", b"1")
        clone = pickle.loads(pickle.dumps(backend))
        assert clone.get("p") == b"1"
        clone.put("q", b"2")
        assert backend.get("q") == b"2"
        clone.close()

    # -- DCP-level contract --------------------------------------------------------------

    def test_dcp_roundtrip_many_dtypes(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        state = many_dtypes_state()
        dcp.save(state, storage_writer=self.writer(checkpoint_uri, backend_options), no_dist=True)
        out = _empty_like_state(state)
        dcp.load(out, storage_reader=self.reader(checkpoint_uri, backend_options), no_dist=True)
        assert_state_equal(out, state)

    def test_checkpoint_id_passed_to_dcp(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        state = {"w": torch.randn(8, 3)}
        writer = self.writer(checkpoint_uri + "-unused", backend_options)
        dcp.save(state, checkpoint_id=checkpoint_uri, storage_writer=writer, no_dist=True)
        out = {"w": torch.zeros(8, 3)}
        reader = self.reader(checkpoint_uri + "-unused", backend_options)
        dcp.load(out, checkpoint_id=checkpoint_uri, storage_reader=reader, no_dist=True)
        assert torch.equal(out["w"], state["w"])

    def test_save_load_wrappers_and_layout(
        self, checkpoint_uri: str, backend_options: dict[str, Any], backend: Backend
    ) -> None:
        state = {"a": torch.randn(100, 10), "b": {"c": torch.arange(5)}}
        dcpstore.save(state, checkpoint_uri, **backend_options)
        keys = [o.key for o in backend.list()]
        assert ".metadata" in keys
        assert sum(k.endswith(".distcp") for k in keys) == 1
        assert sum(k.startswith(".dcpstore-") for k in keys) == 1
        out = {"a": torch.zeros(100, 10), "b": {"c": torch.zeros(5, dtype=torch.int64)}}
        dcpstore.load(out, checkpoint_uri, **backend_options)
        assert_state_equal(out, state)

    def test_commit_ordering(self, checkpoint_uri: str, backend_options: dict[str, Any]) -> None:
        events: list[str] = []
        writer = self.writer(checkpoint_uri, backend_options, files_per_rank=2)
        backend = writer.backend
        orig_put, orig_open = backend.put, backend.open_upload

        def put(key: str, data: bytes, *, atomic: bool = False) -> None:
            events.append(f"put {key}")
            orig_put(key, data, atomic=atomic)

        def open_upload(key: str) -> Any:
            up = orig_open(key)
            orig_commit = up.commit

            def commit() -> Any:
                events.append(f"commit {key}")
                return orig_commit()

            up.commit = commit  # type: ignore[method-assign]
            return up

        backend.put = put  # type: ignore[method-assign]
        backend.open_upload = open_upload  # type: ignore[method-assign]
        dcp.save({"x": torch.randn(64), "y": torch.randn(64), "o": [1]},
                 storage_writer=writer, no_dist=True)
        assert events[-1] == "put .metadata"
        assert events[-2].startswith("put .dcpstore-")
        assert sum(e.startswith("commit __") for e in events[:-2]) == 2

    def test_overwrite_refused_before_writing(
        self, checkpoint_uri: str, backend_options: dict[str, Any], backend: Backend
    ) -> None:
        first = {"w": torch.ones(4)}
        dcpstore.save(first, checkpoint_uri, **backend_options)
        before = sorted(o.key for o in backend.list())
        with pytest.raises(dcpstore.CheckpointExistsError, match="overwrite=True"):
            dcpstore.save({"w": torch.zeros(4)}, checkpoint_uri, **backend_options)
        assert sorted(o.key for o in backend.list()) == before
        out = {"w": torch.zeros(4)}
        dcpstore.load(out, checkpoint_uri, **backend_options)
        assert torch.equal(out["w"], first["w"])

    def test_overwrite_replaces_and_removes_stale_files(
        self, checkpoint_uri: str, backend_options: dict[str, Any], backend: Backend
    ) -> None:
        dcpstore.save({"w": torch.ones(4)}, checkpoint_uri, **backend_options)
        old = {o.key for o in backend.list()}
        dcpstore.save({"w": torch.full((4,), 2.0)}, checkpoint_uri, overwrite=True,
                      **backend_options)
        new = {o.key for o in backend.list()}
        assert not (old & new) - {".metadata"}, "files of the old save were left behind"
        out = {"w": torch.zeros(4)}
        dcpstore.load(out, checkpoint_uri, **backend_options)
        assert torch.equal(out["w"], torch.full((4,), 2.0))

    def test_failed_save_commits_nothing_and_keeps_old(
        self, checkpoint_uri: str, backend_options: dict[str, Any], backend: Backend
    ) -> None:
        dcpstore.save({"w": torch.ones(4), "o": 1}, checkpoint_uri, **backend_options)
        before = sorted(o.key for o in backend.list())

        class Unpicklable:
            def __reduce__(self) -> Any:
                raise RuntimeError("cannot serialize this object")

        with pytest.raises(RuntimeError, match="cannot serialize"):
            dcpstore.save({"w": torch.zeros(4), "o": Unpicklable()}, checkpoint_uri,
                          overwrite=True, **backend_options)
        assert sorted(o.key for o in backend.list()) == before
        out: dict[str, Any] = {"w": torch.zeros(4), "o": 0}
        dcpstore.load(out, checkpoint_uri, **backend_options)
        assert torch.equal(out["w"], torch.ones(4)) and out["o"] == 1

    def test_missing_checkpoint(self, checkpoint_uri: str, backend_options: dict[str, Any]) -> None:
        with pytest.raises(dcpstore.CheckpointNotFoundError, match="no checkpoint"):
            dcpstore.load({"w": torch.zeros(1)}, checkpoint_uri, **backend_options)

    def test_incomplete_checkpoint_detected(
        self, checkpoint_uri: str, backend_options: dict[str, Any], backend: Backend
    ) -> None:
        backend.put(layout.data_file_name(0, 0, layout.new_save_id()), b"partial")
        with pytest.raises(dcpstore.IncompleteCheckpointError, match="incomplete checkpoint"):
            dcpstore.load({"w": torch.zeros(1)}, checkpoint_uri, **backend_options)

    def test_corrupted_byte_detected(
        self, checkpoint_uri: str, backend_options: dict[str, Any], backend: Backend
    ) -> None:
        state = {"w": torch.randn(1000)}
        dcpstore.save(state, checkpoint_uri, **backend_options)
        (data_key,) = [o.key for o in backend.list("__")]
        raw = bytearray(backend.get(data_key))
        raw[len(raw) - 100] ^= 0x01  # inside the tensor bytes
        backend.delete([data_key])
        backend.put(data_key, bytes(raw))
        with pytest.raises(dcpstore.IntegrityError, match=rf"{data_key}.*'w'"):
            dcpstore.load({"w": torch.zeros(1000)}, checkpoint_uri, **backend_options)

    def test_key_mismatch_is_clear(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        dcpstore.save({"w": torch.randn(4)}, checkpoint_uri, **backend_options)
        with pytest.raises(dcpstore.CheckpointMismatchError, match="missing_key"):
            dcpstore.load({"w": torch.zeros(4), "missing_key": torch.zeros(1)}, checkpoint_uri,
                          **backend_options)
        with pytest.raises(dcpstore.CheckpointMismatchError, match=r"w: checkpoint \[4\]"):
            dcpstore.load({"w": torch.zeros(5)}, checkpoint_uri, **backend_options)

    def test_writer_and_reader_picklable(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        writer = pickle.loads(pickle.dumps(self.writer(checkpoint_uri, backend_options)))
        dcp.save({"w": torch.arange(3.0)}, storage_writer=writer, no_dist=True)
        reader = pickle.loads(pickle.dumps(self.reader(checkpoint_uri, backend_options)))
        out = {"w": torch.zeros(3)}
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(out["w"], torch.arange(3.0))

    def test_reshard_reads_only_needed_bytes(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        state = {f"t{i}": torch.randn(256, 64) for i in range(8)}
        dcpstore.save(state, checkpoint_uri, **backend_options)
        reader = self.reader(checkpoint_uri, backend_options, coalesce_gap=0)
        out = {"t3": torch.zeros(256, 64), "t6": torch.zeros(256, 64)}
        dcp.load(out, storage_reader=reader, planner=dcpstore.api.CheckedLoadPlanner(
            allow_partial_load=True), no_dist=True)
        assert torch.equal(out["t3"], state["t3"]) and torch.equal(out["t6"], state["t6"])
        assert reader.bytes_read == reader.bytes_needed
        assert reader.bytes_needed < 3 * 256 * 64 * 4
        assert reader.requests == 2

    def test_stream_extension_roundtrip(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        pytest.importorskip("zstandard")
        from torch.distributed.checkpoint._extension import ZStandard

        state = {"w": torch.zeros(10_000), "o": {"k": 1}}
        writer = self.writer(checkpoint_uri, backend_options, _extensions=[ZStandard()])
        dcp.save(state, storage_writer=writer, no_dist=True)
        out = {"w": torch.ones(10_000), "o": {"k": 0}}
        dcp.load(out, storage_reader=self.reader(checkpoint_uri, backend_options), no_dist=True)
        assert_state_equal(out, state)



