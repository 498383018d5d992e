"""Run a function on N torch.distributed ranks (gloo, CPU, 127.0.0.1) from a test."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        value = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears gloo down while another still talks to it
        results[rank] = ("ok", value)
    except BaseException as exc:
        results[rank] = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Returns the per-rank return values; raises with each failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = []
        port = free_port()
        for rank in range(world_size):
            p = ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, results))
            p.start()
            procs.append(p)
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        out = dict(results)
    errors = [f"rank {r}: {v[1]}" for r, v in sorted(out.items()) if v[0] == "error"]
    missing = [r for r in range(world_size) if r not in out]
    if errors or missing:
        raise AssertionError("\n".join(errors + [f"rank {r} died or hung" for r in missing]))
    return [out[r][1] for r in range(world_size)]
