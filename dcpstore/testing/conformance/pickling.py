"""Conformance: backends, writers and readers survive pickling (process-mode async save)."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcpstore.storage.backend import Backend
from dcpstore.testing.conformance._base import ConformanceBase

__all__ = ["PicklingTests"]


class PicklingTests(ConformanceBase):
    """A pickled backend, writer or reader reaches the same store."""

    def test_picklable(self, backend: Backend) -> None:
        backend.put("p", b"1")
        clone = pickle.loads(pickle.dumps(backend))
        assert clone.get("p") == b"1"
        clone.put("q", b"2")
        assert backend.get("q") == b"2"
        clone.close()

    def test_writer_and_reader_picklable(
        self, checkpoint_uri: str, backend_options: dict[str, Any]
    ) -> None:
        writer = pickle.loads(pickle.dumps(self.writer(checkpoint_uri, backend_options)))
        dcp.save({"w": torch.arange(3.0)}, storage_writer=writer, no_dist=True)
        reader = pickle.loads(pickle.dumps(self.reader(checkpoint_uri, backend_options)))
        out = {"w": torch.zeros(3)}
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(out["w"], torch.arange(3.0))
