"""Multi-process (gloo, CPU, 127.0.0.1) FSDP2 save/load ranks for the S3 backend tests.

The functions here run in spawned rank processes, so they live in an importable module.
``run_ranks(fn, world_size, *args)`` starts the ranks and returns what each returned.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsdp_workers import build, full_state, load_into, sharded_state, train
from mp import run_ranks

import dcpstore

__all__ = ["fsdp_load", "fsdp_save", "run_ranks"]


def fsdp_save(rank: int, world_size: int, uri: str, options: dict[str, Any],
              reference: str) -> dict[str, Any]:
    """Train one step of an FSDP2 model + AdamW, save it with dcpstore to ``uri``; rank 0
    writes the full (unsharded) state to ``reference``. Returns the rank's S3 requests."""
    model, optim = build(world_size, seed=1)
    train(model, optim, 1, seed=100)
    writer = dcpstore.get_writer(uri, **options)
    dcp.save(sharded_state(model, optim), storage_writer=writer)
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, reference)
    backend = writer.backend
    return {"requests": backend.store.request_counts, "coordinator": writer.is_coordinator}


def fsdp_load(rank: int, world_size: int, uri: str, options: dict[str, Any],
              reference: str) -> dict[str, Any]:
    """Load ``uri`` into a freshly initialized FSDP2 model + AdamW at this world size and
    compare the full state with ``reference`` bit for bit (on rank 0)."""
    model, optim = build(world_size, seed=2)  # different init: the load must overwrite it
    reader = dcpstore.get_reader(uri, **options)
    load_into(model, optim, storage_reader=reader)
    full = full_state(model, optim)
    mismatches: list[str] = []
    compared = 0
    if rank == 0:
        expected = torch.load(reference, weights_only=True)
        _compare(full, expected, "", mismatches)
        compared = sum(1 for _ in _tensors(expected))
    return {"mismatches": mismatches, "tensors_compared": compared,
            "bytes_read": reader.bytes_read, "bytes_needed": reader.bytes_needed}


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _compare(actual: Any, expected: Any, path: str, out: list[str]) -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or actual.dtype != expected.dtype \
                or actual.shape != expected.shape:
            out.append(f"{path}: {actual!r} vs {expected!r}")
        elif not torch.equal(actual.view(-1).view(torch.uint8) if actual.numel() else actual,
                             expected.view(-1).view(torch.uint8) if expected.numel()
                             else expected):
            out.append(f"{path}: values differ")
    elif isinstance(expected, dict):
        if set(actual) != set(expected):
            out.append(f"{path}: keys {sorted(map(str, actual))} vs "
                       f"{sorted(map(str, expected))}")
            return
        for k in expected:
            _compare(actual[k], expected[k], f"{path}.{k}", out)
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            out.append(f"{path}: length {len(actual)} vs {len(expected)}")
            return
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _compare(a, e, f"{path}[{i}]", out)
    elif actual != expected:
        out.append(f"{path}: {actual!r} != {expected!r}")
