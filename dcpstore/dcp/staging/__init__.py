"""Staging for async saves, and the persistent background writer process.

- :class:`StagingOptions` names torch's staging choices (pinned memory, shared memory,
  async staging, non-blocking copies); torch's own ``StagingOptions`` is accepted too.
- :class:`Stager` snapshots a state dict into one preallocated arena that lives across
  saves: the first save allocates it, every later save with the same layout copies into
  the same memory. The arena is shared memory (a ``memfd``) when a background process
  writes from it, so nothing is pickled per save but the plan.
- :class:`BackgroundWriter` is one persistent process per rank that runs the data-writing
  part of a save (serialization, checksums, uploads) from the shared arena, while the
  collective parts (planning, commit) stay in the parent. :class:`ProxyWriter` is the DCP
  ``StorageWriter`` that hands ``write_data`` to it.

The modules: :mod:`~dcpstore.dcp.staging.options`, :mod:`~dcpstore.dcp.staging.arena`,
:mod:`~dcpstore.dcp.staging.stager`, :mod:`~dcpstore.dcp.staging.background` (the
parent's side of the process), :mod:`~dcpstore.dcp.staging.worker` (the process itself)
and :mod:`~dcpstore.dcp.staging.errors`.
"""

from __future__ import annotations

from dcpstore.dcp.staging.arena import progress_counter as progress_counter
from dcpstore.dcp.staging.background import BackgroundWriter, ProxyWriter
from dcpstore.dcp.staging.errors import BackgroundWriterDiedError, CheckpointSaveError
from dcpstore.dcp.staging.options import StagingOptions, as_staging_options
from dcpstore.dcp.staging.stager import StagedState, Stager

__all__ = [
    "BackgroundWriter",
    "BackgroundWriterDiedError",
    "CheckpointSaveError",
    "ProxyWriter",
    "StagedState",
    "Stager",
    "StagingOptions",
    "as_staging_options",
]
