"""Write the golden corpus: checkpoints that later versions of dcpstore must keep loading.

Run from the root of a checkout of the commit whose format is being recorded::

    .venv/bin/python tests/golden/make_golden.py tests/golden/<commit>

It starts 2 gloo CPU ranks (``torch.multiprocessing`` spawn) and writes, through dcpstore's
public API only:

- ``<out>/plain/``: one sharded checkpoint (``dcpstore.save``): a ``Shard(0)`` DTensor, a
  replicated bfloat16 DTensor, a plain int64 tensor, a 0-d float16 tensor, nested Python
  values, a ``bytes`` value and an ``io.BytesIO`` (which DCP pickles whole, so it loads
  only with ``allow_pickle=True``);
- ``<out>/run/``: a ``dcpstore.Checkpointer(..., incremental=True)`` run with steps 1 and
  2, where step 2 changed only part of the tensors and references step 1's files for the
  others.

Every value is built from ``arange`` and exact arithmetic (no random numbers), so
``tests/test_golden.py`` rebuilds the expected values on its own. The builders below
are deliberately duplicated there: the test, not this script, is the reference.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dcpstore

WORLD_SIZE = 2
RUN_STEPS = (1, 2)


# -- the values (mirrored in tests/test_golden.py) ----------------------------------------


def ramp(shape: tuple[int, ...], dtype: torch.dtype, *, scale: float, shift: float) -> torch.Tensor:
    """``arange * scale + shift`` computed in float64 and rounded once to ``dtype``.

    Args:
        shape: Shape of the result.
        dtype: Its floating-point dtype.
        scale: Factor applied to the element index.
        shift: Offset added after scaling.

    Returns:
        A tensor whose bits depend only on IEEE-754 rounding, not on the torch version.
    """
    n = 1
    for dim in shape:
        n *= dim
    values = torch.arange(n, dtype=torch.float64) * scale + shift
    return values.reshape(shape).to(dtype)


def plain_values() -> dict[str, Any]:
    """The full (unsharded) values of the ``plain`` checkpoint.

    Returns:
        Flat mapping of the state's top-level keys to their values.
    """
    return {
        "weight": ramp((64, 16), torch.float32, scale=0.37, shift=-150.0),
        "norm_bf16": ramp((16,), torch.bfloat16, scale=-1.25, shift=7.5),
        "counts": torch.tensor([-(2**63), -(2**40) - 3, -1, 0, 1, 2**40 + 3, 2**63 - 1],
                               dtype=torch.int64),
        "scale_fp16": torch.tensor(1.0 / 3.0, dtype=torch.float16),
        "meta": {
            "epoch": 3,
            "lr": 0.001,
            "name": "golden-plain",
            "milestones": [10, 20, 30],
            "nested": {"ratio": 2.5, "tag": "deep", "flag": True},
        },
        "blob": b"dcpstore golden bytes\x00\x01\x7f\x80\xff",
        "blob_io": b"\x00golden BytesIO payload\xfe\xff",
    }


def run_values(step: int) -> dict[str, Any]:
    """The full values of the incremental run at ``step`` (1 or 2).

    ``frozen`` (16 KiB, sharded) and ``embed`` (8 KiB, plain) are the same at both steps,
    so step 2 references them in step 1; ``head`` and ``adapter`` change.

    Args:
        step: 1 or 2.

    Returns:
        Flat mapping of the state's top-level keys to their values.
    """
    return {
        "frozen": ramp((128, 32), torch.float32, scale=0.0625, shift=-128.0),
        "embed": ramp((64, 64), torch.bfloat16, scale=0.5, shift=-1000.0),
        "head": ramp((32, 64), torch.float32, scale=0.125 * step, shift=float(step)),
        "adapter": ramp((64, 16), torch.float32, scale=-0.75, shift=10.0 * step),
        "trainer": {"step": step, "loss": 1.0 / (step + 1), "phase": f"phase-{step}"},
    }


# -- the ranks -----------------------------------------------------------------------------


def _sharded(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return distribute_tensor(full, mesh, [Shard(0)])


def _replicated(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return distribute_tensor(full, mesh, [Replicate()])


def plain_state(mesh: DeviceMesh) -> dict[str, Any]:
    """The state each rank saves as ``plain``.

    Args:
        mesh: The 1-D CPU device mesh over every rank.

    Returns:
        The state dict handed to :func:`dcpstore.save`.
    """
    v = plain_values()
    return {
        "weight": _sharded(v["weight"], mesh),
        "norm_bf16": _replicated(v["norm_bf16"], mesh),
        "counts": v["counts"],
        "scale_fp16": v["scale_fp16"],
        "meta": v["meta"],
        "blob": v["blob"],
        "blob_io": io.BytesIO(v["blob_io"]),
    }


def run_state(step: int, mesh: DeviceMesh) -> dict[str, Any]:
    """The state each rank saves as ``step`` of ``run``.

    Args:
        step: 1 or 2.
        mesh: The 1-D CPU device mesh over every rank.

    Returns:
        The state dict handed to :meth:`dcpstore.Checkpointer.save`.
    """
    v = run_values(step)
    return {
        "frozen": _sharded(v["frozen"], mesh),
        "embed": v["embed"],
        "head": v["head"],
        "adapter": _sharded(v["adapter"], mesh),
        "trainer": v["trainer"],
    }


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world_size,))

    dcpstore.save(plain_state(mesh), os.path.join(out, "plain"))

    ckpt = dcpstore.Checkpointer(os.path.join(out, "run"), incremental=True)
    for step in RUN_STEPS:
        ckpt.save(step, run_state(step, mesh))
    ckpt.close()

    dist.barrier()  # no rank tears gloo down while another still talks to it
    # a clean finish: skip the interpreter's teardown, in which gloo can abort
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_references(out: str) -> list[str]:
    """The ``relative_path`` entries of step 2 that point into step 1 (must be some)."""
    step2 = os.path.join(out, "run", "step-000000002")
    md = dcp.FileSystemReader(step2).read_metadata()
    refs = sorted({info.relative_path for info in (md.storage_data or {}).values()
                   if info.relative_path.startswith("../step-000000001/")})
    if not refs:
        raise SystemExit(f"step 2 references nothing in step 1: {md.storage_data}")
    return refs


def main(argv: list[str] | None = None) -> int:
    """Write the corpus into a new directory.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="new directory to write plain/ and run/ into")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    if os.path.exists(out) and os.listdir(out):
        parser.error(f"{out} exists and is not empty")
    os.makedirs(out, exist_ok=True)
    print(f"dcpstore {dcpstore.__version__} from {dcpstore.__file__}, torch {torch.__version__}")
    mp.spawn(_rank, args=(WORLD_SIZE, _free_port(), out), nprocs=WORLD_SIZE, join=True)
    for ref in _check_references(out):
        print(f"step 2 references {ref}")
    total = 0
    for folder, _, files in os.walk(out):
        for name in sorted(files):
            path = os.path.join(folder, name)
            total += os.path.getsize(path)
            print(f"{os.path.getsize(path):8d}  {os.path.relpath(path, out)}")
    print(f"{total} bytes in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
