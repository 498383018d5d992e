"""Which staging a save uses: :class:`StagingOptions`, and what ``staging=`` accepts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["StagingOptions", "as_staging_options"]


@dataclasses.dataclass(frozen=True)
class StagingOptions:
    """How a save snapshots the state before the background write.

    The field names are those of torch's
    ``torch.distributed.checkpoint.staging.StagingOptions``, whose instances are accepted
    wherever this class is.

    Attributes:
        use_pinned_memory: Page-lock the staging arena, so device-to-host copies run at
            full speed and asynchronously (CUDA only; ignored without CUDA).
        use_shared_memory: Put the arena in shared memory, so a background process reads
            it without a copy (always on in ``async_mode="process"``).
        use_async_staging: CUDA: return from ``save`` once the device-to-host copies are
            queued on a side stream; the current stream waits for them, so work queued
            after ``save`` (an optimizer step) cannot change what is saved. The
            background writer waits for the copies before it reads.
        use_non_blocking_copy: Copy device tensors with ``non_blocking=True``
            (needs pinned memory to be truly asynchronous).
    """

    use_pinned_memory: bool = False
    use_shared_memory: bool = False
    use_async_staging: bool = False
    use_non_blocking_copy: bool = True


def as_staging_options(value: Any, *, process: bool = False) -> StagingOptions:
    """Normalize ``staging=`` (``None``/``True``, a mapping, torch's or our options).

    Args:
        value: What the user passed.
        process: Whether a background process reads the arena (forces shared memory).
    """
    if value is None or value is True:
        opts = StagingOptions(use_pinned_memory=torch.cuda.is_available())
    elif isinstance(value, StagingOptions):
        opts = value
    elif isinstance(value, Mapping):
        try:
            opts = StagingOptions(**value)
        except TypeError as exc:
            raise TypeError(f"staging options: {exc}; valid fields are "
                            f"{[f.name for f in dataclasses.fields(StagingOptions)]}") from None
    elif all(hasattr(value, f.name) for f in dataclasses.fields(StagingOptions)):
        opts = StagingOptions(**{f.name: bool(getattr(value, f.name))
                                 for f in dataclasses.fields(StagingOptions)})
    else:
        raise TypeError(f"staging must be None, True, a dcpstore.StagingOptions, torch's "
                        f"StagingOptions or a dict, got {type(value).__name__}")
    if process and not opts.use_shared_memory:
        opts = dataclasses.replace(opts, use_shared_memory=True)
    return opts
