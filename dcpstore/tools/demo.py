"""The demo: 2 CPU ranks train a small FSDP2 model, save it, and it reloads at world size 1.

``dcpstore demo [--uri URI]`` (or ``python -m dcpstore demo``). Without ``--uri`` the
checkpoint goes to a temporary directory. Any supported URI works, e.g.
``AWS_ENDPOINT_URL=http://127.0.0.1:8333 dcpstore demo --uri s3://bucket/demo``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = ["DemoResult", "run_demo"]

_STEPS = 3


class _Model(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


def _build(width: int, depth: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    return (model := _Model(width, depth)), torch.optim.AdamW(model.parameters(), lr=1e-3)


def _digest(state: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key, value in sorted(state.items()):
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _digest(value).items()})
        elif isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu().reshape(-1)
            out[key] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()
                                      if t.numel() else b"").hexdigest()
        else:
            out[key] = repr(value)
    return out


def _rank_main(rank: int, world: int, port: int, uri: str, width: int, depth: int,
               options: dict[str, Any], queue: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcpstore

    # the command's stdout is its report (``--json``: one JSON document); whatever a rank
    # prints, torch's gloo included ("[Gloo] Rank N is connected ..." on some releases),
    # goes to stderr, at the file-descriptor level since gloo writes from C++
    sys.stdout.flush()
    os.dup2(2, 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, _ = _build(width, depth, seed=0)
        mesh = init_device_mesh("cpu", (world,))
        for layer in cast(nn.ModuleList, model.layers):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        loss = torch.tensor(0.0)
        for _ in range(_STEPS):
            loss = model(torch.randn(16, width, generator=g)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd},
                 storage_writer=dcpstore.get_writer(uri, overwrite=True, **options))
        elapsed = time.perf_counter() - t0
        full_m, full_o = get_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            queue.put((elapsed, _digest({"model": full_m, "optim": full_o}), float(loss.detach())))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    # Leave without interpreter teardown: native thread pools (gloo, OpenMP) sometimes
    # abort with "terminate called without an active exception" while being destroyed,
    # after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class DemoResult:
    """What the demo did."""

    uri: str
    bytes: int
    files: int
    save_seconds: float
    load_seconds: float
    tensors: int
    bit_exact: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(uri: str | None = None, *, width: int = 512, depth: int = 8, world_size: int = 2,
             echo: Any = print, **options: Any) -> DemoResult:
    """Train on ``world_size`` CPU ranks, save to ``uri``, reload at world size 1, compare.

    Args:
        uri: Where to save (default: a new temporary directory).
        width: Hidden size of the demo model.
        depth: Number of layers.
        world_size: Ranks that train and save.
        echo: Where progress lines go.
        **options: Writer/reader/backend options passed to ``get_writer``/``get_reader``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dcpstore
    from dcpstore.dcp.dist import single_process_quiet

    if uri is None:
        uri = os.path.join(tempfile.mkdtemp(prefix="dcpstore-demo-"), f"step-{_STEPS:06d}")
    dcpstore.get_writer(uri, **options)  # bad URI or options: fail here, before spawning ranks
    echo(f"dcpstore {dcpstore.__version__} demo: {world_size} CPU ranks (gloo), FSDP2 model "
         f"{depth}x{width}x{width} + AdamW, {_STEPS} training steps")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, uri, width, depth,
                                                  options, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        raise RuntimeError("a demo rank failed; see its traceback above")
    save_seconds, expected, loss = queue.get()

    reader = dcpstore.get_reader(uri, **options)
    model, optim = _build(width, depth, seed=1234)  # different init: all must come from the store
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    t0 = time.perf_counter()
    with single_process_quiet():
        dcp.load(state, storage_reader=reader, no_dist=True)
    load_seconds = time.perf_counter() - t0
    set_state_dict(model, optim, model_state_dict=cast(Any, state["model"]),
                   optim_state_dict=cast(Any, state["optim"]))
    got = _digest(state)
    manifest = reader.manifest
    total = manifest.total_bytes if manifest else reader.bytes_read
    files = len(manifest.files) if manifest else 0
    result = DemoResult(uri, total, files, save_seconds, load_seconds, len(expected),
                        got == expected)
    mb = total / 1e6
    echo(f"trained {_STEPS} steps (last loss {loss:.4f}); saved {mb:.1f} MB in {files} data "
         f"files to {uri}")
    echo(f"  save: {save_seconds:.2f} s  ({mb / save_seconds:.0f} MB/s, {world_size} ranks)")
    echo(f"  load: {load_seconds:.2f} s  ({mb / load_seconds:.0f} MB/s, world size 1, "
         f"{reader.requests} range requests, CRC32C verified)")
    if result.bit_exact:
        echo(f"  resharded {world_size} -> 1: all {len(expected)} model and optimizer entries "
             "bit-exact")
    else:
        bad = [k for k in expected if got.get(k) != expected[k]][:5]
        echo(f"  MISMATCH after reload: {', '.join(bad)}")
    return result
