"""The Checkpointer on two gloo ranks: the calls a user makes on one rank alone, and a
store call that only the coordinator makes failing there.

A regression here would hang the ranks, so every launch has a timeout (``run_ranks``
kills the ranks and fails the test when it runs out).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from mp import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcpstore
from dcpstore.dcp import layout
from dcpstore.errors import AccessDeniedError
from dcpstore.storage.local import LocalBackend
from dcpstore.testing.faults import Fault, FaultBackend
from dcpstore.training.latest import step_dir

#: Seconds a launch may take; a rank left waiting in a collective fails the test here.
TIMEOUT = 120


def _state(mesh: Any, value: float) -> dict[str, Any]:
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4) + value
    return {"d": distribute_tensor(full, mesh, [Shard(0)]), "n": int(value)}


def _faulty_local() -> type[FaultBackend]:
    """``faultylocal:/<path>``: local files behind this process's own faults (each rank
    registers it; only the ranks that add faults to ``shared.faults`` see failures)."""
    base = FaultBackend.wrapping(LocalBackend, [])

    class FaultyLocal(base):  # type: ignore[valid-type,misc]
        shared: ClassVar[Any] = base.shared

        @classmethod
        def from_uri(cls, uri: Any, options: Any) -> Any:
            return cls(LocalBackend("/" + uri.location, options), _state=cls.shared)

    dcpstore.register_backend("faultylocal", FaultyLocal, clobber=True)
    return FaultyLocal


# -- listing calls on one rank alone -------------------------------------------------------


def _listing_on_one_rank(rank: int, world_size: int, root: str,
                         local: str | None) -> dict[int, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = dcpstore.Checkpointer(root, keep_last=3, local_tier=local,
                                 drain_policy="every")
    for step in (1, 2):
        ckpt.save(step, _state(mesh, step))
    ckpt.wait()
    seen: dict[int, Any] = {}
    for caller in range(world_size):
        if rank == caller:  # as a user logs or decides on one rank
            latest = ckpt.latest()
            seen[caller] = {"steps": [(int(s), s.where) for s in ckpt.steps()],
                            "latest": None if latest is None else (int(latest),
                                                                   latest.where),
                            "uri": ckpt.step_uri(2)}
        dist.barrier()  # the other ranks are elsewhere (here: in a barrier)
    out = _state(mesh, 0)
    loaded = ckpt.load(out)  # the Checkpointer still works on every rank after that
    assert loaded == 2 and torch.equal(out["d"].to_local(), _state(mesh, 2)["d"].to_local())
    ckpt.close()
    return seen


@pytest.mark.parametrize("tier", [False, True], ids=["root", "local-tier"])
def test_steps_and_latest_on_one_rank_alone(tmp_path: Path, tier: bool) -> None:
    local = str(tmp_path / "local") if tier else None
    results = run_ranks(_listing_on_one_rank, 2, str(tmp_path / "root"), local,
                        timeout=TIMEOUT)
    # keep_last_local=1: step 1 is at the root only
    where = [(1, "remote"), (2, "both")] if tier else [(1, "remote"), (2, "remote")]
    for rank, seen in enumerate(results):
        assert seen == {rank: {"steps": where, "latest": where[-1],
                               "uri": str(tmp_path / "root" / step_dir(2))}}


# -- a store call only the coordinator makes, failing there --------------------------------


def _local_retention_root_fails(rank: int, world_size: int, root: str,
                                local: str) -> dict[str, Any]:
    faulty = _faulty_local()
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = dcpstore.Checkpointer(f"faultylocal:/{root}", local_tier=local,
                                 keep_last_local=1, drain_policy="every")
    ckpt.save(1, _state(mesh, 1))
    ckpt.wait()  # step 1 is at the root
    if rank == 0:
        # local retention asks the root whether step 1 is there before deleting the local
        # copy: only the coordinator asks, and its queries of the run root now fail (the
        # drain's requests inside the step directory still go through)
        denied = PermissionError("denied (injected)")
        faulty.shared.faults.extend([Fault("list", times=0, key="", error=denied),
                                     Fault("stat", times=0, key="step-*", error=denied),
                                     Fault("read", times=0, key="step-*", error=denied),
                                     Fault("get", times=0, key=".dcpstore-*", error=denied)])
    failed: str | None = None
    try:
        ckpt.save(2, _state(mesh, 2))  # committed locally; local retention fails on rank 0
        ckpt.wait()  # drained; the drain's local retention fails on rank 0 too
    except Exception as exc:
        failed = type(exc).__name__
    kept = (Path(local) / step_dir(1) / layout.METADATA_KEY).exists()
    faulty.shared.faults.clear()
    steps = [(int(s), s.where) for s in ckpt.steps()]
    ckpt.close()
    return {"failed": failed, "kept": kept, "steps": steps}


def test_coordinator_root_failure_in_local_retention_reaches_every_rank(
        tmp_path: Path) -> None:
    """The local tier's retention: the coordinator alone asks the root which local steps
    are safe to delete. When that fails, every rank goes on alike (a retention failure is
    logged, the local steps stay), none waits for an answer that never comes."""
    results = run_ranks(_local_retention_root_fails, 2, str(tmp_path / "root"),
                        str(tmp_path / "local"), timeout=TIMEOUT)
    # step 1 stays in the local tier: whether the root holds it could not be confirmed
    assert results == [{"failed": None, "kept": True,
                        "steps": [(1, "both"), (2, "both")]}] * 2


def _load_root_check_fails(rank: int, world_size: int, root: str, local: str) -> str:
    faulty = _faulty_local()
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = dcpstore.Checkpointer(f"faultylocal:/{root}", local_tier=local,
                                 drain_policy="every")
    ckpt.save(1, _state(mesh, 1))
    ckpt.wait()
    dist.barrier()
    if rank == 0:
        # the local copy fails its CRC32C check
        victim = max((p for p in (Path(local) / step_dir(1)).iterdir()
                      if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
        victim.write_bytes(bytes(data))
        # then the coordinator asks the root whether it holds the step: denied
        faulty.shared.faults.append(
            Fault("stat", times=0, key="*.metadata", error=PermissionError("denied")))
    dist.barrier()
    try:
        ckpt.load(_state(mesh, 0), step=1)
    except Exception as exc:
        kind = type(exc).__name__
    else:
        kind = "loaded"
    faulty.shared.faults.clear()
    ckpt.close()
    return kind


def test_coordinator_root_check_in_load_fails_on_every_rank(tmp_path: Path) -> None:
    """The local copy of a step fails its read; the coordinator alone asks the root whether
    it holds the step, and that fails: every rank raises that failure's kind."""
    results = run_ranks(_load_root_check_fails, 2, str(tmp_path / "root"),
                        str(tmp_path / "local"), timeout=TIMEOUT)
    assert results == ["AccessDeniedError", "AccessDeniedError"]


