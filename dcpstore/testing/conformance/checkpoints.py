"""Conformance: whole checkpoints through DCP (layout, commit order, overwrite,
integrity, resharding reads)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore.dcp import layout
from dcpstore.storage.backend import Backend
from dcpstore.testing.conformance._base import ConformanceBase
from dcpstore.testing.state import assert_state_equal, empty_like_state, many_dtypes_state

__all__ = ["CheckpointTests"]


class CheckpointTests(ConformanceBase):
    """DCP save/load through the generic Writer and Reader on this backend."""

    def test_dcp_roundtrip_many_dtypes(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        state = many_dtypes_state()
        dcp.save(state, storage_writer=self.writer(checkpoint_uri, backend_options), no_dist=True)
        out = empty_like_state(state)
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

        def put(key: str, data: bytes, *, atomic: bool = False, **conditions: Any) -> None:
            events.append(f"put {key}")
            orig_put(key, data, atomic=atomic, **conditions)

        def open_upload(key: str, *, size_hint: int | None = None) -> Any:
            up = orig_open(key, size_hint=size_hint)
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

    def test_reshard_reads_only_needed_bytes(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        state = {f"t{i}": torch.randn(256, 64) for i in range(8)}
        dcpstore.save(state, checkpoint_uri, **backend_options)
        reader = self.reader(checkpoint_uri, backend_options, coalesce_gap=0)
        out = {"t3": torch.zeros(256, 64), "t6": torch.zeros(256, 64)}
        dcp.load(out, storage_reader=reader, planner=dcpstore.dcp.api.CheckedLoadPlanner(
            allow_partial_load=True), no_dist=True)
        assert torch.equal(out["t3"], state["t3"]) and torch.equal(out["t6"], state["t6"])
        assert reader.bytes_read == reader.bytes_needed
        assert reader.bytes_needed < 3 * 256 * 64 * 4
        assert reader.requests == 2

    def test_stream_extension_roundtrip(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        pytest.importorskip("zstandard")
        from dcpstore.torch_internals import zstandard_extension

        state = {"w": torch.zeros(10_000), "o": {"k": 1}}
        writer = self.writer(checkpoint_uri, backend_options,
                             _extensions=[zstandard_extension()])
        dcp.save(state, storage_writer=writer, no_dist=True)
        out = {"w": torch.ones(10_000), "o": {"k": 0}}
        dcp.load(out, storage_reader=self.reader(checkpoint_uri, backend_options), no_dist=True)
        assert_state_equal(out, state)
