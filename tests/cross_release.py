"""Checkpoints cross torch releases: one saved under any release of the matrix loads
bit-exact under every other (``make test-matrix`` runs it after the suites).

    python tests/cross_release.py save DIR/<release>   # under each release
    python tests/cross_release.py load DIR             # under each release: every one

A save writes a dcpstore checkpoint of a state with every tensor kind DCP round-trips,
saved by 2 gloo ranks as DTensors sharded unevenly plus plain values, and
``expected.pt`` (torch.save's format is stable across releases) to compare against.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from mp import run_ranks

import dcpstore
from dcpstore.testing import assert_state_equal, many_dtypes_state

ROWS = 13  # sharded over 2 ranks: 7 + 6 rows


def _sharded(rank: int, world: int, full: torch.Tensor) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])


def _save_rank(rank: int, world: int, uri: str, expected: dict[str, Any]) -> bool:
    state = {**expected["plain"], "sharded": _sharded(rank, world, expected["sharded"])}
    dcpstore.save(state, uri)
    return True


def _load_rank(rank: int, world: int, uri: str, expected: dict[str, Any]) -> bool:
    from dcpstore.testing import empty_like_state

    out = {**empty_like_state(expected["plain"]),
           "sharded": _sharded(rank, world, torch.zeros_like(expected["sharded"]))}
    dcpstore.load(out, uri)
    full = out.pop("sharded").full_tensor()
    assert_state_equal(out, expected["plain"])
    assert torch.equal(full, expected["sharded"])
    return dist.get_world_size() == world


def save(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    expected = {"plain": many_dtypes_state(seed=11),
                "sharded": torch.arange(ROWS * 5, dtype=torch.float32).reshape(ROWS, 5)}
    torch.save(expected, directory / "expected.pt")
    run_ranks(_save_rank, 2, str(directory / "ckpt"), expected)
    (directory / "torch-version").write_text(torch.__version__)
    print(f"saved under torch {torch.__version__}: {directory}")


def load(root: Path) -> None:
    saved = sorted(p for p in root.iterdir() if (p / "torch-version").exists())
    if not saved:
        raise SystemExit(f"no checkpoints under {root}")
    for directory in saved:
        expected = torch.load(directory / "expected.pt", weights_only=True)
        for world in (1, 2):
            run_ranks(_load_rank, world, str(directory / "ckpt"), expected)
        print(f"torch {torch.__version__} loaded the checkpoint of torch "
              f"{(directory / 'torch-version').read_text()} at 1 and 2 ranks, bit-exact")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "load"):
        raise SystemExit(__doc__)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    (save if sys.argv[1] == "save" else load)(Path(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown after gloo (see tests/mp.py)
