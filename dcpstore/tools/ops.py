"""Operations on whole checkpoints: list, inspect, verify, copy, remove, garbage-collect.

These are what the ``dcpstore`` CLI runs; they work on any backend. Byte-moving
operations take a ``progress`` callback receiving byte counts. They live by command
family: :mod:`dcpstore.tools.listing` (``ls``, ``inspect``), :mod:`dcpstore.tools.verify`
(``verify``) and :mod:`dcpstore.tools.maintenance` (``cp``, ``rm``, ``gc``); this module
re-exports them all.
"""

from __future__ import annotations

from dcpstore.tools.listing import (
    CheckpointInfo,
    inspect_checkpoint,
    list_checkpoints,
    list_checkpoints_tiered,
)
from dcpstore.tools.maintenance import GcReport, copy_checkpoint, gc, remove_checkpoint
from dcpstore.tools.verify import Progress, VerifyReport, verify_checkpoint

__all__ = [
    "CheckpointInfo",
    "GcReport",
    "Progress",
    "VerifyReport",
    "copy_checkpoint",
    "gc",
    "inspect_checkpoint",
    "list_checkpoints",
    "list_checkpoints_tiered",
    "remove_checkpoint",
    "verify_checkpoint",
]
