"""dcpstore's version, and the oldest torch release it supports (no torch import here)."""

from __future__ import annotations

import re

__version__ = "0.1.0"

#: The oldest torch release dcpstore supports (``major, minor``): the oldest one the torch
#: matrix passes (``make test-matrix``); ``pyproject.toml`` declares the same floor.
TORCH_FLOOR = (2, 9)


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``"2.10.0+cu128"``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2])


def check_torch_floor(version: str) -> None:
    """Raise ``ImportError`` naming :data:`TORCH_FLOOR` if torch ``version`` is older."""
    if release(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(
            f"dcpstore needs torch >= {floor}; this is torch {version}. Install a newer "
            f"torch (pip install 'torch>={floor}') or an older dcpstore.")
