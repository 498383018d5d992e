"""Resharding matrix: FSDP2 + AdamW and DTensors saved at 1, 2, 4 ranks, loaded at 1-4.

Bit-exact model, optimizer and DTensor state; training resumes with the same losses as
the uninterrupted run. Other backends reuse ``run_matrix`` with their own URIs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from mp import run_ranks
from reshard_workers import PLACEMENTS, SAVE_STEP, load_run, save_run

from dcpstore.testing import assert_state_equal

pytestmark = pytest.mark.multiprocess

SAVE_SIZES = (1, 2, 4)
LOAD_SIZES = (1, 2, 3, 4)


def run_matrix(
    root: str,
    options: dict[str, Any],
    save_sizes: tuple[int, ...] = SAVE_SIZES,
    load_sizes: tuple[int, ...] = LOAD_SIZES,
) -> None:
    roots = [f"{root}/saved-at-{n}" for n in save_sizes]
    reference = [
        run_ranks(save_run, n, r, options)[0] for n, r in zip(save_sizes, roots, strict=True)
    ]
    base = torch.arange(70, dtype=torch.float32).reshape(7, 10)
    for m in load_sizes:
        results = run_ranks(load_run, m, roots, options)[0]
        for n, ref, got in zip(save_sizes, reference, results, strict=True):
            where = f"saved at {n} ranks, loaded at {m}"
            assert got["step"] == SAVE_STEP, where
            assert_state_equal(got["state"], ref["state"], where)
            for i, name in enumerate(PLACEMENTS):
                assert torch.equal(got["dt"][name], base * (i + 1)), f"{where}: {name}"
            torch.testing.assert_close(
                torch.tensor(got["losses"]),
                torch.tensor(ref["losses"]),
                rtol=1e-5,
                atol=1e-7,
                msg=where,
            )


def test_reshard_matrix_local(tmp_path: Path) -> None:
    run_matrix(str(tmp_path), {})
