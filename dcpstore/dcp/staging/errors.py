"""How a background (async) save reports its failure."""

from __future__ import annotations

from dcpstore.errors import DcpstoreError

__all__ = ["BackgroundWriterDiedError", "CheckpointSaveError"]


class CheckpointSaveError(DcpstoreError):
    """A background (async) save failed; nothing of it was committed (unless the message
    says the failure came after the commit)."""


class BackgroundWriterDiedError(CheckpointSaveError):
    """The background writer process of this rank died (killed, out of memory, ...).

    The save it was writing is not committed; the next save starts a new process.
    """