class _Unpicklable(AccessDeniedError):
    """A store error that holds what does not pickle (say, its SDK's connection)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()  # pickling the error fails on it


def _weights_metadata_fails(rank: int, world_size: int, root: str) -> tuple[str, str]:
    faulty = _faulty_local()
    model = torch.nn.Linear(4, 3)
    uri = f"faultylocal:/{root}"
    dcpstore.save({"model": model.state_dict()}, uri)
    dist.barrier()
    if rank == 0:  # the coordinator alone reads the checkpoint's keys first
        faulty.shared.faults.append(Fault("get", key="*.metadata",
                                          error=_Unpicklable("metadata denied")))
    try:
        dcpstore.load_model_weights(torch.nn.Linear(4, 3), uri)
    except Exception as exc:
        found = (type(exc).__name__, str(exc))
    else:
        found = ("loaded", "")
    faulty.shared.faults.clear()
    return found


def test_coordinator_failure_reading_weights_keys_fails_on_every_rank(
        tmp_path: Path) -> None:
    results = run_ranks(_weights_metadata_fails, 2, str(tmp_path / "ckpt"),
                        timeout=TIMEOUT)
    """The coordinator alone reads the checkpoint's keys; its failure, one that does not
    pickle, reaches the other rank as an error that names it (no rank waits)."""
    (kind0, message0), (kind1, message1) = results
    assert kind0 == "_Unpicklable" and "metadata denied" in message0
    assert kind1 == "DcpstoreError" and "_Unpicklable: metadata denied" in message1
