"""Resharding matrix on the local backend: FSDP2 + AdamW and DTensors saved at 1, 2, 4
ranks, loaded at 1, 2, 3, 4.

Bit-exact model, optimizer and DTensor state; training resumes with the same losses as
the uninterrupted run. The other backends' test modules run ``run_matrix`` against their
servers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reshard_workers import run_matrix

pytestmark = pytest.mark.multiprocess


def test_reshard_matrix_local(tmp_path: Path) -> None:
    run_matrix(str(tmp_path), {})
