"""Memory per rank against world size x tensors: what each rank of a ``dcp.save`` and a
``dcp.load`` holds, and who allocated it (dcpstore or torch's DCP).

Each point spawns ``world`` ranks (gloo, CPU, 127.0.0.1) that save and then load a state
dict of ``tensors`` small DTensors, each sharded over all ranks (``Shard(0)``, 16 float32
per rank and tensor), so the bytes are negligible and what grows is bookkeeping: every
rank owns ``tensors`` chunks and the checkpoint holds ``world x tensors``. Per rank and
operation it reports, from :mod:`tracemalloc` (Python allocations only, so no allocator
or page-cache noise):

- ``peak``: the peak of traced memory during the operation, over what was traced just
  before it;
- ``held``: what is still allocated when the operation's last step starts (for a
  dcpstore load: when ``read_data`` starts its range requests, its plan made; for
  torch's reader: ``read_data``; for a save: ``finish`` on the coordinator, the end of
  ``write_data`` on the others), split by
  who allocated it: the innermost frame of each allocation's traceback in dcpstore,
  in torch, or elsewhere; and the dcpstore lines holding the most.

A cost that is per rank's own share stays flat along the world size; one that is per
(rank x tensor) grows linearly with it. Run::

    python -m benchmarks.memory_scaling --worlds 1 2 4 --tensors 1024 4096
    python -m benchmarks.memory_scaling --broadcast-reads   # the object-store load path

Timings are not measured (the machine may be shared); the counts are deterministic up
to the interpreter's own caches.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import sys
import tempfile
import tracemalloc
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from .env import DirtyTree, checkout_text, run_checkout

__all__ = ["main", "measure"]

_DCPSTORE = os.sep + "dcpstore" + os.sep
_TORCH = os.sep + "torch" + os.sep
_ROWS = 16


def _owner(traceback: tracemalloc.Traceback) -> tuple[str, str]:
    """Who made an allocation: (``metadata`` | ``dcpstore`` | ``torch`` | ``other``, the
    innermost such frame of its traceback as ``file:line``). ``metadata``: DCP's
    ``Metadata`` objects, unpickled by dcpstore's restricted unpickler (torch's
    readers unpickle the same objects)."""
    for frame in reversed(traceback):  # most recent call first
        if _DCPSTORE in frame.filename:
            where = frame.filename.rsplit(_DCPSTORE, 1)[1]
            if where == "safe_pickle.py":
                return "metadata", ""
            return "dcpstore", f"{where}:{frame.lineno}"
        if _TORCH in frame.filename:
            return "torch", frame.filename.rsplit(_TORCH, 1)[1] + f":{frame.lineno}"
    return "other", ""


def _held(since: tracemalloc.Snapshot) -> dict[str, Any]:
    """What was allocated after ``since`` and is still held, by owner."""
    now = tracemalloc.take_snapshot()
    by_owner: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    for diff in now.compare_to(since, "traceback"):
        if diff.size_diff <= 0:
            continue
        owner, where = _owner(diff.traceback)
        by_owner[owner] += diff.size_diff
        if owner == "dcpstore":
            lines[where] += diff.size_diff
    return {"by_owner": dict(by_owner), "dcpstore_lines": lines.most_common(8)}


def _rank(rank: int, world: int, port: int, tensors: int, root: str,
          broadcast_reads: bool | None, system: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import dcpstore
    from dcpstore.dcp.writer import Writer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    shape = torch.Size((_ROWS * world,))
    state = {f"layer{i}.weight": DTensor.from_local(
        torch.full((_ROWS,), float(i)), mesh, [Shard(0)], run_check=False,
        shape=shape, stride=(1,)) for i in range(tensors)}
    result: dict[str, Any] = {"rank": rank}
    marks: dict[str, Any] = {}

    def hook(owner: Any, name: str, op: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if op not in marks:  # the first call of the operation's last step
                marks[op] = _held(marks[f"{op}-start"])
            return original(*args, **kwargs)
        setattr(owner, name, wrapped)

    if system == "torch":
        from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
        hook(FileSystemReader, "read_data", "load")
        hook(FileSystemWriter, "finish", "save")

        def writer() -> Any:
            return FileSystemWriter(root)

        def reader() -> Any:
            return FileSystemReader(root)
    else:
        import dcpstore.dcp.reader
        hook(dcpstore.dcp.reader, "fetch_and_deliver", "load")
        hook(Writer, "finish", "save")

        def writer() -> Any:
            return dcpstore.get_writer(root)

        def reader() -> Any:
            return dcpstore.get_reader(root, broadcast_reads=broadcast_reads)
    tracemalloc.start(10)
    for op in ("save", "load"):
        dist.barrier()
        if op == "load":
            for t in state.values():
                t.to_local().zero_()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        marks[f"{op}-start"] = tracemalloc.take_snapshot()
        if op == "save":
            dcp.save(state, storage_writer=writer())
        else:
            dcp.load(state, storage_reader=reader())
        peak = tracemalloc.get_traced_memory()[1] - base
        if op not in marks:  # a non-coordinator of a save: measure after write_data
            marks[op] = _held(marks[f"{op}-start"])
        result[op] = {"peak": peak, **marks[op]}
        del marks[f"{op}-start"]
    ok = all(bool((t.to_local() == float(i)).all()) for i, t in enumerate(state.values()))
    result["verified"] = ok
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    os._exit(0)


def measure(world: int, tensors: int, *, broadcast_reads: bool | None = None,
            system: str = "dcpstore") -> list[dict[str, Any]]:
    """Save and load ``tensors`` sharded tensors on ``world`` ranks with ``system``
    (``dcpstore``, or ``torch``: its ``FileSystemWriter``/``Reader``, the baseline of
    what DCP itself costs); each rank's figures."""
    from dcpstore.testing.servers import free_port

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dcpstore-mem-") as tmp:
        root = os.path.join(tmp, "ckpt")
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, tensors, root,
                                                 broadcast_reads, system, tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} of world {world} left no result "
                                   f"(exit code {procs[r].exitcode})")
            with open(path) as f:
                results.append(json.load(f))
        return results


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def main(argv: list[str] | None = None) -> int:
    """Measure every (tensors, world) point and print the table; ``--json`` also writes
    ``{"checkout", "command", "rows"}`` (one row per point, every rank's figures).
    Returns 2, measuring nothing, when ``--json`` goes into the committed results tree
    from a dirty tree without ``--allow-dirty``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tensors", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--broadcast-reads", action="store_true",
                        help="load with broadcast_reads=True (object stores' default)")
    parser.add_argument("--system", choices=("dcpstore", "torch"), default="dcpstore",
                        help="torch: its FileSystemWriter/Reader (DCP's own cost)")
    parser.add_argument("--json", help="also write every rank's figures here")
    parser.add_argument("--lines", action="store_true",
                        help="print the dcpstore lines holding the most")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write --json from a tree with uncommitted changes (it then "
                             "records the diff's SHA-256)")
    args = parser.parse_args(argv)
    try:
        # before anything is measured: results for the committed tree need a clean one
        checkout = run_checkout(Path(args.json).parent if args.json else None,
                                args.allow_dirty)
    except DirtyTree as exc:
        print(f"python -m benchmarks.memory_scaling: refusing to run: {exc}",
              file=sys.stderr)
        return 2
    rows = []
    print(f"Ran at {checkout_text(checkout)}.")
    print("KiB per rank (tracemalloc); held = allocated by the operation and still held "
          "at its last storage call; rank 0 is the coordinator, 'other' the median of "
          "the others")
    print(f"system {args.system}" + (", broadcast_reads=True" if args.broadcast_reads
                                     else ""))
    print("| op | tensors | ranks | rank | peak | held: metadata | held: dcpstore | "
          "held: torch | held: other | dcpstore B per own chunk |")
    print("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|")
    for tensors in args.tensors:
        for world in args.worlds:
            ranks = measure(world, tensors, system=args.system,
                            broadcast_reads=True if args.broadcast_reads else None)
            if not all(r["verified"] for r in ranks):
                raise RuntimeError(f"world {world}, {tensors} tensors: load not bit-exact")
            rows.append({"world": world, "tensors": tensors, "ranks": ranks})
            for op in ("save", "load"):
                picks = [("0", ranks[0])]
                if world > 1:
                    others = sorted(ranks[1:], key=lambda r: r[op]["peak"])
                    picks.append(("other", others[len(others) // 2]))
                for label, r in picks:
                    fig = r[op]
                    own = fig["by_owner"]
                    cells = [_kib(fig["peak"])] + [_kib(own.get(k, 0)) for k in (
                        "metadata", "dcpstore", "torch", "other")]
                    print(f"| {op} | {tensors} | {world} | {label} | {' | '.join(cells)} | "
                          f"{own.get('dcpstore', 0) / tensors:,.0f} |")
                    if args.lines:
                        for where, size in fig["dcpstore_lines"]:
                            print(f"|  | | | | {where} | | {_kib(size)} | | | |")
    if args.json:
        command = "python -m benchmarks.memory_scaling " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        with open(args.json, "w") as f:
            # older files (benchmarks/results/memory_scaling) are the bare list of rows
            json.dump({"checkout": checkout, "command": command, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
