"""Rank functions of the read-once tests: replicated and HSDP-like (2-D mesh) state saved
on 4 ranks, loaded with and without read sharing through counting proxies."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpstore
from dcpstore.dcp import layout, read_share
from dcpstore.dcp.metadata_io import load_metadata, read_manifest
from dcpstore.testing import assert_state_equal

__all__ = ["corrupt_payload_byte", "hsdp_state", "incremental_state", "read_once_run",
           "replicated_state"]


def replicated_state(fill: bool) -> dict[str, Any]:
    """State that every rank holds whole: DDP parameters, biases, optimizer scalars, a
    ``Replicate`` DTensor and plain Python objects."""
    g = torch.Generator().manual_seed(5)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) if fill else torch.zeros(*shape)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {
        "model.w1": t(256, 512),
        "model.w2": t(128, 512),
        "model.b1": t(512),
        "model.norm": t(512),
        "optim.step": torch.tensor(7.0 if fill else 0.0),
        "optim.lr": torch.tensor(3e-4 if fill else 0.0, dtype=torch.float64),
        "rep": distribute_tensor(t(64, 256), mesh, [Replicate()]),
        "extra": {"epoch": 3 if fill else 0, "tag": "run7" if fill else ""},
    }


def hsdp_state(fill: bool) -> dict[str, Any]:
    """HSDP-like state on a 2 x 2 mesh: sharded within a replica group (dim ``shard``),
    replicated across groups (dim ``replicate``)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(11)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) if fill else torch.zeros(*shape)

    return {
        "layers.0.w": distribute_tensor(t(128, 512), mesh, [Replicate(), Shard(0)]),
        "layers.1.w": distribute_tensor(t(256, 256), mesh, [Replicate(), Shard(0)]),
        "layers.0.b": distribute_tensor(t(512), mesh, [Replicate(), Replicate()]),
        "step": torch.tensor(9.0 if fill else 0.0),
    }


def incremental_state(fill: bool) -> dict[str, Any]:
    """The replicated state one step later: only the biases changed."""
    state = replicated_state(fill)
    if fill:
        state["model.b1"] += 1.0
    return state


def _local(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def corrupt_payload_byte(uri: str, options: dict[str, Any], fqn: str) -> None:
    """Flip one byte in the middle of ``fqn``'s tensor payload, in the store."""
    backend = dcpstore.open_backend(uri, **options)
    metadata, _ = load_metadata(backend)
    manifest = read_manifest(backend, layout.save_id_of_metadata(metadata), required=True)
    assert manifest is not None and metadata.storage_data is not None
    info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == fqn)
    payload = manifest.item_payload(info.relative_path, info.offset)
    assert payload is not None
    data = bytearray(backend.get(info.relative_path))
    data[info.offset + payload.start + payload.nbytes // 2] ^= 0x5A
    backend.put(info.relative_path, bytes(data))


def _load(state: dict[str, Any], uri: str, options: dict[str, Any]) -> dict[str, Any]:
    """A plain ``dcp.load`` with a dcpstore reader; ``process_group=None`` (the world) in
    ``options`` tells the reader the load's group, as :func:`dcpstore.load` does."""
    reader = dcpstore.get_reader(uri, **options)
    try:
        dcp.load(state, storage_reader=reader)
    finally:
        reader.backend.close()
    return {"bytes_read": reader.bytes_read, "bytes_needed": reader.bytes_needed,
            "bytes_received": reader.bytes_received, "bytes_sent": reader.bytes_sent}


def read_once_run(rank: int, world: int, roots: dict[str, str], direct: dict[str, Any],
                  via: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Save the replicated and the HSDP state, then load each through its own proxy
    (``via[phase]``: backend options aimed at it); load a corrupted copy last."""
    out: dict[str, Any] = {}
    # small pieces and windows, so that these small tensors are split over fetching
    # ranks and several windows as large ones are by default
    read_share.MIN_PIECE = 64 * 1024
    read_share.WINDOW_BYTES = 256 * 1024
    dcpstore.save(replicated_state(True), roots["rep"], **direct)
    dcpstore.save(hsdp_state(True), roots["hsdp"], **direct)
    dcpstore.save(replicated_state(True), roots["bad"], **direct)
    dcpstore.save(replicated_state(True), roots["gone"], **direct)
    # an incremental step: everything but the biases is a reference into step 1
    dcpstore.save(replicated_state(True), roots["inc1"], **direct)
    dcpstore.save(incremental_state(True), roots["inc2"], base=roots["inc1"], **direct)
    if rank == 0:
        corrupt_payload_byte(roots["bad"], direct, "model.w1")
        backend = dcpstore.open_backend(roots["gone"], **direct)
        files = [o for o in backend.list() if o.key.endswith(".distcp")]
        backend.delete([max(files, key=lambda o: o.size).key])
    dist.barrier()

    world = {"process_group": None}
    for phase, root, make, extra in (
        ("rep_on", roots["rep"], replicated_state, world),
        ("rep_off", roots["rep"], replicated_state, {"broadcast_reads": False, **world}),
        ("hsdp_on", roots["hsdp"], hsdp_state, world),
        ("inc_on", roots["inc2"], incremental_state, world),
        # no group given: every rank reads .metadata, the data reads are still shared
        ("rep_nogroup", roots["rep"], replicated_state, {}),
    ):
        state = make(False)
        stats = _load(state, root, {**via[phase], **extra})
        assert_state_equal(_local(state), _local(make(True)))
        out[phase] = stats
        dist.barrier()  # the proxy of this phase is idle before the next one starts

    state = replicated_state(False)
    try:
        _load(state, roots["bad"], {**direct, **world})
        out["bad"] = "loaded"
    except CheckpointException as exc:
        out["bad"] = {
            r: type(f[0] if isinstance(f, tuple) else f).__name__ + ": "
            + str(f[0] if isinstance(f, tuple) else f)
            for r, f in exc.failures.items()
        }
    # a data file gone: its fetching ranks fail, the others stop with them (no hang)
    try:
        dcpstore.load(replicated_state(False), roots["gone"], **direct)
        out["gone"] = "loaded"
    except Exception as exc:
        out["gone"] = f"{type(exc).__name__}: {exc}"
    return out


def nccl_world_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """The world's backend as if it were NCCL (it cannot move the CPU tensors the shared
    bytes travel in): a load given the world as its group shares over a gloo side group
    made once over the world. Then a load whose reader was given no group: shared over
    the world all the same, with one warning."""
    from dcpstore.dcp import reader as reader_module

    dcpstore.save(replicated_state(True), root)
    real = read_share._moves_cpu_tensors

    def nccl_world(group: Any) -> bool:
        return False if group is None or group is dist.group.WORLD else real(group)

    read_share._moves_cpu_tensors = nccl_world  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        for phase, extra in (("world", {"process_group": None}), ("nogroup", {})):
            state = replicated_state(False)
            out[phase] = _load(state, root, {"broadcast_reads": True, **extra})
            assert_state_equal(_local(state), _local(replicated_state(True)))
            side = read_share._SIDE_GROUPS.get(dist.group.WORLD)
            out[phase]["side_group"] = None if side is None else str(dist.get_backend(side))
    finally:
        read_share._moves_cpu_tensors = real  # type: ignore[assignment]
    out["warned"] = reader_module._warned.is_set()
    return out
